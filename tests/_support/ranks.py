"""Run the test workload as real ranks (what a launcher does), and read their output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests._support.launcher import free_port
from tests._support.procs import WORKLOAD, Procs

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
    procs: Procs,
    workdir: Path,
    args: list[str],
    *,
    world: int = 2,
    env_extra: dict[str, str] | None = None,
    timeout: float = 120.0,
    tag: str = "run",
    script: Path = WORKLOAD,
    rank_env: list[dict[str, str]] | None = None,
) -> RankRun:
    """Start ``world`` ranks of ``script`` (default: the workload), wait (bounded) for all to exit, return codes + output.

    When one rank dies, the others fail in their next collective and exit; any rank still
    running after ``timeout`` is killed (its code is then -9).
    """
    # A file store: a TCP port picked in advance can be taken by another process before
    # rank 0 binds it, and rank 1 then waits on a stranger's socket.
    store = workdir / f"{tag}-{time.monotonic_ns()}.store"
    args = [*args, "--init-method", f"file://{store}"]
    port = free_port()
    ps = []
    logs = []
    for r in range(world):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **(env_extra or {}),
            **(rank_env[r] if rank_env else {}),
        )
        log = workdir / f"{tag}-rank{r}.log"
        logs.append(log)
        ps.append(procs.spawn([sys.executable, str(script), *args], env, log))
    deadline = time.monotonic() + timeout
    for p in ps:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
    return RankRun([p.returncode for p in ps], [log.read_text() for log in logs])
