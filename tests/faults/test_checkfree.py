"""CheckFree as the last resort: a 4-stage pipeline (examples/train_pipeline.py, one stage per
node, erasure coding off) loses stage 2's node, and with it every snapshot of that stage.

With ``--ftmem-checkfree`` the replacement rank rebuilds stage 2 from stages 1 and 3 (weighted
by their gradient norms), the others restore their snapshots, and training goes on: the loss
before the loss is the failure-free run's exactly, and after it recovers to within a stated
margin of the failure-free run's within a stated number of steps. Without the flag the same
loss stops the job: with erasure coding off every restart fails its load with the
partial-snapshot error (which names the flag) until the restarts run out; with erasure coding
on and more than m nodes lost, the sync stops every agent UNRECOVERABLE
(tests/faults/test_ec_nodes.py).
"""

from __future__ import annotations

import re

import pytest

from tests._support.launcher import REPO, Launcher
from tests._support.nodes import Nodes

PIPELINE = REPO / "examples" / "train_pipeline.py"
STEPS = 60
SCRIPT = [str(PIPELINE), "--steps", str(STEPS), "--step-delay", "0.1"]
LOSS_RE = re.compile(r"\[rank 3\] step (\d+) loss ([0-9.]+)")
FLAGS = ["--ftmem-ec-parity", "0", "--max-restarts", "3"]

MARGIN = 0.03
"""After the rebuild, the loss must come back within this much (relative) of the failure-free
run's at the same step..."""
WITHIN = 20
"""...within this many steps of the resumed step. Measured (docs/api.md, CheckFree): resumed
at step 12, 6.1% above the failure-free loss at step 13, within 3% from step 21 on, 0.6% at
step 60."""


def _losses(text: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for step, loss in LOSS_RE.findall(text):
        out[int(step)] = float(loss)  # a step run again after the restart: the newer line
    return out


_REFERENCE: dict[int, float] = {}


def _failure_free(launcher: Launcher) -> dict[int, float]:
    """The failure-free run's losses (run once per session: the stages' results do not
    depend on how the ranks run, process restarts or ftmem.run)."""
    if not _REFERENCE:
        ref = launcher.single_node(launcher.new_run_id(), 4, FLAGS, SCRIPT, name="pp-reference")
        assert ref.wait(240) == 0, ref.text()[-3000:]
        _REFERENCE.update(_losses(ref.text()))
    return dict(_REFERENCE)


@pytest.mark.parametrize("in_process", [False, True], ids=["process-restart", "in-process"])
def test_lost_middle_stage_is_rebuilt_from_its_neighbours_and_the_loss_recovers(
    launcher_env: Launcher, in_process: bool
) -> None:
    """In-process: the ranks of the three surviving nodes run under ``ftmem.run`` and keep
    their processes; they restore in place and serve the new rank's rebuild."""
    want = _failure_free(launcher_env)
    assert len(want) == STEPS and want[STEPS] < 0.5 * want[1], want  # the task is learnt
    script = [*SCRIPT, "--in-process"] if in_process else SCRIPT
    nodes = Nodes(launcher_env, 4, [*FLAGS, "--ftmem-checkfree"], script=script)
    nodes.start_all()
    nodes.agents[3].wait_for(r"\[rank 3\] step 12 loss", 120)
    nodes.lose(2)
    nodes.start(2)
    m = nodes.agents[2].wait_for(
        r"\[rank 2\] resumed from step (\d+) \(rebuilt by CheckFree\)", 240
    )
    resumed = int(m[0].group(1))
    assert resumed >= 12
    nodes.finish(timeout=300)
    text = nodes.agents[3].text()
    got = _losses(text)
    assert "CHECKFREE: no snapshot of stage 2" in nodes.agents[2].text()
    if in_process:
        for i in (0, 1, 3):
            survivor = nodes.agents[i].text()
            assert re.search(rf"\[rank {i}\] rejoined in process", survivor), survivor[-3000:]
    for step in range(1, resumed + 1):  # before the loss: exactly the failure-free run
        assert got[step] == want[step], (step, got[step], want[step])
    gaps = {s: (got[s] - want[s]) / want[s] for s in range(resumed + 1, STEPS + 1)}
    print(f"CheckFree: resumed at step {resumed}; relative loss gap by step: {gaps}")
    assert gaps[resumed + 1] > 0.01  # a rebuilt stage is an approximation, not a restore
    recovered = [s for s in gaps if s <= resumed + WITHIN and abs(gaps[s]) <= MARGIN]
    assert recovered, f"loss gap never within {MARGIN:.0%} in {WITHIN} steps: {gaps}"


def test_without_checkfree_the_same_loss_stops_the_job(launcher_env: Launcher) -> None:
    nodes = Nodes(launcher_env, 4, ["--ftmem-ec-parity", "0", "--max-restarts", "1"], script=SCRIPT)
    nodes.start_all()
    nodes.agents[3].wait_for(r"\[rank 3\] step 12 loss", 120)
    nodes.lose(2)
    nodes.start(2)
    for i in range(4):
        assert nodes.agents[i].wait(300) != 0
    text = nodes.agents[2].text()
    assert "no snapshot step is held by every rank" in text, text[-3000:]
    assert "--ftmem-checkfree" in text  # the error says what would have gone on


def test_more_nodes_lost_than_erasure_coding_covers(launcher_env: Launcher) -> None:
    """Five stages on five nodes with m=1: stages 1 and 3 are lost at once, more than m, so
    the sync finds them UNRECOVERABLE. With --ftmem-checkfree the job goes on and both are
    rebuilt from their neighbours (without it every agent stops with the usual message:
    tests/faults/test_ec_nodes.py)."""
    flags = ["--ftmem-ec-parity", "1", "--max-restarts", "3", "--ftmem-checkfree"]
    nodes = Nodes(launcher_env, 5, flags, script=[*SCRIPT[:2], "40", *SCRIPT[3:]])
    nodes.start_all()
    nodes.wait_protected(8)
    nodes.lose(1)
    nodes.lose(3)
    nodes.start(1)
    nodes.start(3)
    for i in (1, 3):
        pattern = rf"\[rank {i}\] resumed from step \d+ \(rebuilt by CheckFree\)"
        nodes.agents[i].wait_for(pattern, 240)
    nodes.finish(timeout=300)
    assert "--ftmem-checkfree: going on without it" in nodes.agents[0].text()
