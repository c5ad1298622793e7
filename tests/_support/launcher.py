"""ftmem-launch agents started by tests (real processes): start them, read their logs, reap.

Agents are :class:`~ftmem.testing.harness.AgentProcess` es (a session each, a log file); the
``launcher_env`` fixture (tests/conftest.py) gives a test a :class:`Launcher`, which
remembers every descendant it ever saw (ranks lead their own sessions, so killing the
agent's group does not reach them), kills what is left after the test and asserts that all
of them are gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ftmem.launch.peers import host_key_path
from ftmem.testing.harness import (
    AgentProcess,
    Timeout,
    agent_env,
    free_port,
    launch_args,
    shm_files,
    wait_gone,
)
from tests._support.procs import REPO, WORKLOAD

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

__all__ = [
    "TINY",
    "WORKLOAD",
    "Launch",
    "Launcher",
    "digests",
    "reference_digests",
    "short_dir",
    "wait_verified",
]


def short_dir(prefix: str = "ftl-") -> Path:
    """A short private directory under /tmp (ipc socket paths are limited to ~100 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def wait_verified(run_dir: Path, ranks: set[int], timeout: float, min_step: int = 0) -> None:
    """Wait until the SMP's event log shows a verified snapshot of step ``min_step`` or newer
    of every rank in ``ranks``.

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
                if event.get("event") == "verified" and int(event.get("step", -1)) >= min_step:
                    seen.add(int(event["rank"]))
        if ranks <= seen:
            return
        time.sleep(0.1)
    pytest.fail(f"no verified snapshot of ranks {sorted(ranks - seen)} within {timeout} s")


def digests(text: str) -> dict[int, str]:
    """``{rank: digest}`` from the ``[rank R] digest HEX`` lines of a log."""
    return {int(r): d for r, d in DIGEST_RE.findall(text)}


class Launch(AgentProcess):
    """One ``ftmem-launch`` agent started by a test; its waits fail the test when they run
    out (or the agent exits first)."""

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match[str]]:
        """Wait until ``pattern`` matched ``count`` times in the log; fail the test otherwise."""
        try:
            return self.wait_log(pattern, timeout, count)
        except RuntimeError as exc:
            pytest.fail(str(exc))

    def wait(self, timeout: Timeout) -> int:
        """Wait for the agent to exit (collecting descendants meanwhile); return its code."""
        code = super().wait(timeout)
        if code is None:
            pytest.fail(f"agent still running after {timeout} s; log tail:\n{self.text()[-3000:]}")
        return code

    def kill_all(self) -> None:
        """Stop the agent (SIGTERM, bounded wait), then SIGKILL its group and every descendant."""
        self.stop(term_timeout=20.0)


class Launcher:
    """Starts agents for one test and cleans up after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.launches: list[Launch] = []
        self.run_ids: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of an agent: the repo on PYTHONPATH, one thread per rank.

        Standby ranks cost ~4 CPU-s each to warm up on these 2 cores; only the tests of
        standbys (tests/faults/test_standby.py) turn them on (the flag wins over this).
        """
        return agent_env(extra, pythonpath=[REPO])

    def new_run_id(self) -> str:
        """A unique run id (shared-memory names carry it)."""
        rid = "tl" + uuid.uuid4().hex[:10]
        self.run_ids.append(rid)
        return rid

    def start(self, args: list[str], name: str = "agent", **env: str) -> Launch:
        """Start ``python -m ftmem.launch ARGS`` logging to ``<tmp>/<name>.log``."""
        launch = Launch.launch(args, self.tmp / f"{name}.log", self.env(**env), cwd=REPO)
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
        args = launch_args(
            nproc=nproc,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_id=run_id,
            node="n0",
            run_dir=self.tmp / f"{name}-rd",
            flags=ftmem,
            script=script,
        )
        return self.start(args, name, **env)

    def cleanup(self) -> None:
        """Kill everything still alive; assert every process and arena is gone."""
        for launch in self.launches:
            launch.kill_all()
        seen = {p for launch in self.launches for p in launch.seen | {launch.pid}}
        alive = wait_gone(seen, 15)
        assert not alive, f"processes left behind: {alive}"
        for rid in self.run_ids:  # an agent that was killed leaves its host's job key
            host_key_path(rid).unlink(missing_ok=True)
        left = {rid: shm_files(rid) for rid in self.run_ids}
        for path in (p for paths in left.values() for p in paths):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a failed test (its SMPs SIGKILLed) leaks nothing either
        for rid, paths in left.items():
            assert paths == [], f"shared memory of {rid} left behind"


_REFERENCE: dict[tuple[str, ...], dict[int, str]] = {}


def failure_free_digests(launcher: Launcher, script: list[str], timeout: float) -> dict[int, str]:
    """Digests of a failure-free 2-rank run of ``script`` (a data-parallel run: checked to be
    the same on both ranks)."""
    ref = launcher.single_node(launcher.new_run_id(), 2, [], script, name="reference")
    assert ref.wait(timeout) == 0, ref.text()[-3000:]
    want = digests(ref.text())
    assert len(want) == 2 and len(set(want.values())) == 1
    return want


def reference_digests(launcher: Launcher, steps: int, nproc: int = 2) -> dict[int, str]:
    """Digests of a failure-free single-node run of the example with ``nproc`` ranks (the
    world size of the job it is compared with; cached per session)."""
    key = (str(steps), str(nproc))
    if key not in _REFERENCE:
        rid = launcher.new_run_id()
        script = [str(WORKLOAD), "--steps", str(steps), *TINY]
        ref = launcher.single_node(rid, nproc, [], script, name=f"reference{nproc}")
        assert ref.wait(240) == 0, ref.text()[-3000:]
        _REFERENCE[key] = digests(ref.text())
        assert len(_REFERENCE[key]) == nproc
    return dict(_REFERENCE[key])
