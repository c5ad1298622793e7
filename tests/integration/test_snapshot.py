"""Snapshots in one process against a real SMP: bitwise round trips, the fence, corruption."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ftmem
from ftmem.config import ClientConfig
from ftmem.errors import CorruptSnapshotError, SmpUnavailableError, SnapshotMismatchError
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess
from tests._support.launcher import shm_files, wait_slots_made


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        model(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def snapshot_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.clone() for t in model.state_dict().values()]
    for st in opt.state.values():
        out += [t.clone() for t in st.values()]
    return out


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def ckpt(smp: SmpProcess, run_dir: Path):  # type: ignore[no-untyped-def]
    c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    yield c
    c.close()


def commit(ckpt: ftmem.Checkpointer, state: dict[str, object], step: int) -> None:
    """Save ``step`` and make sure it is committed: the first save of a process is skipped
    while the SMP allocates the slots, and ``wait()`` then commits the newest step. Then wait
    until the SMP has made the rank's other slots too (they follow the first one in the
    background, and a save meanwhile is skipped), so that the next save is not skipped."""
    ckpt.save(state, step=step)
    assert ckpt.wait(60)
    wait_slots_made(ckpt.config.run_dir, ckpt.rank)


def wait_verified(run_dir: Path, step: int) -> None:
    """Until the SMP has checksummed ``step`` of rank 0 (corrupting it before that would be
    corrupting what the SMP then hashes)."""
    deadline = time.monotonic() + 60
    with SmpClient(run_dir) as c:
        while c.status().ranks[0].newest_verified != step:
            assert time.monotonic() < deadline, f"step {step} not verified"
            time.sleep(0.02)


def fresh(run_dir: Path) -> ftmem.Checkpointer:
    return ftmem.Checkpointer(ClientConfig(run_dir=run_dir))


def test_nothing_to_restore_returns_zero_untouched(ckpt: ftmem.Checkpointer) -> None:
    model, opt = make()
    before = snapshot_of(model, opt)
    assert ckpt.load({"model": model, "optim": opt}) == 0
    assert equal(before, snapshot_of(model, opt))


def test_round_trip_is_bitwise_with_buffers_rng_and_objects(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    model, opt = make()
    train(model, opt, 3)
    extra = {"pos": 17, "name": "x", "t": torch.arange(6)}
    state = {"model": model, "optim": opt, "rng": ftmem.RNGState(), "extra": extra}
    commit(ckpt, state, 2)  # the slots exist: the next save copies in the background
    h = ckpt.save(state, step=3)
    expect = snapshot_of(model, opt)
    expect_rand = torch.rand(4)
    # Forward mutates BatchNorm buffers right after save (eagerly copied), step waits at the fence.
    train(model, opt, 2)
    assert h.wait(30) is True
    model2, opt2 = make(seed=1)
    train(model2, opt2, 1)  # optimizer state exists but differs
    extra2 = {"pos": 0, "name": "", "t": torch.zeros(6, dtype=torch.int64)}
    state2 = {"model": model2, "optim": opt2, "rng": ftmem.RNGState(), "extra": extra2}
    other = fresh(run_dir)
    try:
        assert other.load(state2) == 3
    finally:
        other.close()
    assert equal(expect, snapshot_of(model2, opt2))
    assert state2["extra"]["pos"] == 17 and state2["extra"]["name"] == "x"
    assert torch.equal(state2["extra"]["t"], torch.arange(6))
    assert torch.equal(torch.rand(4), expect_rand)


def test_fresh_optimizer_state_is_created(ckpt: ftmem.Checkpointer, run_dir: Path) -> None:
    model, opt = make()
    train(model, opt, 2)
    commit(ckpt, {"model": model, "optim": opt}, 2)
    model2, opt2 = make(seed=5)
    other = fresh(run_dir)
    try:
        assert other.load({"model": model2, "optim": opt2}) == 2
    finally:
        other.close()
    assert equal(snapshot_of(model, opt), snapshot_of(model2, opt2))
    train(model, opt)
    train(model2, opt2)  # the same batch would be needed for equality; just check it runs


def test_corrupted_newest_falls_back_to_older_step(
    ckpt: ftmem.Checkpointer, run_dir: Path, run_id: str
) -> None:
    model, opt = make()
    state = {"model": model, "optim": opt}
    train(model, opt)
    commit(ckpt, state, 1)
    at1 = snapshot_of(model, opt)
    train(model, opt)
    commit(ckpt, state, 2)
    wait_verified(run_dir, 2)  # corrupt it after the SMP has checksummed it
    with SmpClient(run_dir) as c:
        st = c.status().ranks[0]
    slot2 = next(s for s in st.slots if s.step == 2)
    path = next(f for f in shm_files(run_id) if f"-s{slot2.slot}-g{slot2.gen}" in f)
    with open(path, "r+b") as f:  # flip one byte of a parameter
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    model2, opt2 = make(seed=3)
    other = fresh(run_dir)
    try:
        assert other.load({"model": model2, "optim": opt2}) == 1
    finally:
        other.close()
    assert equal(at1, snapshot_of(model2, opt2))


def test_all_corrupted_raises_and_applies_no_corrupt_byte(
    ckpt: ftmem.Checkpointer, run_dir: Path, run_id: str
) -> None:
    model, opt = make()
    state = {"model": model, "optim": opt}
    train(model, opt)
    commit(ckpt, state, 1)
    wait_verified(run_dir, 1)
    saved = [t.clone() for t in model.state_dict().values()]
    for f in shm_files(run_id):  # bytes 8-10: inside model.0.weight (the largest: offset 0)
        with open(f, "r+b") as fh:
            fh.seek(8)
            fh.write(b"\xff\xfe\xfd")
    model2, opt2 = make(seed=3)
    before = [t.clone() for t in model2.state_dict().values()]
    other = fresh(run_dir)
    try:
        with pytest.raises(CorruptSnapshotError):
            other.load({"model": model2, "optim": opt2})
    finally:
        other.close()
    # The corrupted piece was never copied; the optimizer's load_state_dict never ran; every
    # other tensor holds its old bytes or the snapshot's verified ones (docs/design.md).
    after = list(model2.state_dict().values())
    assert torch.equal(after[0], before[0])
    assert not opt2.state
    assert all(
        torch.equal(t, b) or torch.equal(t, s) for t, b, s in zip(after, before, saved, strict=True)
    )


def test_shape_mismatch_is_refused(ckpt: ftmem.Checkpointer, run_dir: Path) -> None:
    model, _opt = make()
    commit(ckpt, {"model": model}, 1)
    other = fresh(run_dir)
    try:
        with pytest.raises(SnapshotMismatchError):
            other.load({"model": torch.nn.Linear(3, 3)})
        with pytest.raises(SnapshotMismatchError):
            other.load({"model": model, "missing": torch.zeros(1)})
    finally:
        other.close()


def test_wait_returns_once_the_next_slot_is_mapped_so_the_next_save_runs(
    ckpt: ftmem.Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy thread maps the slot a commit grants; a save that comes before that waits a
    little, then skips. ``wait()`` waits for the mapping too: here the mapping is held up
    (as on a loaded host, where it made a CI run's save right after ``wait()`` skip), and
    the save after ``wait()`` still commits."""
    from ftmem.client.slot_maps import SlotMappings

    mapping = SlotMappings.prepare

    def slow(self: SlotMappings, path: str, capacity: int) -> object:
        time.sleep(0.5)
        return mapping(self, path, capacity)

    monkeypatch.setattr(SlotMappings, "prepare", slow)
    state = {"w": torch.ones(1 << 20)}
    commit(ckpt, state, 0)
    state["w"].add_(1)
    handle = ckpt.save(state, step=1)
    assert not handle.skipped
    assert handle.wait(30)


def test_lazy_copy_is_fenced_by_optimizer_step(ckpt: ftmem.Checkpointer, run_dir: Path) -> None:
    torch.manual_seed(0)
    big = torch.nn.Linear(2048, 2048)
    opt = torch.optim.SGD(big.parameters(), lr=0.5)
    big(torch.randn(4, 2048)).sum().backward()
    state = {"model": big, "optim": opt}
    commit(ckpt, state, 0)
    h = ckpt.save(state, step=1)
    expect = big.weight.detach().clone()
    opt.step()  # the pre-hook must wait for the copy before SGD changes the weight
    h.wait(30)
    assert not torch.equal(big.weight, expect)
    big2 = torch.nn.Linear(2048, 2048)
    other = fresh(run_dir)
    try:
        assert other.load({"model": big2, "optim": torch.optim.SGD(big2.parameters(), lr=0.5)}) == 1
    finally:
        other.close()
    assert torch.equal(big2.weight, expect)


@pytest.mark.parametrize("as_kwarg", [True, False])
def test_step_with_a_closure_is_fenced_after_the_closure(
    ckpt: ftmem.Checkpointer, run_dir: Path, as_kwarg: bool
) -> None:
    # Lightning and LBFGS run forward and backward inside step(closure): the fence moves to
    # the closure's end (the copy overlaps them) and still comes before the update.
    torch.manual_seed(0)
    big = torch.nn.Linear(2048, 2048)
    opt = torch.optim.SGD(big.parameters(), lr=0.5)
    state = {"model": big, "optim": opt}
    big(torch.randn(4, 2048)).sum().backward()
    commit(ckpt, state, 0)
    h = ckpt.save(state, step=1)
    expect = big.weight.detach().clone()
    calls: list[bool] = []

    def closure() -> torch.Tensor:
        calls.append(True)
        opt.zero_grad()
        loss = big(torch.ones(4, 2048)).sum()
        loss.backward()
        return loss

    loss = opt.step(closure=closure) if as_kwarg else opt.step(closure)
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert h.wait(30)
    assert not torch.equal(big.weight, expect)
    big2 = torch.nn.Linear(2048, 2048)
    other = fresh(run_dir)
    try:
        assert other.load({"model": big2, "optim": torch.optim.SGD(big2.parameters(), lr=0.5)}) == 1
    finally:
        other.close()
    assert torch.equal(big2.weight, expect)


def test_killed_smp_makes_save_fail_fast(run_dir: Path, run_id: str) -> None:
    from ftmem.smp.spawn import start_smp

    smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir, request_timeout=timedelta(seconds=60)))
    try:
        model, _opt = make()
        commit(c, {"model": model}, 1)
        smp.kill()
        t0 = time.monotonic()
        with pytest.raises(SmpUnavailableError):
            c.save({"model": model}, step=2)
        with pytest.raises(SmpUnavailableError):
            c.load({"model": model})
        assert time.monotonic() - t0 < 10
    finally:
        c.close()
        smp.stop()
        for f in shm_files(run_id):
            os.unlink(f)


def test_save_is_skipped_not_blocked_when_no_slot_is_free(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    from ftmem.protocol import messages as m

    model, _ = make()
    commit(ckpt, {"model": model}, 1)
    before = ckpt.stats()["skipped"]  # the first save was skipped while slots were allocated
    # The SMP granted a slot for the next save with the commit's reply; a load starts a
    # generation and forgets it, so the next save asks with a BEGIN again.
    assert ckpt.load({"model": model}) == 1
    with SmpClient(run_dir) as other:  # another writer holds the only reusable slot
        held = other.call(m.Begin(rank=0, step=2, nbytes=64))
        assert held.action is m.Decision.WRITE
        h = ckpt.save({"model": model}, step=3)
        assert h.skipped and not h.wait(1) and ckpt.stats()["skipped"] == before + 1
        r = other.status().ranks[0]
        assert r.newest_committed == 1 and r.newest_verified == 1
        assert r.skips["a copy is still being written"] == 1
        assert r.skips["slots are being allocated"] == 1
        # The writer gives its slot back: the skipped newest step is committed by wait().
        other.request(m.Abort(rank=0, slot=held.slot, gen=held.gen))
    assert ckpt.wait(30)
    with SmpClient(run_dir) as c:
        assert c.status().ranks[0].newest_committed == 3
