"""The short example (examples/train_gpt.py) trains under ftmem-launch and resumes from memory
after one of its ranks is SIGKILLed. Bitwise resumption is tested on the test workload, which
runs the same loop (tests/faults/)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests._support.launcher import Launcher, rank_pids, wait_verified
from tests._support.procs import REPO

EXAMPLE = REPO / "examples" / "train_gpt.py"
SMALL = ["--vocab", "64", "--seq-len", "16", "--d-model", "32", "--n-layers", "1"]


@pytest.mark.timeout(240)  # an agent, its SMP and two ranks started twice on 2 loaded cores
def test_the_example_resumes_from_memory_after_a_rank_is_killed(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid, 2, [], [str(EXAMPLE), "--steps", "1000000", "--batch-size", "2", *SMALL]
    )
    agent.wait_for(r"\[rank 1\] step 20 loss", 120)
    wait_verified(launcher_env.tmp / "agent-rd", {0, 1}, 60, min_step=10)
    pids = rank_pids(launcher_env.tmp / "agent-rd")
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGKILL)
    resumed = agent.wait_for(r"\[rank (\d)\] resumed from step ([1-9]\d*)", 120, count=2)
    assert {int(m.group(1)) for m in resumed} == {0, 1}
    steps = {int(m.group(2)) for m in resumed}
    assert len(steps) == 1  # both from the same step
    # ... and trains on: a loss logged after the restart
    agent.wait_for(
        rf"\[rank 1\] resumed from step {steps.pop()}[\s\S]*\[rank 1\] step \d+ loss", 60
    )
    assert psutil.pid_exists(agent.pid)
