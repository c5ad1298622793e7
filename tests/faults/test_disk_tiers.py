"""Disk tiers under ftmem-launch: background flushes in stock DCP format, the restore fallback
when memory is gone, `ftmem flush`/`ftmem ls`, and failures during a flush (a full disk, the
flush worker SIGKILLed before its rename, a corrupted file)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ftmem.faults import ArmedFault, Fault, Point, arm
from ftmem.tiers.checkpoints import list_checkpoints
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    Launch,
    Launcher,
    digests,
    reference_digests,
    remove_shm,
)

STEPS = 30
SCRIPT = [str(WORKLOAD), "--steps", str(STEPS), "--step-delay", "0.1", *TINY]


def wait_flushed(tier: Path, step: int, count: int, timeout: float = 120.0) -> list[int]:
    """Wait until ``tier`` holds a complete checkpoint of ``step`` or newer and ``count``
    complete checkpoints in all; return their steps."""
    deadline = time.monotonic() + timeout
    while True:
        steps = [c.step for c in list_checkpoints(tier)[0]]
        if len(steps) >= count and max(steps) >= step:
            return steps
        assert time.monotonic() < deadline, f"no {count} checkpoints, one >= {step}: {steps}"
        time.sleep(0.1)


def lose_everything(launch: Launch, run_id: str) -> None:
    """SIGKILL the agent, its SMP, the flush worker and the ranks; the node's memory is gone."""
    procs = [launch.pid, *launch.descendants()]
    for pid in procs:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launch.popen.wait(10)
    live = []
    for pid in procs:
        try:
            live.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(live, timeout=10)
    remove_shm(run_id)


def test_corrupt_newest_checkpoint_falls_back_to_an_older_one(launcher_env: Launcher) -> None:
    """Every process of the node is SIGKILLed (agent, SMP, flush worker, ranks; its memory is
    gone) and the newest flushed checkpoint is corrupted: a new launcher takes the newest
    one that passes its checks, the one before, and ends with the failure-free digests."""
    want = reference_digests(launcher_env, STEPS)
    tier = launcher_env.tmp / "ckpt"
    rid = launcher_env.new_run_id()
    flags = ["--ftmem-flush-dir", str(tier), "--ftmem-flush-every", "5", "--ftmem-flush-keep", "3"]
    flags += ["--ftmem-flush-writers", "3", "--ftmem-flush-direct", "off"]
    first = launcher_env.single_node(rid, 2, flags, SCRIPT, name="first")
    # Two checkpoints: under load the scheduler may skip a step that left the slots before
    # its flush could start (step 5 once), so step 10's alone is no "older one".
    wait_flushed(tier, 10, count=2)
    lose_everything(first, rid)
    good = list_checkpoints(tier)[0]
    for ckpt in good:  # the flags reach the flush: three data files, written in parallel
        assert len([p for p in ckpt.path.iterdir() if p.suffix == ".distcp"]) == 3
    newest, older = good[0], good[1]
    data = next(p for p in newest.path.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    data.write_bytes(bytes(raw))
    fast = [*SCRIPT, "--fast-after-resume"]  # resumed from disk: only the end is awaited
    second = launcher_env.single_node(rid, 2, flags, fast, name="second")
    assert second.wait(180) == 0, second.text()[-4000:]
    resumed = {int(s) for s in re.findall(r"resumed from step (\d+)", second.text())}
    assert resumed == {older.step}, second.text()[-3000:]
    assert "fails its checksum" in second.text()
    assert "restored step" in second.text() and "from " + str(tier) in second.text()
    assert digests(second.text()) == want


def test_full_disk_and_killed_worker_leave_only_complete_checkpoints(
    launcher_env: Launcher,
) -> None:
    """The first flush hits ENOSPC before its rename (another run: its worker is SIGKILLed
    there): that step is never listed, later flushes complete, training is not disturbed.

    The fault is armed once per run (the restarted flush worker does not fire it again) at
    the first flush from step 5 on: which step the scheduler flushes first depends on how
    soon its worker was ready."""
    want = reference_digests(launcher_env, STEPS)
    flags = ["--ftmem-flush-every", "5", "--ftmem-flush-keep", "5"]
    for name, fault, says in (
        ("full", Fault.ENOSPC, r"flush of step (\d+) failed: OSError: .*No space left"),
        ("killed", Fault.KILL, r"flush of step (\d+) failed: the flush worker died"),
    ):
        tier = launcher_env.tmp / f"ckpt-{name}"
        armed = launcher_env.tmp / f"armed-{name}.jsonl"
        arm(armed, ArmedFault(id=name, point=Point.IN_FLUSH, fault=fault, min_step=5))
        rid = launcher_env.new_run_id()
        run = launcher_env.single_node(
            rid,
            2,
            ["--ftmem-flush-dir", str(tier), *flags],
            SCRIPT,
            name=name,
            FTMEM_FAULT_FILE=str(armed),
        )
        assert run.wait(180) == 0, run.text()[-4000:]
        assert digests(run.text()) == want
        found = re.search(says, _smp_log(run, name))
        assert found, _smp_log(run, name)[-3000:]
        failed = int(found.group(1))
        good, other = list_checkpoints(tier)
        steps = [c.step for c in good]
        assert failed not in steps and steps and max(steps) > failed, _smp_log(run, name)[-3000:]
        assert STEPS in steps, steps  # the final flush when the run ended (SIGTERM to the SMP)
        if name == "full":
            assert not other, other  # the failed flush removed its partial directory
        else:
            assert all("partial" in why for _, why in other), other
        ls = subprocess.run(
            [sys.executable, "-m", "ftmem.cli", "ls", "--verify", str(tier)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ls.returncode == 0 and "complete, verified" in ls.stdout, ls.stdout + ls.stderr
    # A flushed checkpoint converts to one torch.save file (verified first).
    flat = launcher_env.tmp / "flat.pt"
    newest = list_checkpoints(tier)[0][0]
    conv = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmem.cli",
            "export",
            "--checkpoint",
            str(newest.path),
            "--torch-save",
            str(flat),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert conv.returncode == 0, conv.stderr
    import torch

    whole = torch.load(flat, weights_only=True)
    assert whole["ftmem_meta"]["step"] == newest.step and "model" in whole


def _smp_log(launch: Launch, name: str) -> str:
    p = launch.log_path.parent / f"{name}-rd" / "smp.log"
    return p.read_text(errors="replace") if p.exists() else ""


def test_ftmem_flush_during_training_returns_a_complete_checkpoint(
    launcher_env: Launcher,
) -> None:
    local, shared = launcher_env.tmp / "local", launcher_env.tmp / "shared"
    rid = launcher_env.new_run_id()
    flags = ["--ftmem-flush-dir", str(local), "--ftmem-flush-persistent-dir", str(shared)]
    run = launcher_env.single_node(
        rid, 2, flags, [str(WORKLOAD), "--steps", "150", "--step-delay", "0.1", *TINY], name="run"
    )
    run.wait_for(r"step 5 loss", 120)
    out = subprocess.run(
        [sys.executable, "-m", "ftmem.cli", "flush", "--run-dir", str(launcher_env.tmp / "run-rd")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    paths = out.stdout.split()
    assert len(paths) == 2 and paths[0].startswith(str(local)) and paths[1].startswith(str(shared))
    assert "durable in 2 tier(s)" in out.stderr
    for tier in (local, shared):
        assert len(list_checkpoints(tier)[0]) == 1
    assert run.wait(180) == 0, run.text()[-3000:]
