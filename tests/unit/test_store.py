"""The slot state machine (RankSlots) and the thread-safe SlotStore over every rank's slots:
every transition of ftmem/smp/store.py's diagram, and that the others raise."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftmem import shm
from ftmem.client.slot_maps import SlotMappings
from ftmem.format.layout import TensorExtent, layout_json, parse_layout, tensors_json
from ftmem.format.record import (
    CommitRecord,
    ManifestEntry,
    NodeManifest,
    decode_manifest,
    encode_manifest,
)
from ftmem.protocol.messages import BeginReply, Commit, to_fields
from ftmem.smp import records
from ftmem.smp.allocation import SlotFiles
from ftmem.smp.hashing import HashResult, HashService
from ftmem.smp.slot_store import SlotStore, UnknownLayoutError
from ftmem.smp.store import RankPiece, RankSlots, SlotState, StoreError


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
    rs.pin(1 - other)
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


def test_rank_slots_refuse_transitions_outside_the_diagram() -> None:
    rs = ready()
    with pytest.raises(StoreError):
        rs.pin(0)  # FREE: only committed slots are pinned
    with pytest.raises(StoreError):
        rs.finish_resize(0, "/dev/shm/y", 100, ok=True)  # not ALLOCATING
    with pytest.raises(StoreError):
        rs.finish_rebuild(0, "/dev/shm/y", CAP, 1, layout(1), parse_layout(layout(1), CAP))
    newest = rs.slots[write(rs, 1)]
    with pytest.raises(StoreError):
        snap = parse_layout(layout(2), CAP)
        rs.adopt(newest.index, 9, "/dev/shm/z", CAP, 2, 5, layout(2), snap)  # COMMITTED: no
    assert rs.unpin(0, rs.slots[0].gen) is False  # nothing to give back


# -- SlotStore: the thread-safe store, with real slot files, records and hasher -------------

NODE = "n0"
CAP = 4096
USED = 80


def layout(step: int) -> str:
    """A client's layout (no checksums): one 64-byte tensor, then 16 bytes of objects."""
    tensors = tensors_json([TensorExtent(0, "w", "float32", (4, 4), 0, 64)])
    return layout_json(tensors, step, (64, USED - 64))


@pytest.fixture
def hasher() -> Iterator[HashService]:
    h = HashService(NODE, 1)
    h.start()
    yield h
    h.close()


@pytest.fixture
def store(tmp_path: Path, hasher: HashService) -> SlotStore:
    return SlotStore(NODE, 2, SlotFiles(tmp_path, "run", NODE), hasher.submit)


def slots(store: SlotStore, rank: int = 0) -> list[dict[str, Any]]:
    return [to_fields(s) for s in store.statuses()[rank].slots]


def allocate(store: SlotStore, rank: int = 0) -> None:
    """EMPTY -> ALLOCATING -> FREE for every slot of ``rank``, with real files."""
    for index, old, gen in store.start_resize(rank, -1, CAP):
        assert old == ""
        path = store.files.path(rank, index, gen)
        shm.create_segment(path, CAP)
        store.finish_resize(rank, index, str(path), CAP, ok=True)


TENSORS = tensors_json([TensorExtent(0, "w", "float32", (4, 4), 0, 64)])


def save(store: SlotStore, step: int, rank: int = 0) -> BeginReply:
    g = store.begin(rank, step, USED)
    assert g.action == "write", g
    store.register(rank, 1, TENSORS)
    store.commit(Commit(rank, g.slot, g.gen, step, 1, 64, USED - 64))
    return g


def settle(store: SlotStore, hasher: HashService) -> list[bool]:
    """Feed every hash result to the store; whether each verified."""
    assert hasher.wait_idle(30)
    return [store.verify(r) is not None for r in hasher.results()]


def test_store_allocation_success_and_failure(store: SlotStore) -> None:
    targets = store.start_resize(0, -1, CAP)
    assert [(i, old, gen) for i, old, gen in targets] == [(0, "", 1), (1, "", 1)]
    assert {s["state"] for s in slots(store)} == {"allocating"}
    with pytest.raises(StoreError):
        store.start_resize(0, 0, CAP)  # already ALLOCATING
    store.finish_resize(0, 0, "/nowhere", CAP, ok=False)
    store.finish_resize(0, 1, str(store.files.path(0, 1, 1)), CAP, ok=True)
    assert [(s["state"], s["gen"], s["capacity"]) for s in slots(store)] == [
        ("empty", 1, 0),
        ("free", 1, CAP),
    ]
    with pytest.raises(StoreError):
        store.finish_resize(0, 1, "/again", CAP, ok=True)  # FREE is not ALLOCATING
    with pytest.raises(ValueError):
        store.start_resize(-1, -1, CAP)


def test_store_commit_writes_record_pins_for_hasher_then_verifies(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    g = save(store, 3)
    rec = records.record_path(g.path)
    assert records.read_record(rec).step == 3  # unverified: an adopting SMP hashes it
    sl = slots(store)[g.slot]
    assert (sl["state"], sl["verified"]) == ("committed", False)
    assert store.snapshots(0) is None  # a QUERY waits for the hash
    assert store.complete_steps([0]) == []
    assert settle(store, hasher) == [True]
    sl = slots(store)[g.slot]
    assert (sl["state"], sl["verified"], sl["pinned"]) == ("committed", True, 0)
    assert parse_layout(records.read_record(rec).layout, CAP).verified  # now with checksums
    snaps = store.snapshots(0)
    assert snaps is not None and parse_layout(snaps[0].layout, CAP).verified
    assert snaps is not None and [s.step for s in snaps] == [3]
    assert store.complete_steps([0]) == [3]


def test_store_commit_refuses_what_does_not_match(store: SlotStore) -> None:
    allocate(store)
    g = store.begin(0, 5, USED)
    with pytest.raises(UnknownLayoutError):
        store.commit(Commit(0, g.slot, g.gen, 5, 1, 64, 16))  # never registered
    with pytest.raises(ValueError):
        store.register(0, 1, "not json")
    with pytest.raises(ValueError):
        store.register(0, 1, layout(5))  # a whole document, not a tensors array
    store.register(0, 1, TENSORS)
    with pytest.raises(ValueError):
        store.commit(Commit(0, g.slot, g.gen, 5, 1, CAP - 8, 16))  # objects outside the slot
    with pytest.raises(StoreError):
        store.commit(Commit(0, g.slot, g.gen + 1, 5, 1, 64, 16))  # stale gen
    with pytest.raises(StoreError):
        store.commit(Commit(0, 1 - g.slot, g.gen, 5, 1, 64, 16))  # FREE, not WRITING
    assert slots(store)[g.slot]["state"] == "writing"


def test_store_begin_reuses_oldest_committed_and_removes_its_record(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    a, b = save(store, 1), save(store, 2)
    settle(store, hasher)
    g = store.begin(0, 3, USED)  # COMMITTED (not the newest, not pinned) -> WRITING
    assert (g.action, g.slot) == ("write", a.slot)
    assert not records.record_path(a.path).exists()
    assert records.record_path(b.path).exists()
    assert store.begin(0, 4, USED).action == "skip"  # a copy is still being written
    store.abort(0, g.slot, g.gen)  # WRITING -> FREE
    assert slots(store)[g.slot]["state"] == "free"


def commit_granted(store: SlotStore, g: BeginReply, step: int) -> None:
    """The rank writes its next save into the slot it was granted and commits it."""
    assert g.action == "write", g
    store.commit(Commit(0, g.slot, g.gen, step, 1, 64, USED - 64))


def test_store_grant_serves_the_next_save_and_keeps_the_old_step_readable(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    a, b = save(store, 1), save(store, 2)
    settle(store, hasher)
    g = store.grant(0, USED)  # at the COMMIT of 2: the slot of step 1, for step 3
    assert (g.action, g.slot) == ("write", a.slot)
    assert slots(store)[a.slot]["state"] == "granted"
    # Its record keeps its checksums: an adopting SMP serves it, a load checks it.
    assert parse_layout(records.read_record(records.record_path(a.path)).layout, CAP).verified
    snaps = store.snapshots(0)
    assert snaps is not None and [x.step for x in snaps] == [2, 1]  # loads check checksums
    assert store.complete_steps([0]) == [2]  # never protected or flushed
    assert store.pin_step([0], 1) is None
    commit_granted(store, g, 3)  # no BEGIN: GRANTED -> COMMITTED
    settle(store, hasher)
    assert [x.step for x in store.snapshots(0) or []] == [3, 2]
    g = store.grant(0, USED)
    assert g.slot == b.slot
    # An explicit BEGIN from the same process gives the unused grant back, record and all.
    h = store.begin(0, 4, USED * 100)
    assert h.action == "resize"
    assert slots(store)[b.slot]["state"] == "committed"
    record = records.read_record(records.record_path(b.path))
    assert record.step == 2 and parse_layout(record.layout, CAP).verified


def test_store_grant_of_a_dead_process_is_not_trusted(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    store.hello(0, pid=100, world_size=1)
    a = save(store, 1)
    save(store, 2)
    settle(store, hasher)
    assert store.grant(0, USED).slot == a.slot
    store.hello(0, pid=200, world_size=1)  # the rank restarted: it may have died mid-copy
    assert slots(store)[a.slot]["state"] == "granted"  # still readable, checked at load
    g = store.begin(0, 3, USED * 100)  # the new process asks: the grant is dropped
    assert g.action == "resize"
    assert (slots(store)[a.slot]["state"], slots(store)[a.slot]["step"]) == ("free", None)
    assert not records.record_path(a.path).exists()


def test_store_slots_grow_after_two_commits_and_the_newest_survives(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    save(store, 1)
    b = save(store, 2)
    settle(store, hasher)
    assert store.begin(0, 3, CAP * 2).action == "resize"
    targets = store.start_resize(0, -1, CAP * 2)  # both COMMITTED: the older one grows
    assert [t[0] for t in targets] == [1 - b.slot]
    for index, old, gen in targets:
        store.files.discard(old)
        path = store.files.path(0, index, gen)
        shm.create_segment(path, CAP * 2)
        store.finish_resize(0, index, str(path), CAP * 2, ok=True)
    assert [x.step for x in store.snapshots(0) or []] == [2]
    assert records.read_record(records.record_path(b.path)).step == 2
    g = store.begin(0, 3, CAP * 2)
    assert g.action == "write" and g.capacity == CAP * 2
    # The newest is never resized: with nothing else to grow, there is nothing to do.
    assert store.start_resize(0, -1, CAP * 4) == []


def test_store_hello_frees_torn_slots(store: SlotStore) -> None:
    allocate(store)
    g = store.begin(0, 1, USED)
    assert store.hello(0, pid=123, world_size=4) == [g.slot]  # WRITING -> FREE
    assert slots(store)[g.slot]["state"] == "free"
    assert store.world_size() == 4 and store.all_ranks() == [0]


def test_store_hash_failure_drops_the_slot(store: SlotStore, hasher: HashService) -> None:
    allocate(store)
    g = save(store, 1)
    assert hasher.wait_idle(30)
    (result,) = hasher.results()
    failed = HashResult(result.job, [], 0.0, 0, "cannot map it")
    assert store.verify(failed) is None  # COMMITTED -> FREE
    sl = slots(store)[g.slot]
    assert (sl["state"], sl["step"], sl["pinned"]) == ("free", None, 0)
    assert not records.record_path(g.path).exists()
    assert store.verify(result) is None  # stale: the slot was dropped meanwhile


def test_store_verify_keeps_a_pin_for_a_flush(store: SlotStore, hasher: HashService) -> None:
    allocate(store)
    save(store, 4)
    assert hasher.wait_idle(30)
    (result,) = hasher.results()
    verified = store.verify(result, keep=True)
    assert verified is not None and verified.kept is not None
    assert verified.kept.used == USED and parse_layout(verified.kept.layout, CAP).verified
    assert slots(store)[verified.kept.slot]["pinned"] == 1
    store.unpin([verified.kept])
    assert slots(store)[verified.kept.slot]["pinned"] == 0


def test_store_discard_newer_keeps_pinned_and_older(store: SlotStore, hasher: HashService) -> None:
    allocate(store)
    save(store, 11)
    g = save(store, 12)
    settle(store, hasher)
    assert store.discard_newer(0, 11) == [12]  # COMMITTED -> FREE
    assert slots(store)[g.slot]["state"] == "free"
    assert not records.record_path(g.path).exists()
    save(store, 12)
    settle(store, hasher)
    pieces = store.pin_step([0], 12)
    assert pieces is not None
    assert store.discard_newer(0, 11) == []  # pinned: kept
    store.unpin(pieces)


def test_store_resize_of_committed_slot_but_never_the_newest_or_pinned(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    old, new = save(store, 1), save(store, 2)
    settle(store, hasher)
    with pytest.raises(StoreError):
        store.start_resize(0, new.slot, 2 * CAP)  # the newest
    pieces = store.pin_step([0], 1)
    assert pieces is not None
    with pytest.raises(StoreError):
        store.start_resize(0, old.slot, 2 * CAP)  # pinned
    store.unpin(pieces)
    # COMMITTED (not the newest, not pinned) -> ALLOCATING
    assert store.start_resize(0, old.slot, 2 * CAP) == [(old.slot, old.path, old.gen + 1)]
    assert slots(store)[old.slot]["state"] == "allocating"


def test_store_pins_from_two_threads_are_all_counted(store: SlotStore, hasher: HashService) -> None:
    allocate(store, 0)
    allocate(store, 1)
    save(store, 7, rank=0)
    save(store, 7, rank=1)
    settle(store, hasher)
    assert store.pin_step([0, 1, 2], 7) is None  # rank 2 has nothing: nothing pinned
    assert store.pin_step([0], 8) is None
    held: list[list[RankPiece]] = [[], []]
    start = threading.Barrier(2)

    def pin(k: int) -> None:
        start.wait()
        for _ in range(500):
            pieces = store.pin_step([0, 1], 7)
            assert pieces is not None
            held[k].append(pieces[0])
            held[k].append(pieces[1])

    threads = [threading.Thread(target=pin, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [s["pinned"] for r in (0, 1) for s in slots(store, r) if s["step"] == 7] == [1000, 1000]
    unpinners = [threading.Thread(target=store.unpin, args=(held[k],)) for k in range(2)]
    for t in unpinners:
        t.start()
    for t in unpinners:
        t.join(60)
    assert all(s["pinned"] == 0 for r in (0, 1) for s in slots(store, r))


def test_store_install_rebuilt_replaces_even_the_newest(
    store: SlotStore, hasher: HashService, tmp_path: Path
) -> None:
    allocate(store)
    save(store, 1)
    b = save(store, 2)
    settle(store, hasher)
    pieces = store.pin_step([0], 1)
    assert pieces is not None  # slot a pinned: only the newest (b) may take the rebuild
    text = layout(9)
    manifest = NodeManifest(9, [ManifestEntry(0, USED, CAP, text)])
    data = memoryview(bytes(range(USED)))
    (piece,) = store.install_rebuilt(9, manifest, data)  # COMMITTED -> ALLOCATING -> COMMITTED
    assert (piece.slot, piece.gen, piece.used) == (b.slot, b.gen + 1, USED)
    assert not Path(b.path).exists() and Path(piece.path).read_bytes()[:USED] == bytes(data)
    sl = slots(store)[b.slot]
    assert (sl["state"], sl["step"], sl["pinned"]) == ("committed", 9, 2)  # exchange + hasher
    assert settle(store, hasher) == [True]  # the manifest had no checksums: hashed here
    assert records.read_record(records.record_path(piece.path)).step == 9  # once verified
    assert store.complete_steps([0]) == [9, 1]
    store.unpin([piece, *pieces])
    assert all(s["pinned"] == 0 for s in slots(store))


def test_store_install_rebuilt_checks_the_manifest_first(store: SlotStore) -> None:
    allocate(store)
    good = ManifestEntry(0, USED, CAP, layout(9))
    for raw in (b"{}", b'{"step": 9}', b'{"step": 8, "ranks": []}', b"[]", b"\xff"):
        with pytest.raises(ValueError):
            decode_manifest(raw, 9)
    assert decode_manifest(encode_manifest(NodeManifest(9, [good])), 9).ranks == [good]
    for manifest, n in (
        (NodeManifest(9, [good]), USED + 1),
        (NodeManifest(9, [dataclasses.replace(good, nbytes=USED - 1)]), USED - 1),
        (NodeManifest(9, [dataclasses.replace(good, layout="{")]), USED),
    ):
        with pytest.raises(ValueError):
            store.install_rebuilt(9, manifest, memoryview(bytes(n)))
    assert {s["state"] for s in slots(store)} == {"free"}


def test_store_install_rebuilt_with_every_slot_held_raises(
    store: SlotStore, hasher: HashService
) -> None:
    allocate(store)
    save(store, 1)
    save(store, 2)
    settle(store, hasher)
    pins = [store.pin_step([0], 1), store.pin_step([0], 2)]
    manifest = NodeManifest(9, [ManifestEntry(0, USED, CAP, layout(9))])
    with pytest.raises(StoreError):
        store.install_rebuilt(9, manifest, memoryview(bytes(USED)))
    for p in pins:
        assert p is not None
        store.unpin(p)


def test_store_adopts_what_a_previous_smp_left(
    store: SlotStore, hasher: HashService, tmp_path: Path
) -> None:
    allocate(store)
    g = save(store, 5)
    settle(store, hasher)
    save(store, 6)  # committed, not verified yet when "the SMP dies"
    nonce = store.files.nonce
    # Not this run's and node's: a non-slot name, and the same text split another way
    # (run ``run-n0`` node ``x`` vs run ``run`` node ``n0-x``, with a valid record).
    junk = tmp_path / f"run@{NODE}@{nonce}@r0-junk"
    junk.write_bytes(b"junk")
    other = SlotFiles(tmp_path, "run", f"{NODE}-x").path(0, 0, 1)
    shm.create_segment(other, CAP)
    records.write_record(other, CommitRecord(0, 0, 1, CAP, 7, 1, layout(7)))
    assert hasher.wait_idle(30)
    hasher.results()  # the old SMP never saw this result
    again = SlotStore(NODE, 2, SlotFiles(tmp_path, "run", NODE), hasher.submit)
    assert again.files.nonce != nonce  # a new SMP names its new files differently...
    adopted = again.adopt_left()  # EMPTY -> COMMITTED
    assert sorted(a.record.step for a in adopted) == [5, 6]
    assert all(f"@{nonce}@" in a.path.name for a in adopted)  # ...and adopts any nonce
    by_step = {s["step"]: s for s in slots(again)}
    assert by_step[5]["verified"] and by_step[5]["gen"] == g.gen
    assert not by_step[6]["verified"] and by_step[6]["pinned"] == 1  # hashing again
    assert settle(again, hasher) == [True]
    assert again.complete_steps([0]) == [6, 5]
    with pytest.raises(StoreError):
        again.adopt_left()  # its slots are COMMITTED now: the same records cannot be adopted
    kept = sorted(p.name for p in tmp_path.iterdir())
    slot_files = [n for n in kept if n.startswith(f"run@{NODE}@{nonce}@r0-s")]
    assert len(slot_files) == 4  # two slot files and their records
    assert junk.name in kept and other.name in kept  # untouched
    assert [p.name for p in again.files.ours()] == slot_files
    assert again.files.path(0, 1, 9).name.startswith(f"run@{NODE}@{again.files.nonce}@")


def test_slot_file_names_map_back_to_one_run_and_node() -> None:
    a = shm.slot_file_name("a-b", "c", "0123456789abcdef", 0, 1, 2)
    b = shm.slot_file_name("a", "b-c", "0123456789abcdef", 0, 1, 2)
    assert a != b
    assert shm.parse_slot_name(a) == shm.SlotName("a-b", "c", "0123456789abcdef", 0, 1, 2, "")
    assert shm.parse_slot_name(b + ".commit") == shm.SlotName(
        "a", "b-c", "0123456789abcdef", 0, 1, 2, ".commit"
    )
    for bad in ("a@b", "", "a/b", "x" * 65, "a\n"):
        with pytest.raises(ValueError):
            SlotFiles(Path("/nonexistent"), bad, "n0")
        with pytest.raises(ValueError):
            SlotFiles(Path("/nonexistent"), "r", bad)
    with pytest.raises(ValueError):
        shm.slot_file_name("r", "n", "not-hex", 0, 0, 0)
    for name in (
        "ftmem-a-b-c-r0-s1-g2",
        a + "\n",
        a + ".commit.x",
        a.replace("@r0", "@r" + "9" * 40),
    ):
        assert shm.parse_slot_name(name) is None


def test_a_step_another_rank_of_the_node_may_still_need_is_granted_only_conditionally(
    store: SlotStore, hasher: HashService, tmp_path: Path
) -> None:
    """A granted slot is overwritten without a message: while rank 1's newest commit is step
    1, rank 0's slot of step 1 may be their newest common step, so its grant is conditional:
    the board says pending until rank 1 commits step 2, and a pin of step 1 meanwhile takes the
    slot back (revoked) and keeps step 1 for both ranks. Ready is final."""
    tmp_path.chmod(0o700)
    allocate(store, 0)
    allocate(store, 1)
    save(store, 1, rank=0)
    save(store, 2, rank=0)
    save(store, 1, rank=1)
    settle(store, hasher)
    g = store.grant(0, USED)
    assert g.action == "write" and g.board and g.cell >= 0, g
    board = shm.map_board(Path(g.board), tmp_path)
    try:
        assert board[g.cell] == shm.GRANT_PENDING
        assert store.complete_steps([0, 1]) == [1]  # the granted step 1 still counts
        pieces = store.pin_step([0, 1], 1)
        assert pieces is not None and board[g.cell] == shm.GRANT_REVOKED
        assert [s["state"] for s in slots(store)].count("granted") == 0
        assert store.grant(0, USED).action == "skip"  # step 1 pinned, step 2 the newest
        store.unpin(pieces)
        g2 = store.grant(0, USED)
        assert g2.action == "write" and g2.board == g.board and board[g2.cell] == shm.GRANT_PENDING
        rank_view = SlotMappings()  # what a rank reads before it writes the slot
        rank_view.shm_dir = tmp_path
        assert not rank_view.grant_ready(g2)
        save(store, 2, rank=1)
        assert board[g2.cell] == shm.GRANT_READY
        assert rank_view.grant_ready(g2)
        planted = tmp_path / "elsewhere@n@0123456789abcdef@grants"
        planted.write_bytes(b"\x01" * shm.BOARD_CELLS)
        assert not rank_view.grant_ready(dataclasses.replace(g2, board=str(planted) + "x"))
        rank_view.close()
        settle(store, hasher)
        assert store.pin_step([0, 1], 1) is None  # a ready grant is never taken back
        assert store.complete_steps([0, 1]) == [2]
    finally:
        board.close()
    store.close()
    assert not Path(g.board).exists()
