"""The snapshot data path v2 against a real SMP: slots allocated off the training thread,
checksums computed by the SMP (verified snapshots), an SMP killed mid-hash, skips per reason
in the status and the event log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

import ftmem
from ftmem.config import ClientConfig
from ftmem.events import SMP_EVENTS_NAME
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import pid_gone, remove_shm, shm_files
from tests._support.procs import REPO


def _state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, object]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, {"model": model, "optim": opt, "rng": ftmem.RNGState()}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.clone() for t in model.state_dict().values()]
    return out + [t.clone() for st in opt.state.values() for t in st.values()]


def _wait_verified(run_dir: Path, step: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with SmpClient(run_dir) as c:
        while c.status().ranks[0].newest_verified != step:
            assert time.monotonic() < deadline, f"step {step} not verified in {timeout} s"
            time.sleep(0.02)


def test_first_save_allocates_off_the_training_thread_and_skips_are_reported(
    smp: SmpProcess, run_dir: Path
) -> None:
    model, opt, state = _state()
    ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        _step(model, opt)
        h = ckpt.save(state, step=1)
        # The SMP allocates and pre-faults the slots; the training thread does not wait.
        assert h.skipped and h.reason == "slots are being allocated"
        assert ckpt.wait(60)  # the newest step is committed all the same
        _wait_verified(run_dir, 1)
        with SmpClient(run_dir) as c:
            r = c.status().ranks[0]
        assert r.newest_committed == 1 and r.verified_steps == [1]
        assert r.skips == {"slots are being allocated": 1}
        layout = c_layout(run_dir)
        assert all(t["hash"] for t in json.loads(layout)["tensors"])  # filled in by the SMP
    finally:
        ckpt.close()
    events = [
        json.loads(line) for line in (run_dir / SMP_EVENTS_NAME).read_text().splitlines() if line
    ]
    skipped = [e for e in events if e.get("event") == "skipped"]
    assert skipped and all(e["rank"] == 0 and e["reason"] for e in skipped)
    kinds = [e.get("event") for e in events]
    assert kinds.index("committed") < kinds.index("verified")


def c_layout(run_dir: Path) -> str:

    with SmpClient(run_dir) as c:
        return c.query(0)[0].layout


def test_smp_killed_mid_hash_loses_nothing(run_dir: Path, run_id: str) -> None:
    """The SMP dies while it checksums step 3 (committed, not verified): its successor adopts
    the slot, hashes it, and the ranks restore step 3 bitwise; step 2 is still there."""
    env = {**os.environ, "FTMEM_FAULT": "in_hash:rank=0:step=3"}
    proc = start_smp(run_dir=run_dir, run_id=run_id, env=env, log_path=run_dir / "smp.log")
    model, opt, state = _state()
    ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        for step in (1, 2):
            _step(model, opt)
            ckpt.save(state, step=step)
            assert ckpt.wait(60)
        # The hasher pins a committed slot until it is verified; an ordinary save finding every
        # slot held skips (by design), and a skipped step 3 would never reach the fault point.
        _wait_verified(run_dir, 2)
        _step(model, opt)
        handle = ckpt.save(state, step=3)
        assert not handle.skipped, handle.reason
        expect = _tensors(model, opt)
        deadline = time.monotonic() + 60
        # SIGKILLed at the fault point, perhaps before its reply to the COMMIT (the record is
        # written first). Reaping it here lets the rank's client see it gone at once.
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the SMP was not killed mid-hash"
            time.sleep(0.05)
        try:
            ckpt.wait(60)
        except ftmem.FtmemError:
            pass  # the COMMIT's reply was lost with the SMP; the commit record was not
        ckpt.close()
        proc.stop()
        proc = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
        with SmpClient(run_dir) as c:
            assert c.status().ranks[0].committed_steps == [3, 2]
        model2, opt2, state2 = _state(seed=5)
        other = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        try:
            assert other.load(state2) == 3
        finally:
            other.close()
        got = _tensors(model2, opt2)
        assert len(got) == len(expect) and all(
            torch.equal(a, b) for a, b in zip(got, expect, strict=True)
        )
    finally:
        ckpt.close()
        proc.stop()
    assert shm_files(run_id) == []


def test_query_waits_for_the_hash_of_the_newest_step(smp: SmpProcess, run_dir: Path) -> None:
    """A load right after the final commit restores that step: the SMP answers the query
    once the step is verified."""
    big = torch.nn.Linear(2048, 2048)  # 16 MiB: several checksummed pieces
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    state = {"model": big, "optim": opt}
    ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        ckpt.save(state, step=1)
        assert ckpt.wait(60)
        big(torch.randn(2, 2048)).sum().backward()
        opt.step()
        ckpt.save(state, step=2)
        assert ckpt.wait(60)
        expect = big.weight.detach().clone()
    finally:
        ckpt.close()
    target = torch.nn.Linear(2048, 2048)
    other = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        assert other.load({"model": target, "optim": torch.optim.SGD(target.parameters())}) == 2
    finally:
        other.close()
    assert torch.equal(target.weight, expect)


HALF_STARTED = """
import signal, sys
from ftmem.smp.spawn import start_smp

class Stopped(Exception):
    pass

def stop(signum, frame):  # as elastic's agent turns SIGTERM into an exception
    raise Stopped

signal.signal(signal.SIGTERM, stop)
try:
    smp = start_smp(run_dir=sys.argv[1], run_id=sys.argv[2], log_path=sys.argv[1] + "/smp2.log")
except Stopped:
    sys.exit(3)
smp.stop()
"""


def test_a_stop_while_a_new_smp_starts_leaves_no_slot_files(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """The job is stopped (SIGTERM) while a restart waits for its new SMP, which adopts the
    slot files its SIGKILLed predecessor left: the new SMP is stopped, not SIGKILLed, and
    removes them, even when the stop comes before it could install its signal handlers."""
    first = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    model, opt, state = _state()
    ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        _step(model, opt)
        ckpt.save(state, step=1)
        assert ckpt.wait(60)
    finally:
        ckpt.close()
        first.kill()  # lost: its slot files stay for a successor to adopt
    assert shm_files(run_id)
    script = tmp_path / "half_started.py"
    script.write_text(HALF_STARTED)
    helper = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), run_id], start_new_session=True, cwd=REPO
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # as early as can be: the new SMP may not even have its handlers yet
            kids = psutil.Process(helper.pid).children()
            if kids:
                break
            assert helper.poll() is None, "the helper ended before its SMP started"
            assert time.monotonic() < deadline, "no SMP started within 60 s"
            time.sleep(0.01)
        helper.send_signal(signal.SIGTERM)
        assert helper.wait(90) in (0, 3)  # 0: the SMP was ready first and stopped after
        assert pid_gone(kids[0].pid)
        assert shm_files(run_id) == [], (run_dir / "smp2.log").read_text()[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(helper.pid, signal.SIGKILL)
        helper.wait(30)
        remove_shm(run_id)
