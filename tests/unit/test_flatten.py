"""Flattening states, layouts and skeletons (pure functions)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from ftmem.client.flatten import flatten_state, parse_layout
from ftmem.client.planner import plan_layout
from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import layout_json, with_hashes
from ftmem.format.tensors import decode_skeleton, encode_skeleton


def test_flatten_stateful_and_nested() -> None:
    model = torch.nn.Linear(3, 2)
    state = {
        "model": model,
        "extra": {"step": 4, "t": torch.ones(2), "l": [1, (2, torch.zeros(1))]},
    }
    flat = flatten_state(state)
    assert flat.names == ["model.weight", "model.bias", "extra.t", "extra.l.1.1"]
    sk = decode_skeleton(encode_skeleton(flat.skeleton))
    assert sk["extra"]["step"] == 4
    assert sk["extra"]["l"][1][1] == ("__ftmem_tensor__", 3)


def test_arbitrary_objects_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot snapshot"):
        flatten_state({"x": object()})


def test_a_dtype_no_snapshot_holds_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"m\.w: dtype torch\.float8_e4m3fnuz is not supported"):
        flatten_state({"m": {"w": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}})


def test_layout_is_aligned_and_largest_first() -> None:
    flat = flatten_state(
        {"a": torch.zeros(3), "b": torch.zeros(1000), "c": torch.zeros(5, dtype=torch.int8)}
    )
    lay = plan_layout(flat)
    by_name = {e.name: e for e in lay.extents}
    assert by_name["b"].offset == 0
    assert all(e.offset % 64 == 0 for e in lay.extents)
    assert lay.tensors_end >= sum(e.nbytes for e in lay.extents)


def test_layout_round_trip_and_bounds() -> None:
    flat = flatten_state({"a": torch.zeros(4, 4), "b": torch.zeros(2, dtype=torch.bfloat16)})
    lay = plan_layout(flat)
    committed = layout_json(lay.tensors_json, 7, (lay.tensors_end, 10))
    assert not parse_layout(committed, lay.tensors_end + 10).verified  # the SMP hashes it
    text = with_hashes(committed, ["0" * 16, "1" * 16], "2" * 16)
    snap = parse_layout(text, lay.tensors_end + 10)
    assert snap.step == 7 and snap.tensors[1].dtype == "bfloat16" and snap.verified
    with pytest.raises(CorruptSnapshotError):
        parse_layout(text, lay.tensors_end)  # objects out of bounds
    doc = json.loads(text)
    doc["tensors"][0]["nbytes"] += 1
    with pytest.raises(CorruptSnapshotError):
        parse_layout(json.dumps(doc), 1 << 20)
    doc["tensors"][0]["dtype"] = "object"
    with pytest.raises(CorruptSnapshotError):
        parse_layout(json.dumps(doc), 1 << 20)
    with pytest.raises(CorruptSnapshotError):
        parse_layout("{", 100)


def test_skeleton_refuses_pickled_objects() -> None:
    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    with pytest.raises(CorruptSnapshotError):
        decode_skeleton(buf.getvalue())
