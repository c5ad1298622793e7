"""HashService keeps each slot file mapped (read-only) while the file exists: later jobs of a
slot reuse the mapping, a replaced file is mapped anew, a removed file's mapping is dropped at
the next job, and close() unmaps everything (ftmem/smp/hashing.py). Each holds for a job hashed
by the coordinator thread (one thread, or a pool) and for a small one hashed at once on the
submitting thread."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmem import shm
from ftmem.format.layout import (
    StoredSnapshot,
    TensorExtent,
    digest,
    layout_json,
    parse_layout,
    tensors_json,
)
from ftmem.smp.hashing import HashJob, HashResult, HashService

CAP = 8192
TENSOR = 64  # one float32 (4, 4) tensor at offset 0
OBJECTS = 16  # then the objects extent
SNAP: StoredSnapshot = parse_layout(
    layout_json(
        tensors_json([TensorExtent(0, "w", "float32", (4, 4), 0, TENSOR)]), 1, (TENSOR, OBJECTS)
    ),
    CAP,
)


@pytest.fixture(params=[(1, 0), (2, 0), (1, CAP)], ids=["one-thread", "pool", "inline"])
def hasher(request: pytest.FixtureRequest) -> Iterator[HashService]:
    threads, inline_bytes = request.param
    h = HashService("n0", threads, inline_bytes)
    h.start()
    yield h
    h.close()


def make_slot(path: Path, fill: int, size: int = CAP) -> bytes:
    """A slot file of ``size`` bytes whose used bytes are ``fill``, ``fill + 1``, ...; its
    first TENSOR + OBJECTS bytes returned."""
    shm.create_segment(path, size)
    data = bytes((fill + i) % 256 for i in range(TENSOR + OBJECTS))
    with open(path, "r+b") as f:
        f.write(data)
    return data


def hash_one(hasher: HashService, path: Path, step: int = 1) -> HashResult:
    hasher.submit(HashJob(rank=0, slot=0, gen=1, step=step, path=str(path), snap=SNAP))
    if hasher.inline_bytes:
        assert hasher.pending == 0  # hashed already, on this thread
    assert hasher.wait_idle(30)
    (result,) = hasher.results()
    return result


def expected(data: bytes) -> list[str]:
    """The digests of the objects extent, then of the tensor."""
    return [digest(data[TENSOR : TENSOR + OBJECTS]), digest(data[:TENSOR])]


def mapped_in_process(path: Path) -> bool:
    """Whether this process maps ``path`` (also after it was removed: "(deleted)")."""
    with open("/proc/self/maps") as f:
        return any(str(path) in line for line in f)


def test_two_jobs_on_the_same_file_map_it_once(hasher: HashService, tmp_path: Path) -> None:
    path = tmp_path / "slot0"
    first = make_slot(path, 1)
    assert hash_one(hasher, path).digests == expected(first)
    second = bytes(reversed(first))  # the rank writes the next step into the same slot
    with open(path, "r+b") as f:
        f.write(second)
    r = hash_one(hasher, path, 2)
    assert r.error == "" and r.digests == expected(second)
    assert hasher.maps_made == 1 and hasher.mapped == [str(path)]
    assert mapped_in_process(path)


def test_a_replaced_file_is_mapped_again_and_hashed_anew(
    hasher: HashService, tmp_path: Path
) -> None:
    path = tmp_path / "slot0"
    old = make_slot(path, 1)
    assert hash_one(hasher, path).digests == expected(old)
    ino = os.stat(path).st_ino
    shm.remove_segment(path)
    new = make_slot(path, 77, 2 * CAP)  # another file (the old one is still mapped: new inode)
    assert os.stat(path).st_ino != ino
    r = hash_one(hasher, path, 2)
    assert r.error == "" and r.digests == expected(new) != expected(old)
    assert hasher.maps_made == 2 and hasher.mapped == [str(path)]


def test_a_removed_file_is_unmapped_at_the_next_job(hasher: HashService, tmp_path: Path) -> None:
    a, b = tmp_path / "slot0", tmp_path / "slot1"
    make_slot(a, 1)
    data_b = make_slot(b, 2)
    hash_one(hasher, a)
    hash_one(hasher, b)
    assert hasher.mapped == [str(a), str(b)]
    shm.remove_segment(a)
    assert mapped_in_process(a)  # still held: the next job drops it
    assert hash_one(hasher, b, 2).digests == expected(data_b)
    assert hasher.mapped == [str(b)] and hasher.maps_made == 2
    assert not mapped_in_process(a)
    r = hash_one(hasher, a, 3)  # a job for the removed slot fails, maps nothing
    assert r.error.startswith(f"cannot map {a}") and r.digests == []
    assert hasher.mapped == [str(b)]


def test_a_file_shorter_than_its_layout_is_refused(hasher: HashService, tmp_path: Path) -> None:
    path = tmp_path / "slot0"
    with open(path, "wb") as f:
        f.write(b"x" * (TENSOR + OBJECTS - 1))
    r = hash_one(hasher, path)
    assert "fewer than" in r.error and r.digests == []


def test_close_unmaps_everything(tmp_path: Path) -> None:
    hasher = HashService("n0", 2, inline_bytes=0)
    hasher.start()
    paths = [tmp_path / f"slot{i}" for i in range(3)]
    for i, p in enumerate(paths):
        make_slot(p, i)
        hash_one(hasher, p)
    assert hasher.mapped == sorted(map(str, paths))
    assert all(mapped_in_process(p) for p in paths)
    hasher.close()
    assert hasher.mapped == []
    assert not any(mapped_in_process(p) for p in paths)
    hasher.close()  # idempotent
