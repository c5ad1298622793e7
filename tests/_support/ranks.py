"""Run the test workload as real ranks (what a launcher does), and read their output."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests._support.launcher import free_port
from tests._support.procs import REPO, WORKLOAD

FORKRANKS = Path(__file__).resolve().with_name("forkranks.py")

SMALL = [
    "--d-model",
    "64",
    "--n-layers",
    "2",
    "--n-heads",
    "2",
    "--vocab",
    "128",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "20",
    "--log-every",
    "100",
]


@dataclass
class RankRun:
    """The exit codes and the output of each rank of one run."""

    codes: list[int | None]
    outputs: list[str]

    def lines(self, pattern: str) -> list[str]:
        """Group 1 of every match of ``pattern`` in every rank's output."""
        rx = re.compile(pattern)
        return [m.group(1) for out in self.outputs for m in rx.finditer(out)]

    def digests(self) -> set[str]:
        """The distinct final digests the ranks printed."""
        return set(self.lines(r"\] digest ([0-9a-f]{64})"))

    def resumed(self) -> list[int]:
        """The step each rank resumed from."""
        return [int(x) for x in self.lines(r"\] resumed from step (\d+)")]


def run_ranks(
    workdir: Path,
    args: list[str],
    *,
    world: int = 2,
    env_extra: dict[str, str] | None = None,
    timeout: float = 120.0,
    tag: str = "run",
    script: Path = WORKLOAD,
    rank_env: list[dict[str, str]] | None = None,
    code: str | None = None,
) -> RankRun:
    """Start ``world`` ranks of ``script`` (default: the workload), wait (bounded) for all
    to exit, return codes + output.

    The ranks are forked from a zygote that this test process's zygote server forked
    (tests/_support/forkranks.py: it imported torch once for every run): each runs the script
    as ``python script.py`` would, in its own environment. ``code``, instead of ``script``:
    Python source each rank runs as ``python -c`` would. When one rank dies, the others fail
    in their next collective and exit; if any rank still runs after ``timeout``, every rank is
    killed (codes then -9).
    """
    # A file store: a TCP port picked in advance can be taken by another process before
    # rank 0 binds it, and rank 1 then waits on a stranger's socket.
    stamp = time.monotonic_ns()
    store = workdir / f"{tag}-{stamp}.store"
    args = [*args, "--init-method", f"file://{store}"]
    common = dict(
        os.environ,
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        **(env_extra or {}),
    )
    logs = [workdir / f"{tag}-rank{r}.log" for r in range(world)]
    ranks = [
        {
            "env": dict(
                common, RANK=str(r), LOCAL_RANK=str(r), **(rank_env[r] if rank_env else {})
            ),
            "log": str(logs[r]),
        }
        for r in range(world)
    ]
    spec = workdir / f"{tag}-{stamp}.spec.json"
    result = workdir / f"{tag}-{stamp}.codes.json"
    zygote_log = workdir / f"{tag}-{stamp}.zygote.log"
    run: dict[str, Any] = {"code": code} if code is not None else {"script": str(script)}
    run |= {"args": args, "ranks": ranks, "result": str(result), "log": str(zygote_log)}
    spec.write_text(json.dumps(run))
    _ZYGOTES.run(spec, timeout)
    outputs = [log.read_text() if log.exists() else "" for log in logs]
    if result.exists():
        codes: list[int | None] = json.loads(result.read_text())["codes"]
    else:
        codes = [-signal.SIGKILL] * world
        outputs[0] += zygote_log.read_text() if zygote_log.exists() else "(no zygote log)"
    return RankRun(codes, outputs)


class ZygoteServer:
    """This test process's zygote server (``forkranks.py --serve``), started at its first
    run: the imports of a run's zygote are paid once per test process, not once per run.
    Runs may overlap (each has a connection and a zygote of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._lifeline = -1

    def _path(self) -> Path:
        """The server's socket (started here if it is not running)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self._dir is not None:
                return self._dir / "zygotes.sock"
            self.stop()
            self._dir = Path(tempfile.mkdtemp(prefix="zyg-", dir="/tmp"))
            path = self._dir / "zygotes.sock"
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))  # connections wait in its backlog while it imports
            listener.listen(16)
            read, self._lifeline = os.pipe()
            try:
                with open(self._dir / "server.log", "wb") as log:
                    self._proc = subprocess.Popen(
                        [sys.executable, str(FORKRANKS), "--serve", str(listener.fileno()),
                         str(read)],
                        env=dict(os.environ, OMP_NUM_THREADS="1"),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        pass_fds=(listener.fileno(), read),
                        start_new_session=True,
                        cwd=REPO,
                    )  # fmt: skip
            finally:
                listener.close()
                os.close(read)
            return path

    def run(self, spec: Path, timeout: float) -> None:
        """Have a zygote do the run of ``spec``; return once it is over: ended, or killed
        (its process group: the zygote and every rank) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self._path()))
            conn.sendall(f"{spec}\n".encode())
            pid, got, over = 0, b"", False
            try:
                while time.monotonic() < deadline:
                    conn.settimeout(min(1.0, max(0.0, deadline - time.monotonic())))
                    try:
                        chunk = conn.recv(4096)
                    except TimeoutError:
                        if not pid:
                            self._check_alive()
                        continue
                    if not chunk:
                        over = True  # the zygote exited: the run is over
                        return
                    got += chunk
                    if not pid and got.endswith(b"\n"):
                        pid = int(got)
            finally:  # past the deadline, or the test was interrupted: kill the run
                if pid and not over:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
            conn.settimeout(30)
            with contextlib.suppress(TimeoutError):
                while conn.recv(4096):
                    pass

    def _check_alive(self) -> None:
        """RuntimeError with the server's log if it has exited (it never will accept)."""
        proc, d = self._proc, self._dir
        if proc is not None and proc.poll() is not None and d is not None:
            log = (d / "server.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the zygote server exited ({proc.returncode}):\n{log}")

    def stop(self) -> None:
        """Stop the server (its zygotes finish their runs); idempotent."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=30)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


_ZYGOTES = ZygoteServer()
atexit.register(_ZYGOTES.stop)


def stop_zygote_server() -> None:
    """Stop this test process's zygote server (at the end of the session)."""
    _ZYGOTES.stop()
