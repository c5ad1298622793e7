"""Hostile files, fuzzed with hypothesis (a bounded number of cases, derandomized): checkpoint
manifests (``read_checkpoint``), nodes' part manifests (``read_part``), the parts' DCP metadata
as JSON (``metadata_from_json``) and the SMP's commit records next to slot files
(``records.scan``). Each reader must accept only well-formed input and refuse the rest with its
documented error (``CorruptSnapshotError``; ``ValueError`` for commit records, which
``scan`` turns into "not adoptable"), never anything else, never hang, never unpickle.

Bugs found here earlier are pinned by ``test_fixed_*``; the strategies include the inputs that
used to crash a reader (non-finite numbers, integers past Python's parsing limit, short
chunks). Manifests that parse are signed with the tier key, as ftmem signs its own, so the
checks under the signature are exercised too.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftmem.errors import CorruptSnapshotError
from ftmem.format.record import record_text
from ftmem.smp import records
from ftmem.tiers import signing
from ftmem.tiers.assemble import read_part
from ftmem.tiers.checkpoints import MANIFEST, Checkpoint, read_checkpoint
from ftmem.tiers.dcp_meta import metadata_from_json

FUZZ = settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)
hostile_ints = st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 2**31, 2**63, 2**64 + 1]) | st.integers(
    -3, 100
)
names = st.sampled_from(
    [
        "a.distcp",
        "sub/b.distcp",
        ".metadata",
        "missing.distcp",
        "../a.distcp",
        "/etc/passwd",
        "a/b/c",
        "..",
        ".",
        "",
        "sub/",
        "a\x00b",
        "sub/../a.distcp",
        "-x",
        "é",
    ]
) | st.text(max_size=10)
_HUGE = "9" * 5000  # past Python's int-parsing limit: json.loads raises ValueError
HUGE_NUMBERS = [
    f'{{"version": 1, "step": {_HUGE}, "world_size": 1, "files": {{}}}}'.encode(),
    f'{{"version": 1, "step": 1, "world_size": {_HUGE}, "files": {{}}}}'.encode(),
    b'{"version": 1, "step": 1, "world_size": 1, "ranks": [Infinity], "files": {}}',
    b'{"version": 1, "step": 1, "world_size": 1, "files": {"a.distcp": {"bytes": NaN}}}',
]
FILES = {"a.distcp": b"0123456789", ".metadata": b"abc", "sub/b.distcp": b"xy"}


def _signed(manifest: bytes) -> bytes:
    """A JSON object manifest signed with the tier key, as ftmem signs its own: the readers
    below the signature check see the fuzzed fields (anything else is written as it is)."""
    try:
        doc = json.loads(manifest)
        if isinstance(doc, dict):
            return json.dumps(signing.sign(doc, signing.tier_key(create=True))).encode()
    except ValueError:
        pass
    return manifest


def _checkpoint_dir(root: Path, manifest: bytes) -> Path:
    ck = root / "step_0000000003"
    (ck / "sub").mkdir(parents=True)
    for name, data in FILES.items():
        (ck / name).write_bytes(data)
    (ck / MANIFEST).write_bytes(_signed(manifest))
    return ck


def _manifests() -> st.SearchStrategy[dict[str, Any]]:
    entry = (
        st.fixed_dictionaries(
            {
                "bytes": hostile_ints | st.floats() | st.text(max_size=3),
                "xxh3": st.text(max_size=16) | hostile_ints,
            }
        )
        | json_values
    )
    base = {
        "version": st.sampled_from([1, 2, "1", None]),
        "step": hostile_ints | st.floats() | st.text(max_size=4),
        "files": st.dictionaries(names, entry, max_size=4) | json_values,
    }
    small_world = st.fixed_dictionaries(
        {**base, "world_size": st.integers(-2, 64) | st.just(2**40)},
        optional={"ranks": st.lists(hostile_ints, max_size=5) | json_values, "extra": json_values},
    )
    any_world = st.fixed_dictionaries(
        {**base, "world_size": hostile_ints, "ranks": st.lists(hostile_ints, max_size=5)}
    )
    return small_world | any_world


@FUZZ
@given(
    _manifests().map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.sampled_from(HUGE_NUMBERS)
    | st.binary(max_size=300)
)
def test_checkpoint_manifests_are_read_or_refused(manifest: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        ck = _checkpoint_dir(Path(d), manifest)
        try:
            got = read_checkpoint(ck)
        except CorruptSnapshotError:
            return
        assert isinstance(got.step, int) and isinstance(got.world_size, int)
        assert got.ranks and all(0 <= r < got.world_size for r in got.ranks)
        for name, (size, _) in got.files.items():  # named files stay inside, with their sizes
            parts = name.split("/")
            assert len(parts) <= 2 and all(p not in ("", ".", "..") for p in parts), name
            assert (ck / name).resolve().is_relative_to(ck.resolve())
            assert (ck / name).stat().st_size == size


def _part_docs() -> st.SearchStrategy[dict[str, Any]]:
    hashes = st.dictionaries(
        st.sampled_from(["0", "1", "2", "-1", "x", "01", " 1"]) | st.text(max_size=3),
        st.dictionaries(st.text(max_size=5), st.text(max_size=5) | hostile_ints, max_size=3)
        | json_values,
        max_size=3,
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "dcp": st.dictionaries(st.text(max_size=5), json_values, max_size=3) | json_values,
            "hashes": hashes | json_values,
            "chunked": st.lists(st.text(max_size=5), max_size=3) | json_values,
        },
    )


@FUZZ
@given(_part_docs(), st.sampled_from([(0,), (1,), (0, 1), (1, 2)]))
def test_part_manifests_are_read_or_refused(extra: dict[str, Any], ranks: tuple[int, ...]) -> None:
    with tempfile.TemporaryDirectory() as d:
        doc = {"version": 1, "step": 3, "world_size": 3, "ranks": list(ranks), "files": {}}
        ck = _checkpoint_dir(Path(d), json.dumps({**doc, **extra}).encode())
        ckpt = Checkpoint(ck, 3, 3, 0, {}, ranks)
        try:
            part = read_part(ckpt)
        except CorruptSnapshotError:
            return
        assert sorted(part.hashes) == list(ranks)
        assert isinstance(part.dcp, dict)
        assert all(isinstance(v, str) for h in part.hashes.values() for v in h.values())


def _storage_entry() -> st.SearchStrategy[Any]:
    return (
        st.tuples(
            st.text(max_size=5) | hostile_ints,
            st.none() | st.lists(hostile_ints, max_size=3) | json_values,
            st.none() | hostile_ints | st.text(max_size=2),
            st.sampled_from(["__0_0.distcp", "part-r000001/__0_0.distcp"]) | json_values,
            st.integers(0, 2**40) | json_values,
            st.integers(0, 2**40) | json_values,
            st.none() | st.lists(st.text(max_size=4), max_size=2) | json_values,
        ).map(list)
        | json_values
    )


def _metadata_docs() -> st.SearchStrategy[Any]:
    chunk = (
        st.tuples(
            st.lists(st.integers(0, 2**40), max_size=3), st.lists(st.integers(0, 2**40), max_size=3)
        ).map(list)
        | json_values
    )
    tensor = (
        st.fixed_dictionaries(
            {
                "dtype": st.sampled_from(
                    ["float32", "int64", "bfloat16", "Tensor", "__class__", "x", ""]
                )
                | json_values,
                "size": st.lists(st.integers(0, 2**40), max_size=3) | json_values,
                "chunks": st.lists(chunk, max_size=3) | json_values,
            }
        )
        | json_values
    )
    return (
        st.fixed_dictionaries(
            {
                "tensors": st.dictionaries(st.text(max_size=6), tensor, max_size=3) | json_values,
                "bytes": st.lists(st.text(max_size=6), max_size=3) | json_values,
                "storage": st.lists(_storage_entry(), max_size=3) | json_values,
                "planner": st.dictionaries(st.text(max_size=4), json_values, max_size=2)
                | json_values,
            },
            optional={"version": json_values},
        )
        | json_values
    )


@FUZZ
@given(_metadata_docs())
def test_part_metadata_json_is_rebuilt_or_refused(doc: Any) -> None:
    try:
        md = metadata_from_json(doc)
    except CorruptSnapshotError:
        return
    # What is accepted can be written as the global .metadata (the coordinator pickles it).
    pickle.dumps(md)
    for info in (md.storage_data or {}).values():
        assert isinstance(info.relative_path, str)


def _record_text(fields: dict[str, Any], checksum_ok: bool) -> str:
    text = record_text(fields)
    return text if checksum_ok else text[:-16] + "0" * 16


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["r0-s0-g1", "r0-s1-g2", "r1-s0-g1", "r0-s9-g1", "rx-s0-g1", "r0-s0"]),
            st.sampled_from(["0123456789abcdef", "fedcba9876543210"]),  # two SMPs' nonces
            st.fixed_dictionaries(
                {
                    "version": st.sampled_from([2, 2, 1]),
                    "rank": st.sampled_from([0, 1, -1, 2**20 - 1]),
                    "slot": st.sampled_from([0, 1, 9, -1]),
                    "gen": st.sampled_from([1, 2, 0]),
                    "capacity": st.sampled_from([64, 128, -1, 2**40]),
                    "step": hostile_ints,
                    "seq": hostile_ints,
                    "layout": st.text(max_size=10) | hostile_ints,
                }
            ),
            st.booleans(),
            st.sampled_from([64, 128, 0]),
            st.booleans(),
        ),
        max_size=4,
    )
)
def test_commit_records_are_adopted_only_when_consistent(
    files: list[tuple[str, str, dict[str, Any], bool, int, bool]],
) -> None:
    with tempfile.TemporaryDirectory() as d:
        shm = Path(d)
        for suffix, nonce, fields, checksum_ok, size, with_record in files:
            slot = shm / f"run@n0@{nonce}@{suffix}"
            slot.write_bytes(b"\0" * size)
            if with_record:
                records.record_path(slot).write_text(_record_text(fields, checksum_ok))
        found, leftovers = records.scan(shm, "run", "n0", 3)
        assert len({(a.record.rank, a.record.slot) for a in found}) == len(found)
        for a in found:
            rec = a.record
            assert a.path.name.startswith("run@n0@")
            assert a.path.name.endswith(f"@r{rec.rank}-s{rec.slot}-g{rec.gen}")
            assert 0 <= rec.slot < 3 and a.path.stat().st_size == rec.capacity
            assert min(rec.rank, rec.gen, rec.step, rec.seq) >= 0 and isinstance(rec.layout, str)
        assert not {a.path for a in found} & set(leftovers)


# ------------------------------------------------------------ inputs that used to crash a reader


def test_fixed_infinite_step_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint_dir(
        tmp_path, b'{"version": 1, "step": Infinity, "world_size": 1, "files": {}}'
    )
    with pytest.raises(CorruptSnapshotError):
        read_checkpoint(ck)


def test_fixed_huge_world_size_is_refused(tmp_path: Path) -> None:
    ck = _checkpoint_dir(
        tmp_path, b'{"version": 1, "step": 1, "world_size": 1099511627776, "files": {}}'
    )
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))\n"
        "from pathlib import Path\n"
        "from ftmem.errors import CorruptSnapshotError\n"
        "from ftmem.tiers.checkpoints import read_checkpoint\n"
        "try:\n"
        f"    read_checkpoint(Path({str(ck)!r}))\n"
        "except CorruptSnapshotError:\n"
        "    sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-500:]


@pytest.mark.parametrize(
    "entry, size",
    [
        (["a", None, 0, "../../etc/passwd", 0, 1, None], [1]),
        (["a", None, 0, "/etc/passwd", 0, 1, None], [1]),
        (["a", None, 0, "__0_0.distcp", -5, -1, None], [1]),
        (["a", None, 0, "__0_0.distcp", 0, 1, None], [2**70]),
    ],
)
def test_fixed_metadata_outside_the_checkpoint_is_refused(
    entry: list[Any], size: list[int]
) -> None:
    doc = {
        "tensors": {"a": {"dtype": "float32", "size": size, "chunks": [[[0], size]]}},
        "bytes": [],
        "storage": [entry],
        "planner": {},
    }
    with pytest.raises(CorruptSnapshotError):
        metadata_from_json(doc)


def test_fixed_short_chunk_is_refused() -> None:
    doc = {
        "tensors": {"a": {"dtype": "float32", "size": [1], "chunks": [[]]}},
        "bytes": [],
        "storage": [],
        "planner": {},
    }
    with pytest.raises(CorruptSnapshotError):
        metadata_from_json(doc)


def test_a_valid_manifest_is_read(tmp_path: Path) -> None:
    """The fuzzed readers accept what ftmem itself writes (the strategies are not all noise)."""
    files = {n: {"bytes": len(b), "xxh3": "0"} for n, b in FILES.items()}
    doc = {"version": 1, "step": 3, "world_size": 2, "ranks": [1], "files": files}
    ck = read_checkpoint(_checkpoint_dir(tmp_path, json.dumps(doc).encode()))
    assert ck.step == 3 and ck.ranks == (1,) and ck.is_part and math.isclose(ck.nbytes, 15)
    assert os.path.isdir(ck.path)
