"""The torch-free format layer: skeleton codec, layout validator, commit records; and the
SMP's modules never import torch."""

from __future__ import annotations

import json
import math

import pytest

from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import (
    TensorExtent,
    layout_json,
    parse_layout,
    register_layout,
    tensors_json,
    with_hashes,
)
from ftmem.format.record import (
    RECORD_VERSION,
    CommitRecord,
    decode_record,
    encode_record,
    record_text,
)
from ftmem.format.skeleton import decode_skeleton, encode_skeleton


def test_skeleton_round_trips_every_plain_value() -> None:
    sk = {
        "a": {0: [1, 2.5, (3, "x")], 7: None},
        "b": b"\x00\xff",
        "c": 1 - 2j,
        "flags": [True, False],
        "big": 1 << 80,
        "tiny": 5e-324,
        "nested": {"t": ("__ftmem_tensor__", 3)},
    }
    back = decode_skeleton(encode_skeleton(sk))
    assert back == sk
    assert list(back["a"]) == [0, 7] and isinstance(back["a"][0][2], tuple)
    special = decode_skeleton(encode_skeleton({"n": math.nan, "i": -math.inf}))
    assert math.isnan(special["n"]) and special["i"] == -math.inf


def test_skeleton_refuses_unknown_values_and_bad_bytes() -> None:
    with pytest.raises(ValueError, match="cannot encode"):
        encode_skeleton({"x": object()})
    with pytest.raises(ValueError, match="key"):
        encode_skeleton({"x": {(1, 2): 3}})
    for bad in (
        b"\x80\x04K\x01.",  # a pickle
        b'{"d":[["a",{"z":1}]]}',  # unknown tag
        b'{"d":[["a",NaN]]}',  # a JSON constant
        b'{"x":["size",[1]]}',  # an extension nobody registered
        b"[1, 2]",  # not a dict
        b'{"d":' * 5000 + b"1" + b"}" * 5000,  # too deep
    ):
        with pytest.raises(CorruptSnapshotError):
            decode_skeleton(bad)


def _layout() -> tuple[str, int]:
    extents = [
        TensorExtent(0, "w", "float32", (4, 4), 0, 64),
        TensorExtent(1, "b", "bfloat16", (3,), 64, 6),
    ]
    return layout_json(tensors_json(extents), 9, (128, 20)), 148


def test_layout_parses_verifies_and_refuses_bad_extents() -> None:
    text, cap = _layout()
    snap = parse_layout(text, cap)
    assert not snap.verified and snap.used_bytes == 148 and snap.step == 9
    done = parse_layout(with_hashes(text, ["a" * 16, "b" * 16], "c" * 16), cap)
    assert done.verified and done.tensors[1].hash == "b" * 16
    # The SMP's registered form renders the same documents without parsing them again.
    one = tensors_json([TensorExtent(0, "w", "float32", (4, 4), 0, 64)])
    reg = register_layout(one, cap)
    snap = reg.snapshot(9, (128, 20), 0, cap)
    assert reg.render_unverified(snap) == layout_json(one, 9, (128, 20))
    assert reg.render_unverified(snap) == reg.render(snap, ["", ""])
    filled = with_hashes(reg.render_unverified(snap), ["a" * 16], "c" * 16)
    assert json.loads(reg.render(snap, ["c" * 16, "a" * 16])) == json.loads(filled)
    doc = json.loads(text)
    for field, value in (("offset", -1), ("offset", 1 << 70), ("nbytes", 65), ("dtype", "obj")):
        bad = json.loads(text)
        bad["tensors"][0][field] = value
        with pytest.raises(CorruptSnapshotError):
            parse_layout(json.dumps(bad), cap)
    with pytest.raises(CorruptSnapshotError):
        parse_layout(text, cap - 1)  # objects outside the slot
    with pytest.raises(CorruptSnapshotError):
        parse_layout(text.replace('"step":9', '"step":Infinity'), cap)
    doc["version"] = 1
    with pytest.raises(CorruptSnapshotError, match="version"):
        parse_layout(json.dumps(doc), cap)
    with pytest.raises(CorruptSnapshotError):
        with_hashes(text, ["only one"], "x")


def test_commit_record_round_trip_and_tamper() -> None:
    rec = CommitRecord(rank=1, slot=0, gen=3, capacity=4096, step=12, seq=5, layout="{}")
    text = encode_record(rec)
    assert decode_record(text) == rec
    fields = {"version": RECORD_VERSION, "rank": 1, "slot": 0, "gen": 3, "capacity": 4096}
    assert text == record_text({**fields, "step": 12, "seq": 5, "layout": "{}"})
    with pytest.raises(ValueError, match="checksum"):
        decode_record(text.replace('"step":12', '"step":13'))
    with pytest.raises(ValueError, match="malformed"):
        decode_record(text.replace("\n", " "))
    # the layout is kept as it was written, byte for byte
    rec = CommitRecord(rank=1, slot=0, gen=3, capacity=4096, step=12, seq=5, layout='{"a":"\\n"}')
    assert decode_record(encode_record(rec)) == rec
