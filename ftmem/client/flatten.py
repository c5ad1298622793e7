"""State dict <-> (tensors, skeleton, layout) as pure functions.

A *state* follows torch.distributed.checkpoint's conventions: a dict whose values are
tensors, nested dicts/lists/tuples, plain Python values, or ``Stateful`` objects (with
``state_dict()`` and ``load_state_dict()``). Flattening yields the tensors (with a name
each) and a *skeleton*: the same structure with every tensor replaced by a marker. The
skeleton is stored with the torch-free codec of :mod:`ftmem.format.skeleton` (tagged JSON:
nothing in a snapshot is ever unpickled); ``torch.Size`` and ``torch.dtype`` values travel as
its extension types. The layout schema and its validator live in :mod:`ftmem.format.layout`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftmem.format.layout import (
    ChunkOf,
    StoredSnapshot,
    StoredTensor,
    TensorExtent,
    parse_layout,
    tensors_json,
)
from ftmem.format.tensors import (
    GATHER_MARK,
    REPLICAS_KEY,
    TENSOR_MARK,
    dtype_name,
)
from ftmem.shm import ALIGN

__all__ = [
    "ChunkOf",
    "Flat",
    "Layout",
    "StoredSnapshot",
    "StoredTensor",
    "TensorExtent",
    "flatten_state",
    "is_stateful",
    "parse_layout",
    "plan_layout",
    "shard_replicated",
    "signature_of",
    "split_rows",
    "state_dicts",
]

_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype)


def is_stateful(obj: Any) -> bool:
    """True if ``obj`` follows the Stateful protocol (state_dict and load_state_dict)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass(frozen=True, slots=True)
class Flat:
    """A flattened state: tensors in discovery order, their names, and the skeleton."""

    tensors: list[torch.Tensor]
    names: list[str]
    skeleton: dict[str, Any]
    chunks: list[ChunkOf | None] = field(default_factory=list)
    """Per tensor: the global tensor it is a chunk of (None: a whole tensor)."""
    replica_groups: list[Any] = field(default_factory=list)
    """Per tensor: for a DTensor replicated along a mesh dimension (HSDP), that dimension's
    process group (its local shard is the same on every rank of it), else None."""


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


def _replicate_group(obj: Any) -> Any:
    """The process group of the first mesh dimension a DTensor is replicated along (None)."""
    from torch.distributed.tensor import Replicate

    for dim, placement in enumerate(obj.placements):
        if isinstance(placement, Replicate) and obj.device_mesh.size(dim) > 1:
            return obj.device_mesh.get_group(dim)
    return None


def _dtensor_chunk(obj: Any, name: str) -> tuple[torch.Tensor, ChunkOf]:
    """A DTensor's local shard and where it sits in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = obj._local_tensor.detach()
    shape, offset = compute_local_shape_and_global_offset(
        obj.shape, obj.device_mesh, obj.placements
    )
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"{name}: DTensor local shard {tuple(local.shape)} is not {shape}")
    return local, ChunkOf(tuple(int(s) for s in obj.shape), tuple(int(o) for o in offset))


def state_dicts(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Each top-level entry of ``state`` as a save reads it: a Stateful's ``state_dict()``,
    anything else as it is."""
    return [
        (k, v.state_dict() if is_stateful(v) and not isinstance(v, torch.Tensor) else v)
        for k, v in state.items()
    ]


def flatten_state(state: Mapping[str, Any], sds: list[tuple[str, Any]] | None = None) -> Flat:
    """Flatten ``state`` (calling ``state_dict()`` on Stateful values; ``sds``: what those
    calls returned already, in the state's order).

    Raises:
        ValueError: a value that cannot be snapshotted (e.g. an arbitrary object, a sparse
            or meta tensor, a non-string top-level key).
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    chunks: list[ChunkOf | None] = []
    groups: list[Any] = []
    dtensor = _dtensor_type()

    def walk(obj: Any, name: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if dtensor is not None and isinstance(obj, dtensor):
                local, chunk = _dtensor_chunk(obj, name)
                tensors.append(local)
                names.append(name)
                chunks.append(chunk)
                groups.append(_replicate_group(obj))
                return (TENSOR_MARK, len(tensors) - 1)
            if obj.is_sparse or obj.is_meta or obj.is_quantized or type(obj) is not torch.Tensor:
                raise ValueError(f"{name}: {type(obj).__name__} tensors are not supported yet")
            tensors.append(obj.detach())
            names.append(name)
            chunks.append(None)
            groups.append(None)
            return (TENSOR_MARK, len(tensors) - 1)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, (str, int)):
                    raise ValueError(f"{name}: key {k!r} must be str or int")
                out[k] = walk(v, f"{name}.{k}")
            return out
        if isinstance(obj, list):
            return [walk(v, f"{name}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(walk(v, f"{name}.{i}") for i, v in enumerate(obj))
        if isinstance(obj, _PLAIN):
            return obj
        raise ValueError(
            f"{name}: cannot snapshot a {type(obj).__name__}; use tensors, plain Python "
            "values, or an object with state_dict()/load_state_dict()"
        )

    skeleton: dict[str, Any] = {}
    for key, sd in state_dicts(state) if sds is None else sds:
        if not isinstance(key, str):
            raise ValueError(f"top-level key {key!r} must be a string")
        skeleton[key] = walk(sd, key)
    return Flat(tensors, names, skeleton, chunks, groups)


def split_rows(items: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int, int]]]:
    """Spread ``items`` ((rows, bytes per row) each, in order) over ``parts`` owners, balanced
    by bytes, each owner getting a contiguous run; a tensor is split between rows only.
    Returns per owner its ``(item, first row, end row)`` pieces. Deterministic: every replica
    computes the same split."""
    total = sum(r * b for r, b in items)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    k, acc = 0, 0
    for i, (rows, row_bytes) in enumerate(items):
        r = 0
        while r < rows:
            target = total * (k + 1) // parts
            if k < parts - 1 and acc >= target:
                k += 1
                continue
            if k == parts - 1 or row_bytes == 0:
                take = rows - r
            else:
                take = min(rows - r, max(1, -(-(target - acc) // row_bytes)))
            out[k].append((i, r, r + take))
            acc += take * row_bytes
            r += take
    return out


@functools.lru_cache(maxsize=16)
def _cached_split(
    items: tuple[tuple[int, int], ...], parts: int
) -> list[list[tuple[int, int, int]]]:
    """:func:`split_rows`, cached: every save of an unchanged state splits the same way."""
    return split_rows(list(items), parts)


def shard_replicated(flat: Flat, replicated: list[int], size: int, index: int) -> Flat:
    """Keep only this replica's share of the tensors ``replicated`` (indices into ``flat``,
    equal on all ``size`` replicas of a group in which this one is ``index``).

    The replicated tensors (in index order) are split by rows over the replicas
    (:func:`split_rows`); this replica stores its rows as chunks (``ChunkOf``), named like the
    whole tensor; the skeleton marks each replicated tensor with ``GATHER_MARK`` and records
    under ``REPLICAS_KEY`` the whole split, so that a restore can gather the rows back from
    every replica (:func:`ftmem.client.restore.gather_replicated`).
    """
    rep = sorted(set(replicated))
    pos = {j: n for n, j in enumerate(rep)}
    items = []
    for j in rep:
        t = flat.tensors[j]
        rows = t.shape[0] if t.dim() > 0 else 1
        items.append((rows, t.nbytes // rows if rows else 0))
    split = _cached_split(tuple(items), size)
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    chunks: list[ChunkOf | None] = []
    new_index: dict[int, int] = {}
    groups: list[Any] = []
    for j, t in enumerate(flat.tensors):
        if j not in pos:
            new_index[j] = len(tensors)
            tensors.append(t)
            names.append(flat.names[j])
            chunks.append(flat.chunks[j] if flat.chunks else None)
            groups.append(None)
    pieces: list[list[int]] = []
    for owner, run in enumerate(split):
        for i, a, b in run:
            stored = -1
            if owner == index:
                t = flat.tensors[rep[i]]
                stored = len(tensors)
                tensors.append(t[a:b] if t.dim() > 0 else t)
                names.append(flat.names[rep[i]])
                # A DTensor's local shard sits at its own offsets in the global tensor.
                whole = (flat.chunks[rep[i]] if flat.chunks else None) or ChunkOf(
                    tuple(t.shape), (0,) * t.dim()
                )
                start = (whole.offset[0] + a, *whole.offset[1:]) if t.dim() else ()
                chunks.append(ChunkOf(whole.shape, start))
                groups.append(None)
            pieces.append([i, a, b, owner, stored])

    def mark(skel: Any) -> Any:
        if isinstance(skel, tuple) and len(skel) == 2 and skel[0] == TENSOR_MARK:
            j = int(skel[1])
            return (GATHER_MARK, pos[j]) if j in pos else (TENSOR_MARK, new_index[j])
        if isinstance(skel, dict):
            return {k: mark(v) for k, v in skel.items()}
        if isinstance(skel, list):
            return [mark(v) for v in skel]
        if isinstance(skel, tuple):
            return tuple(mark(v) for v in skel)
        return skel

    skeleton = mark(flat.skeleton)
    skeleton[REPLICAS_KEY] = {
        "size": size,
        "index": index,
        "tensors": [
            [flat.names[j], dtype_name(flat.tensors[j].dtype), list(flat.tensors[j].shape)]
            for j in rep
        ],
        "pieces": pieces,
    }
    return Flat(tensors, names, skeleton, chunks, groups)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_layout_ids = itertools.count(1)


@dataclass(frozen=True)
class Layout:
    """Tensor placement in a slot (reused while names, dtypes and shapes stay the same)."""

    extents: tuple[TensorExtent, ...]
    tensors_end: int
    id: int = field(default_factory=lambda: next(_layout_ids), compare=False)
    """Unique in this process: a COMMIT names the layout by it once the SMP holds it."""

    @functools.cached_property
    def tensors_json(self) -> str:
        """The layout's ``tensors`` array (no checksums), made once per layout."""
        return tensors_json(self.extents)

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...], ChunkOf | None], ...]:
        """What must stay equal for the layout to be reused."""
        return tuple((e.name, e.dtype, e.shape, e.chunk) for e in self.extents)


def signature_of(
    flat: Flat,
) -> tuple[tuple[str, torch.dtype, tuple[int, ...], ChunkOf | None], ...]:
    """The layout signature of a flattened state (names, dtypes, shapes, chunks): equal
    signatures give equal layouts."""
    chunks = flat.chunks or [None] * len(flat.tensors)
    return tuple(
        (n, t.dtype, t.shape, c) for n, t, c in zip(flat.names, flat.tensors, chunks, strict=True)
    )


def plan_layout(flat: Flat) -> Layout:
    """Place every tensor of ``flat`` in a slot, largest first, each aligned to ALIGN bytes."""
    order = sorted(range(len(flat.tensors)), key=lambda i: -flat.tensors[i].nbytes)
    chunks = flat.chunks or [None] * len(flat.tensors)
    offset = 0
    extents = []
    for i in order:
        t = flat.tensors[i]
        extents.append(
            TensorExtent(
                i, flat.names[i], dtype_name(t.dtype), tuple(t.shape), offset, t.nbytes, chunks[i]
            )
        )
        offset = _align(offset + t.nbytes)
    return Layout(tuple(sorted(extents, key=lambda e: e.index)), offset)
