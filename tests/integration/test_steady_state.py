"""The steady-state save against a real SMP: one message per save, and a state that changes
structure between saves (or grows) is snapshotted as it is, never with a stale plan."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ftmem
from ftmem.config import ClientConfig
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess


class Bag:
    """A Stateful whose state_dict the test changes between saves."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {"count": 0, "w": torch.zeros(4)}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = dict(sd)


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, Bag]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), Bag()


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def requests(run_dir: Path) -> dict[str, int]:
    with SmpClient(run_dir) as c:
        return dict(c.status().requests)


def verified(run_dir: Path, step: int, rank: int = 0) -> None:
    """Until the SMP has checksummed ``step`` of ``rank``: at a step's pace (milliseconds
    here, far longer in training) the previous slot is free again when the next COMMIT
    asks for it; a slot the hasher still reads is never granted."""
    deadline = time.monotonic() + 60
    while True:
        with SmpClient(run_dir) as c:
            if c.status().ranks[rank].newest_verified == step:
                return
        assert time.monotonic() < deadline, f"step {step} not verified"
        time.sleep(0.01)


@pytest.fixture
def ckpt(smp: SmpProcess, run_dir: Path) -> Iterator[ftmem.Checkpointer]:
    c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    yield c
    c.close()


def restored(run_dir: Path, like: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Load the newest snapshot into a copy of ``like`` with other values; the step and it."""
    target = {k: copy.deepcopy(v) for k, v in like.items()}
    with torch.no_grad():
        for p in target["model"].parameters():
            p.add_(1)
    other = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        step = other.load(target)
    finally:
        other.close()
    return step, target


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def check_bitwise(run_dir: Path, state: dict[str, Any], step: int) -> None:
    got, target = restored(run_dir, state)
    assert got == step
    assert same(state["model"].state_dict(), target["model"].state_dict())
    assert same(state["optim"].state_dict(), target["optim"].state_dict())
    assert same(state["bag"].state_dict(), target["bag"].state_dict())
    if "extra" in state:
        assert same(state["extra"].state_dict(), target["extra"].state_dict())


def test_steady_state_sends_one_message_per_save(ckpt: ftmem.Checkpointer, run_dir: Path) -> None:
    model, opt, bag = make()
    state = {"model": model, "optim": opt, "bag": bag}
    train(model, opt)
    ckpt.save(state, step=1)
    assert ckpt.wait(60)
    for step in (2, 3):  # the first save after the slots exist plans the layout
        train(model, opt)
        ckpt.save(state, step=step).wait(30)
        verified(run_dir, step)  # so that the next COMMIT finds the older slot free
    before = requests(run_dir)
    for step in range(4, 14):
        train(model, opt)
        bag.sd["count"] = step  # a small object changes every save: encoded again
        assert not ckpt.save(state, step=step).skipped
        ckpt.wait(30)
        verified(run_dir, step)
    after = requests(run_dir)
    sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert sent.get("COMMIT") == 10
    assert sent.get("BEGIN", 0) == 0 and sent.get("PREPARE", 0) == 0
    check_bitwise(run_dir, state, 13)


def test_two_ranks_of_a_node_saving_in_lockstep_send_one_message_per_save(
    smp: SmpProcess, run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks of one node commit each step one after the other (alternating who is
    first). The first to commit step N may not overwrite its step N-1 yet (the other rank's
    newest), so its grant is conditional; the other's commit settles it on the grant board, and
    the next save writes without a BEGIN. Both ranks' newest snapshots restore bitwise."""
    ckpts, states = [], []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        model, opt, bag = make()
        states.append({"model": model, "optim": opt, "bag": bag})
        assert c.rank == rank
        ckpts.append(c)
    try:

        def step_all(step: int, warm: bool = True) -> None:
            order = (0, 1) if step % 2 else (1, 0)
            for r in order:
                train(states[r]["model"], states[r]["optim"])
                states[r]["bag"].sd["count"] = step
                handle = ckpts[r].save(states[r], step=step)
                assert not (warm and handle.skipped), (r, step, handle.reason)
                assert ckpts[r].wait(60)  # a skipped step is saved again here
            for r in (0, 1):
                verified(run_dir, step, rank=r)

        # Warm-up: the first save of each rank makes its slots; the next ones map the second
        # slot (a save that finds it still being mapped skips, as it should) and plan layouts.
        for step in (1, 2, 3):
            step_all(step, warm=False)
        before = requests(run_dir)
        for step in range(4, 14):
            step_all(step)
        after = requests(run_dir)
        sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert sent.get("COMMIT") == 20
        assert sent.get("BEGIN", 0) == 0 and sent.get("PREPARE", 0) == 0
        monkeypatch.setenv("RANK", "1")
        check_bitwise(run_dir, states[1], 13)
        monkeypatch.setenv("RANK", "0")
        check_bitwise(run_dir, states[0], 13)
    finally:
        for c in ckpts:
            c.close()


def test_a_state_that_changes_structure_is_snapshotted_as_it_is(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    model, opt, bag = make()
    state = {"model": model, "optim": opt, "bag": bag}
    ckpt.save(state, step=1)  # no optimizer state yet
    assert ckpt.wait(60)
    step = 1

    def save_and_check() -> None:
        nonlocal step
        step += 1
        assert not ckpt.save(state, step=step).skipped
        assert ckpt.wait(30)
        check_bitwise(run_dir, state, step)

    save_and_check()
    train(model, opt)  # AdamW creates its state lazily: new tensors in the optimizer's dict
    save_and_check()
    save_and_check()  # steady
    bag.sd["extra"] = torch.arange(3)  # a new key in a Stateful
    save_and_check()
    bag.sd["w"] = torch.ones(6, dtype=torch.float64)  # a tensor replaced by another shape
    save_and_check()
    bag.sd["w"].add_(1)  # same tensor, new values (copied eagerly: not the optimizer's)
    save_and_check()
    extra = torch.nn.Linear(3, 3)
    state["extra"] = extra
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})  # a group added
    save_and_check()
    extra(torch.randn(2, 3)).sum().backward()
    train(model, opt)
    save_and_check()
    with torch.no_grad():
        model[0].weight.data = torch.randn(16, 8)  # a parameter's storage swapped
    save_and_check()


def test_a_state_that_grows_after_two_commits_gets_bigger_slots(
    ckpt: ftmem.Checkpointer, run_dir: Path
) -> None:
    model, opt, bag = make()
    state = {"model": model, "optim": opt, "bag": bag}
    train(model, opt)
    ckpt.save(state, step=1)
    assert ckpt.wait(60)
    ckpt.save(state, step=2).wait(30)  # both slots committed
    verified(run_dir, 2)
    with SmpClient(run_dir) as c:
        r = c.status().ranks[0]
    assert r.newest_committed == 2
    assert {s.state for s in r.slots} <= {"committed", "granted"}  # step 1's: maybe granted
    small = max(s.capacity for s in r.slots)
    bag.sd["big"] = torch.randn(small // 4 + 1024)  # now bigger than any slot
    ckpt.save(state, step=3)  # skipped while the slots grow (the newest is kept)
    with SmpClient(run_dir) as c:
        assert 2 in c.status().ranks[0].committed_steps
    assert ckpt.wait(60)  # the final save waits for the bigger slots: step 3 committed
    check_bitwise(run_dir, state, 3)
    ckpt.save(state, step=4)
    assert ckpt.wait(60)
    with SmpClient(run_dir) as c:
        r = c.status().ranks[0]
    assert r.newest_committed == 4
    assert min(s.capacity for s in r.slots) > small
    check_bitwise(run_dir, state, 4)
