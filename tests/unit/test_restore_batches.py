"""copy_verified batches small tensors into verify-and-copy tasks of at least HASH_PIECE bytes
(a large tensor still goes piece by piece): the restore stays bitwise, and a corrupt byte is
caught before any byte of its task reaches a live tensor (ftmem/client/restore.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ftmem import shm
from ftmem.client.flatten import flatten_state
from ftmem.client.planner import plan_layout
from ftmem.client.restore import copy_verified, plan_restore
from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import HASH_PIECE, StoredSnapshot, digest, layout_json, parse_layout
from ftmem.format.tensors import encode_skeleton, read_objects

SMALL = HASH_PIECE // 4  # four small tensors fill one task
THREADS = pytest.mark.parametrize("threads", [1, 2], ids=["one-thread", "pool"])


@pytest.fixture
def slot_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o700)  # private, as MappedSegment requires of the shared-memory directory
    yield d


def saved(
    tensors: dict[str, torch.Tensor], slot_dir: Path
) -> tuple[shm.MappedSegment, StoredSnapshot]:
    """A verified snapshot of ``{"w": tensors}`` in a slot file, as the SMP would hold it."""
    flat = flatten_state({"w": tensors})
    lay = plan_layout(flat)
    objects = encode_skeleton(flat.skeleton)
    cap = shm.round_capacity(lay.tensors_end + len(objects))
    path = slot_dir / shm.slot_file_name("run", "n0", shm.new_nonce(), 0, 0, 1)
    shm.create_segment(path, cap)
    seg = shm.MappedSegment(path, cap, slot_dir)
    for e, t in zip(lay.extents, flat.tensors, strict=True):
        seg.tensor[e.offset : e.offset + e.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    seg.view[lay.tensors_end : lay.tensors_end + len(objects)] = objects
    snap = parse_layout(layout_json(lay.tensors_json, 1, (lay.tensors_end, len(objects))), cap)
    hashed = tuple(
        replace(t, hash=digest(seg.view[t.offset : t.offset + t.nbytes])) for t in snap.tensors
    )
    return seg, replace(snap, tensors=hashed, objects_hash=digest(objects))


def restore(
    live: dict[str, torch.Tensor], seg: shm.MappedSegment, snap: StoredSnapshot, threads: int
) -> None:
    plan = plan_restore({"w": live}, snap, read_objects(snap, seg.view))
    copy_verified(plan, seg, threads=threads)


def flip(seg: shm.MappedSegment, snap: StoredSnapshot, name: str, at: int) -> None:
    """Corrupt byte ``at`` of tensor ``name`` in the slot (after the SMP hashed it)."""
    t = next(t for t in snap.tensors if t.name == name)
    seg.view[t.offset + at] ^= 0x01


def small_tensors(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"s{i}": torch.randn(SMALL // 4, generator=g) for i in range(n)}


@THREADS
def test_batched_restore_is_bitwise(slot_dir: Path, threads: int) -> None:
    g = torch.Generator().manual_seed(0)
    stored = {
        "big": torch.randn((2 * HASH_PIECE + HASH_PIECE // 2) // 4, generator=g),  # 3 pieces
        **{f"s{i}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)},
        "half": torch.randn(33, generator=g).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "mid": torch.randn(3 * SMALL // 4, generator=g),
        "grid": torch.randn(8, 16, generator=g),
    }
    seg, snap = saved(stored, slot_dir)
    try:
        live = {k: torch.full_like(v, -1) for k, v in stored.items()}
        live["grid"] = torch.full((16, 8), -1.0).t()  # a strided target: checked, then copied
        assert not live["grid"].is_contiguous()
        before = dict(live)
        restore(live, seg, snap, threads)
        for k, v in stored.items():
            assert live[k] is before[k], k  # restored in place
            assert torch.equal(live[k], v), k
    finally:
        seg.close()


@THREADS
def test_a_corrupt_small_tensor_stops_its_whole_task_before_any_copy(
    slot_dir: Path, threads: int
) -> None:
    stored = small_tensors(8, seed=1)  # two tasks: s0..s3, s4..s7
    seg, snap = saved(stored, slot_dir)
    try:
        flip(seg, snap, "w.s2", 1000)  # the third tensor of the first task
        live = {k: torch.full_like(v, -1) for k, v in stored.items()}
        old = {k: v.clone() for k, v in live.items()}
        with pytest.raises(CorruptSnapshotError, match="fail their checksum") as err:
            restore(live, seg, snap, threads)
        assert "'w.s2'" in str(err.value)
        assert not any(f"'w.s{i}'" in str(err.value) for i in (0, 1, 3, 4, 5, 6, 7))
        # s0 and s1 passed their checksums before s2 was hashed, yet nothing of the task
        # was copied: the live tensors of that task hold their old bytes.
        for k in ("s0", "s1", "s2", "s3"):
            assert torch.equal(live[k], old[k]), k
        # Every live tensor holds its old bytes or verified ones (docs/design.md, "Restore").
        for k, v in live.items():
            assert torch.equal(v, old[k]) or torch.equal(v, stored[k]), k
    finally:
        seg.close()


@THREADS
def test_a_corrupt_piece_of_a_large_tensor_is_not_copied(slot_dir: Path, threads: int) -> None:
    g = torch.Generator().manual_seed(2)
    stored = {"big": torch.randn((2 * HASH_PIECE + 4096) // 4, generator=g), **small_tensors(2, 3)}
    seg, snap = saved(stored, slot_dir)
    try:
        flip(seg, snap, "w.big", HASH_PIECE + 5)  # in its second piece
        live = {k: torch.full_like(v, -1) for k, v in stored.items()}
        with pytest.raises(CorruptSnapshotError, match=r"'w\.big' fail their checksum"):
            restore(live, seg, snap, threads)
        piece = live["big"].view(torch.uint8)[HASH_PIECE : 2 * HASH_PIECE]
        assert bool((piece.view(torch.float32) == -1).all())  # the corrupt piece: old bytes
        for k, v in live.items():  # the rest: old bytes or verified ones
            if k != "big":
                assert torch.equal(v, stored[k]) or bool((v == -1).all()), k
    finally:
        seg.close()
