"""Disk tiers of a multi-node run: every node flushes its part (node-local tier, then the
shared tier); the node of rank 0 assembles the parts into one global DCP checkpoint. Three
ftmem-launch agents on loopback with erasure coding on (m=1), so the step flushed is also
protected in memory; then every node is lost (more than m: memory cannot serve), one of them
with its local disk, and new agents resume from disk with the digests of a failure-free run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftmem.tiers.checkpoints import list_checkpoints, read_checkpoint, verify_checkpoint
from tests._support.launcher import TINY, WORKLOAD, Launcher
from tests._support.nodes import Nodes, reference

STEPS = 40
SCRIPT = [str(WORKLOAD), "--steps", str(STEPS), "--step-delay", "0.3", "--fast-after-resume", *TINY]


def wait_global(tier: Path, step: int, timeout: float = 180.0) -> int:
    """Wait for an assembled checkpoint of ``step`` or newer in ``tier``; return its step."""
    deadline = time.monotonic() + timeout
    while True:
        steps = [c.step for c in list_checkpoints(tier)[0]]
        if steps and max(steps) >= step:
            return max(steps)
        assert time.monotonic() < deadline, f"no global checkpoint >= {step} in {tier}: {steps}"
        time.sleep(0.2)


@pytest.mark.timeout(400)  # several launches of several processes each
def test_three_nodes_flush_parts_assemble_and_resume_from_disk(launcher_env: Launcher) -> None:
    want = reference(launcher_env, 3)
    shared = launcher_env.tmp / "shared"
    local = str(launcher_env.tmp / "local-n{i}")
    flags = [
        "--ftmem-ec-parity",
        "1",
        "--ftmem-flush-dir",
        local,
        "--ftmem-flush-persistent-dir",
        str(shared),
        "--ftmem-flush-every",
        "5",
        "--ftmem-flush-keep",
        "3",
    ]
    nodes = Nodes(launcher_env, 3, flags, SCRIPT)
    nodes.start_all()
    first = wait_global(shared, 5)
    ck = read_checkpoint(shared / f"step_{first:010d}")
    assert ck.ranks == (0, 1, 2) and not ck.is_part
    verify_checkpoint(ck)
    # Each node keeps its own part in its node-local tier.
    for i in range(3):
        parts = list_checkpoints(launcher_env.tmp / f"local-n{i}", parts=True)[0]
        assert parts and all(p.ranks == (i,) for p in parts), parts

    # ftmem flush asked of every SMP at once: one common step, the global path comes back.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmem.cli",
            "flush",
            "--run-dir",
            *(nodes.run_dir(i) for i in range(3)),
            "--timeout",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    globals_ = [p for p in cli.stdout.split() if Path(p).parent == shared]
    assert globals_ and re.search(r"step_\d{10}$", globals_[0]), cli.stdout
    asked = read_checkpoint(Path(globals_[0]))
    assert asked.ranks == (0, 1, 2)

    for i in range(3):  # more than m nodes lost: memory cannot serve any more
        nodes.lose(i)
    shutil.rmtree(launcher_env.tmp / "local-n2")  # node 2 comes back with an empty disk
    newest = max(c.step for c in list_checkpoints(shared)[0])
    nodes.start_all(new_job=True)
    out = nodes.finish()
    assert out == want
    texts = [nodes.agents[i].text() for i in range(3)]
    resumed = {int(s) for t in texts for s in re.findall(r"resumed from step (\d+)", t)}
    # One step for every rank, at least the newest global one (a newer step whose parts were all
    # written but not yet assembled when the nodes died is as good: every rank has its part).
    assert len(resumed) == 1 and min(resumed) >= newest, (resumed, newest, texts[2][-3000:])
    assert str(shared) in texts[2]  # node 2 restored from the shared tier (global or its part)
