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

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftmem.format.layout import ChunkOf, StoredSnapshot, StoredTensor, TensorExtent, parse_layout
from ftmem.format.tensors import DTYPE_NAMES, TENSOR_MARK

__all__ = [
    "ChunkOf",
    "Flat",
    "StoredSnapshot",
    "StoredTensor",
    "TensorExtent",
    "flatten_state",
    "is_stateful",
    "parse_layout",
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


def dtensor_type() -> type | None:
    """DTensor's class, or None while ``torch.distributed.tensor`` is not imported: no tensor
    can be a DTensor then, so asking costs no (slow) import."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


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
            or meta tensor, a dtype no snapshot holds, a non-string top-level key).
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    chunks: list[ChunkOf | None] = []
    groups: list[Any] = []
    dtensor = dtensor_type()

    def walk(obj: Any, name: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if dtensor is not None and isinstance(obj, dtensor):
                local, chunk = _dtensor_chunk(obj, name)
                group = _replicate_group(obj)
            elif obj.is_sparse or obj.is_meta or obj.is_quantized or type(obj) is not torch.Tensor:
                raise ValueError(f"{name}: {type(obj).__name__} tensors are not supported yet")
            else:
                local, chunk, group = obj.detach(), None, None
            if local.dtype not in DTYPE_NAMES:
                raise ValueError(f"{name}: dtype {local.dtype} is not supported")
            tensors.append(local)
            names.append(name)
            chunks.append(chunk)
            groups.append(group)
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


def storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of a tensor's storage (a DTensor's: its local shard's)."""
    local = getattr(t, "_local_tensor", None)
    return int((local if isinstance(local, torch.Tensor) else t).untyped_storage().data_ptr())


def optimizer_storage_ptrs(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages that only the optimizers mutate: their parameters and their state tensors."""
    params = (p for opt in optimizers for group in opt.param_groups for p in group["params"])
    states = (v for opt in optimizers for st in opt.state.values() for v in st.values())
    return {storage_ptr(p) for p in params} | {
        storage_ptr(v) for v in states if isinstance(v, torch.Tensor)
    }
