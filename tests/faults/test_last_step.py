"""The final step of a run with ``--ftmem-flush-every`` is always its newest flushed checkpoint.

Run as a new user would (``ftmem-launch --nproc-per-node 2 --ftmem-flush-dir D
--ftmem-flush-every 4 tests/_support/workload/train.py --steps 12``). While a flush holds a
slot, a rank with no free slot skips its snapshot; when that happened to the last step, the final state was
never in memory and the final flush (when the SMP is stopped at the end of the job) wrote an
older step (9 of 12 in 1 run of 4). The last step passed to ``save`` must be committed
(``close``/exit waits, bounded, for a slot), and the final flush must write it.

Each case runs the example to its normal end, then checks that the newest complete checkpoint
in the flush directory is the final step, that its files match their manifest, and that a new
job started from a copy of it alone resumes at the final step with the digest of a
failure-free run (the same comparison as tests/faults/test_disk_tiers.py). The bug was
intermittent, so the run is repeated, the second time flushing every 2 steps with 2 slots per
rank (the flush's pinned slot and the newest committed one then leave no free slot: every
flush makes the ranks skip).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from ftmem.events import SMP_EVENTS_NAME
from ftmem.tiers.checkpoints import list_checkpoints, verify_checkpoint
from tests._support.launcher import TINY, WORKLOAD, Launcher, digests, reference_digests

STEPS = 12
WORLD = 2
# A step takes ~20 ms here and a flush of the TINY state ~0.25 s: with 50 ms between steps a
# flush overlaps several steps, the last ones included.
DELAY = "0.05"


def smp_events(run_dir: Path) -> list[dict[str, Any]]:
    """The SMP's event log of a run directory (empty if it has none)."""
    path = run_dir / SMP_EVENTS_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(events: list[dict[str, Any]]) -> str:
    """What the run's SMP saw, for failure messages: commits per rank, skips, flushes."""
    committed: dict[int, list[int]] = {}
    skips: dict[int, int] = {}  # each commit carries the rank's count of skipped snapshots
    for e in events:
        if e.get("event") == "committed":
            committed.setdefault(int(e["rank"]), []).append(int(e["step"]))
            skips[int(e["rank"])] = int(e.get("skipped", 0))
    others = [
        {k: v for k, v in e.items() if k not in ("time", "node", "paths")}
        for e in events
        if e.get("event") in ("skipped", "flushed", "flush_failed")
    ]
    return (
        f"committed steps per rank: {committed}; snapshots skipped per rank (as of its last "
        f"commit): {skips}; skip and flush events: {others}"
    )


@pytest.mark.parametrize(
    ("every", "slots"),
    [
        pytest.param(4, None, id="every4"),
        pytest.param(2, 2, id="every2-slots2"),
    ],
)
def test_final_step_is_the_newest_flushed_checkpoint(
    launcher_env: Launcher, every: int, slots: int | None
) -> None:
    want = reference_digests(launcher_env, STEPS)
    tier = launcher_env.tmp / "ckpt"
    flags = ["--ftmem-flush-dir", str(tier), "--ftmem-flush-every", str(every)]
    if slots is not None:
        flags += ["--ftmem-slots", str(slots)]
    run = launcher_env.single_node(
        launcher_env.new_run_id(),
        WORLD,
        flags,
        [str(WORKLOAD), "--steps", str(STEPS), "--step-delay", DELAY, *TINY],
        name="run",
    )
    assert run.wait(120) == 0, run.text()[-4000:]
    assert digests(run.text()) == want, run.text()[-3000:]
    events = smp_events(launcher_env.tmp / "run-rd")
    assert events, "the SMP wrote no event log"

    # Skipped snapshots are visible: every "skipped" event names the rank and why.
    for e in events:
        if e.get("event") == "skipped":
            assert isinstance(e.get("rank"), int) and 0 <= e["rank"] < WORLD, e
            assert isinstance(e.get("reason"), str) and e["reason"], e

    good, _ = list_checkpoints(tier)
    steps = [c.step for c in good]
    assert steps and steps[0] == STEPS, (
        f"newest complete checkpoint is step {steps[0] if steps else None}, not the final "
        f"step {STEPS} (complete: {steps}); {summary(events)}"
    )
    newest = good[0]
    assert newest.world_size == WORLD and not newest.is_part, newest
    verify_checkpoint(newest)  # every file matches the hash in its manifest
    # The final step is in memory too: every rank committed it.
    for rank in range(WORLD):
        assert any(
            e.get("event") == "committed" and e.get("rank") == rank and e.get("step") == STEPS
            for e in events
        ), f"rank {rank} never committed step {STEPS}; {summary(events)}"

    # Its contents are the final state: a new job (new SMP, empty memory) whose flush directory
    # holds only a copy of that checkpoint resumes from it, runs no step, and ends with the
    # digest of a failure-free run.
    only = launcher_env.tmp / "only"
    only.mkdir()
    shutil.copytree(newest.path, only / newest.path.name)
    resume = launcher_env.single_node(
        launcher_env.new_run_id(),
        WORLD,
        ["--ftmem-flush-dir", str(only)],
        [str(WORKLOAD), "--steps", str(STEPS), *TINY],
        name="resume",
    )
    assert resume.wait(120) == 0, resume.text()[-4000:]
    text = resume.text()
    resumed = {int(s) for s in re.findall(r"resumed from step (\d+)", text)}
    assert resumed == {STEPS}, text[-3000:]
    assert "restored step" in text and "from " + str(only) in text, text[-3000:]
    assert digests(text) == want, text[-3000:]
