"""Splitting replicated tensors over replicas (pure): balanced by bytes, contiguous, complete,
the same on every replica; the layout keeps chunk descriptors and checks them."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from ftmem.client.flatten import flatten_state, parse_layout
from ftmem.client.planner import plan_layout, shard_replicated, split_rows
from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import layout_json, with_hashes
from ftmem.format.tensors import GATHER_MARK, REPLICAS_KEY


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_rows_covers_every_row_once_balanced(parts: int) -> None:
    items = [(100, 64), (1, 4), (0, 0), (33, 1024), (5, 8), (1, 8)]
    split = split_rows(items, parts)
    covered: dict[int, list[tuple[int, int]]] = {}
    for run in split:
        for i, a, b in run:
            covered.setdefault(i, []).append((a, b))
    for i, (rows, _) in enumerate(items):
        spans = sorted(covered.get(i, []))
        assert sum(b - a for a, b in spans) == rows
        assert all(s[1] == t[0] for s, t in itertools.pairwise(spans))
    total = sum(r * b for r, b in items)
    shares = [sum((b - a) * items[i][1] for i, a, b in run) for run in split]
    assert sum(shares) == total
    assert max(shares) - total / parts <= max(b for _, b in items)  # off by < one row
    assert split_rows(items, parts) == split  # deterministic


def test_shard_replicated_keeps_this_replicas_rows_as_chunks() -> None:
    torch.manual_seed(0)
    w = torch.randn(10, 4)
    state = {"m": {"w": w, "b": torch.randn(3)}, "rng": torch.arange(5)}
    flat = flatten_state(state)
    got = []
    for index in range(3):
        sh = shard_replicated(flat, [0, 1], 3, index)
        table = sh.skeleton[REPLICAS_KEY]
        assert table["size"] == 3 and table["index"] == index
        assert sh.skeleton["m"]["w"] == (GATHER_MARK, 0)
        assert sh.names[0] == "rng"  # per-rank state stays whole, first
        for t, name, chunk in zip(sh.tensors[1:], sh.names[1:], sh.chunks[1:], strict=True):
            assert chunk is not None
            whole = w if name == "m.w" else state["m"]["b"]
            assert chunk.shape == tuple(whole.shape)
            a = chunk.offset[0]
            assert torch.equal(t, whole[a : a + t.shape[0]])
            got.append((name, a, t.shape[0]))
    rows = {"m.w": 10, "m.b": 3}
    for name, n in rows.items():
        assert sum(k for nm, _, k in got if nm == name) == n


def test_layout_round_trips_chunks_and_rejects_bad_ones() -> None:
    flat = shard_replicated(flatten_state({"w": torch.zeros(8, 2)}), [0], 2, 1)
    lay = plan_layout(flat)
    text = with_hashes(
        layout_json(lay.tensors_json, 5, (lay.tensors_end, 1)),
        ["0" * 16] * len(lay.extents),
        "1" * 16,
    )
    snap = parse_layout(text, 1 << 20)
    assert snap.tensors[0].chunk is not None
    assert snap.tensors[0].chunk.shape == (8, 2) and snap.tensors[0].chunk.offset == (4, 0)
    doc = json.loads(text)
    doc["tensors"][0]["chunk"]["offset"] = [7, 0]  # 4 rows from row 7 of 8: outside
    with pytest.raises(CorruptSnapshotError, match="outside"):
        parse_layout(json.dumps(doc), 1 << 20)
