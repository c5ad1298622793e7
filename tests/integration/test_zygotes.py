"""The harness that starts ranks without a launcher (``run_ranks``: one zygote server per test
process forks a zygote per run, which forks the ranks): each rank has its own environment and
exit status, runs are independent, and a run past its timeout is killed, every rank with it."""

from __future__ import annotations

import time
from pathlib import Path

import psutil

from tests._support.ranks import run_ranks

RANK = """
import os, signal, sys
print("RANK", os.environ["RANK"], os.environ["ONLY_MINE"], os.getpid(), os.getppid(), flush=True)
if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(os.environ["RANK"]) + 3)
"""


def test_each_rank_has_its_own_environment_and_exit_status(tmp_path: Path) -> None:
    mine = [{"ONLY_MINE": f"r{r}"} for r in range(3)]
    first = run_ranks(tmp_path, [], world=3, code=RANK, tag="a", rank_env=mine, timeout=60)
    assert first.codes == [3, -9, 5], first.outputs
    lines = [line.split() for line in first.lines(r"(RANK .*)")]
    assert [(w[1], w[2]) for w in lines] == [("0", "r0"), ("1", "r1"), ("2", "r2")], lines
    zygote = {w[4] for w in lines}
    assert len(zygote) == 1  # one zygote forked every rank of the run...
    second = run_ranks(tmp_path, [], world=1, code=RANK, tag="b", rank_env=mine, timeout=60)
    assert second.codes == [3], second.outputs
    assert second.lines(r"RANK 0 r0 \d+ (\d+)") != list(zygote)  # ... and each run has its own


def test_a_run_past_its_timeout_is_killed_with_every_rank(tmp_path: Path) -> None:
    # (a first run starts the server: its imports do not count against the timeout below)
    assert run_ranks(tmp_path, [], world=1, code="pass", tag="warm", timeout=120).codes == [0]
    code = "import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)"
    run = run_ranks(tmp_path, [], world=2, code=code, tag="hang", timeout=5)
    assert run.codes == [-9, -9], run.outputs
    pids = [int(p) for p in run.lines(r"PID (\d+)")]
    assert len(pids) == 2, run.outputs
    deadline = time.monotonic() + 10  # SIGKILLed; init reaps them (lazily here: zombies)
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
