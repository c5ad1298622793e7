"""Run the test workload as real ranks (what a launcher does), and read their output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests._support.launcher import free_port
from tests._support.procs import WORKLOAD, Procs

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
    code: str | None = None,
) -> RankRun:
    """Start ``world`` ranks of ``script`` (default: the workload), wait (bounded) for all
    to exit, return codes + output.

    The ranks are forked from one process that imported torch once (tests/_support/
    forkranks.py): each runs the script as ``python script.py`` would, in its own
    environment. ``code``, instead of ``script``: Python source each rank runs as
    ``python -c`` would. When one rank dies, the others fail in their next collective and
    exit; if any rank still runs after ``timeout``, every rank is killed (codes then -9).
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
    run = {"code": code} if code is not None else {"script": str(script)}
    spec.write_text(json.dumps({**run, "args": args, "ranks": ranks, "result": str(result)}))
    zygote_log = workdir / f"{tag}-{stamp}.zygote.log"
    zygote = procs.spawn([sys.executable, str(FORKRANKS), str(spec)], common, zygote_log)
    try:
        zygote.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(zygote.pid, signal.SIGKILL)
        zygote.wait(timeout=30)
    outputs = [log.read_text() if log.exists() else "" for log in logs]
    if zygote.returncode == 0 and result.exists():
        codes: list[int | None] = json.loads(result.read_text())["codes"]
    else:
        codes = [-signal.SIGKILL] * world
        outputs[0] += zygote_log.read_text()
    return RankRun(codes, outputs)
