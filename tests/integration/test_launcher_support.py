"""Helpers for the ftmem-launch tests (real processes): start agents, read their logs, reap.

Every agent runs in its own session; the fixture :func:`launches` remembers every
descendant it ever saw (ranks lead their own sessions, so killing the agent's group does
not reach them), kills what is left after the test and asserts that all of them are gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_gpt.py"
# A model small enough that a step takes tens of milliseconds on one core.
TINY = [
    "--d-model",
    "32",
    "--n-layers",
    "1",
    "--n-heads",
    "2",
    "--vocab",
    "64",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--log-every",
    "1",
]
DIGEST_RE = re.compile(r"\[rank (\d+)\] digest ([0-9a-f]+)")


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer exists (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait until every pid is gone; return those still alive after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    alive = {p for p in pids if not pid_gone(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {p for p in alive if not pid_gone(p)}
    return alive


def shm_files(run_id: str) -> list[str]:
    """Arena files of ``run_id`` in /dev/shm."""
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"ftmem-{run_id}-"))


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def short_dir(prefix: str = "ftl-") -> Path:
    """A short private directory under /tmp (ipc socket paths are limited to ~100 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def wait_verified(run_dir: Path, ranks: set[int], timeout: float) -> None:
    """Wait until the SMP's event log shows a verified snapshot of every rank in ``ranks``.

    Commits are asynchronous and a rank's first save is skipped while its slots are
    allocated, so under load a rank may hold nothing yet although its peers logged steps.
    """
    path = run_dir / "smp-events.jsonl"
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while time.monotonic() < deadline:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line being written
                    continue
                if event.get("event") == "verified":
                    seen.add(int(event["rank"]))
        if ranks <= seen:
            return
        time.sleep(0.1)
    pytest.fail(f"no verified snapshot of ranks {sorted(ranks - seen)} within {timeout} s")


def digests(text: str) -> dict[int, str]:
    """``{rank: digest}`` from the ``[rank R] digest HEX`` lines of a log."""
    return {int(r): d for r, d in DIGEST_RE.findall(text)}


class Launch:
    """One ``python -m launcher`` process started by a test, logging to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.seen: set[int] = set()
        with open(log, "w") as f:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "ftmem.launch", *args],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
            )
        self.pid = self.popen.pid

    def text(self) -> str:
        """The log so far."""
        return self.log.read_text(errors="replace")

    def descendants(self) -> set[int]:
        """The agent's current descendants (also remembered in ``seen``)."""
        try:
            kids = {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            kids = set()
        self.seen |= kids
        return kids

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match[str]]:
        """Wait until ``pattern`` matched ``count`` times in the log; fail the test otherwise."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            self.descendants()
            found = list(rx.finditer(self.text()))
            if len(found) >= count:
                return found
            if time.monotonic() > deadline or self.popen.poll() is not None:
                if len(found := list(rx.finditer(self.text()))) >= count:
                    return found
                pytest.fail(
                    f"{pattern!r} x{count} not seen in {timeout} s "
                    f"(exit {self.popen.poll()}); log tail:\n{self.text()[-3000:]}"
                )
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        """Wait for the agent to exit (collecting descendants meanwhile); return its code."""
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(
                    f"agent still running after {timeout} s; log tail:\n{self.text()[-3000:]}"
                )
            self.descendants()
            time.sleep(0.1)
        return int(self.popen.returncode)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the agent only."""
        self.descendants()
        os.kill(self.pid, sig)

    def kill_all(self) -> None:
        """Stop the agent (SIGTERM, bounded wait), then SIGKILL its group and every descendant."""
        self.descendants()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)  # lets it stop its SMP (frees the arenas)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


class Launcher:
    """Starts agents for one test and cleans up after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.launches: list[Launch] = []
        self.run_ids: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of an agent: the repo on PYTHONPATH, one thread per rank."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(":")
        env["OMP_NUM_THREADS"] = "1"
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        # Standby ranks cost ~4 CPU-s each to warm up on these 2 cores; only the tests of
        # standbys (tests/faults/test_standby.py) turn them on (the flag wins over this).
        env["PET_FTMEM_STANDBY"] = "0"
        env.update(extra)
        return env

    def new_run_id(self) -> str:
        """A unique run id (shared-memory names carry it)."""
        rid = "tl" + uuid.uuid4().hex[:10]
        self.run_ids.append(rid)
        return rid

    def start(self, args: list[str], name: str = "agent", **env: str) -> Launch:
        """Start ``python -m launcher ARGS`` logging to ``<tmp>/<name>.log``."""
        launch = Launch(args, self.tmp / f"{name}.log", self.env(**env))
        self.launches.append(launch)
        return launch

    def single_node(
        self,
        run_id: str,
        nproc: int,
        ftmem: list[str],
        script: list[str],
        name: str = "agent",
        **env: str,
    ) -> Launch:
        """One node, c10d rendezvous on a free local port."""
        args = [
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--rdzv-id",
            run_id,
            "--monitor-interval",
            "0.1",
            "--ftmem-node",
            "n0",
            "--ftmem-run-dir",
            str(self.tmp / f"{name}-rd"),
            *ftmem,
            *script,
        ]
        return self.start(args, name, **env)

    def cleanup(self) -> None:
        """Kill everything still alive; assert every process and arena is gone."""
        for launch in self.launches:
            launch.kill_all()
        seen = {p for launch in self.launches for p in launch.seen | {launch.pid}}
        alive = wait_gone(seen, 15)
        assert not alive, f"processes left behind: {alive}"
        for rid in self.run_ids:
            assert shm_files(rid) == [], f"shared memory of {rid} left behind"


@pytest.fixture
def launcher_env() -> Iterator[Launcher]:
    """A :class:`Launcher` in a short tmp dir; every process it started is gone afterwards."""
    tmp = short_dir()
    launcher = Launcher(tmp)
    try:
        yield launcher
    finally:
        launcher.cleanup()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


_REFERENCE: dict[tuple[str, ...], dict[int, str]] = {}


def reference_digests(launcher: Launcher, steps: int) -> dict[int, str]:
    """Digests of a failure-free 2-rank run of the example (cached per session)."""
    key = (str(steps),)
    if key not in _REFERENCE:
        rid = launcher.new_run_id()
        ref = launcher.single_node(
            rid, 2, [], [str(EXAMPLE), "--steps", str(steps), *TINY], name="reference"
        )
        assert ref.wait(90) == 0, ref.text()[-3000:]
        _REFERENCE[key] = digests(ref.text())
        assert len(_REFERENCE[key]) == 2
    return _REFERENCE[key]
