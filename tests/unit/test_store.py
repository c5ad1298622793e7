"""The per-rank slot state machine: the newest committed slot is never handed out."""

from __future__ import annotations

import pytest

from ftmem.smp.store import RankSlots, SlotState, StoreError


def ready(nslots: int = 2, cap: int = 100) -> RankSlots:
    rs = RankSlots(rank=0, nslots=nslots)
    for s in rs.slots:
        rs.start_resize(s.index)
        rs.finish_resize(s.index, f"/dev/shm/x{s.index}", cap, ok=True)
    return rs


def write(rs: RankSlots, step: int, n: int = 10) -> int:
    d = rs.begin(step, n)
    assert d.action == "write", d
    rs.commit(d.slot, rs.slots[d.slot].gen, step, "{}")
    return d.slot


def test_empty_slots_need_resize() -> None:
    rs = RankSlots(rank=0, nslots=2)
    d = rs.begin(1, 10)
    assert d.action == "resize"


def test_alternates_and_keeps_newest() -> None:
    rs = ready()
    a = write(rs, 1)
    b = write(rs, 2)
    assert a != b
    c = write(rs, 3)
    assert c == a
    assert [s.step for s in rs.committed()] == [3, 2]


def test_skip_while_writing() -> None:
    rs = ready()
    rs.begin(1, 10)
    assert rs.begin(2, 10).action == "skip"


def test_skip_when_other_slot_pinned() -> None:
    rs = ready()
    write(rs, 1)
    other = write(rs, 2)
    rs.slots[1 - other].pinned = 1
    assert rs.begin(3, 10).action == "skip"


def test_restart_drops_torn_slot_not_committed() -> None:
    rs = ready()
    write(rs, 1)
    rs.begin(2, 10)
    assert rs.restarted(pid=5) != []
    assert [s.step for s in rs.committed()] == [1]
    assert all(s.state is not SlotState.WRITING for s in rs.slots)


def test_too_small_slot_asks_resize_but_never_newest() -> None:
    rs = ready(cap=100)
    newest = write(rs, 1)
    d = rs.begin(2, 1000)
    assert d.action == "resize" and d.slot != newest
    with pytest.raises(StoreError):
        rs.start_resize(newest)


def test_commit_with_stale_gen_is_refused() -> None:
    rs = ready()
    d = rs.begin(1, 10)
    with pytest.raises(StoreError):
        rs.commit(d.slot, rs.slots[d.slot].gen + 1, 1, "{}")
    with pytest.raises(StoreError):
        rs.commit(d.slot, rs.slots[d.slot].gen, 2, "{}")


def test_discard_newer() -> None:
    rs = ready()
    write(rs, 11)
    write(rs, 12)
    assert rs.discard_newer(11) == [12]
    assert [s.step for s in rs.committed()] == [11]
    # the freed slot is reused, step 11 survives
    write(rs, 12)
    assert [s.step for s in rs.committed()] == [12, 11]


def test_abort_frees() -> None:
    rs = ready()
    d = rs.begin(1, 10)
    rs.abort(d.slot, rs.slots[d.slot].gen)
    assert rs.slots[d.slot].state is SlotState.FREE
