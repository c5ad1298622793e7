"""Which tensors of a state are replicated over a process group, and this rank's share.

Under data parallelism the parameters of the modules in a state, and their optimizer
state, are the same on every rank of the replica group: each rank saves only its share of
those bytes (``ClientConfig.shard_replicated``) and ``load`` gathers them back over the
same group. The group is the one given, else a DDP module's; DTensors replicated along a
mesh dimension (HSDP's replicate dimension) use that dimension's group. The split itself:
:func:`split_rows` (which rows each replica keeps) and :func:`shard_replicated` (a flat state
cut down to this replica's rows).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ftmem.client import agreement
from ftmem.client.flatten import Flat, flatten_state, signature_of, storage_ptr, walk_values
from ftmem.format.layout import ChunkOf
from ftmem.format.tensors import GATHER_MARK, REPLICAS_KEY, TENSOR_MARK, dtype_name


def replica_group(state: Mapping[str, Any], given: Any) -> Any:
    """The group the state is replicated over (None: not replicated / not distributed)."""
    if not agreement.distributed():
        return None
    if given is not None:
        return given
    from torch.nn.parallel import DistributedDataParallel

    for v in walk_values(state):
        if isinstance(v, DistributedDataParallel):
            return v.process_group
    return None


def gather_group(state: Mapping[str, Any], given: Any) -> Any:
    """The group a load gathers the replicated tensors over (None: none): the replica
    group, else (HSDP) the group of the first DTensor replicated along a mesh dimension."""
    group = replica_group(state, given)
    if group is None and agreement.distributed():
        groups = flatten_state(state).replica_groups
        group = next((g for g in groups if g is not None), None)
    return group


class ReplicaSharder:
    """Keeps this replica's share of a state's replicated tensors, save after save.

    Which tensors are replicated is cached while the state's signature, the group and
    those tensors' storages stay the same (other tensors, e.g. a fresh RNG state each
    save, may be new objects).
    """

    def __init__(self) -> None:
        self._cached: tuple[Any, list[int], list[tuple[int, int]]] | None = None
        """(signature and group, the replicated tensors' indices, their data pointers)."""

    def shard(self, state: Mapping[str, Any], flat: Flat, given: Any) -> Flat:
        """``flat`` with only this rank's share of the tensors replicated over the group
        (``given``, else found in ``state``); ``flat`` itself when nothing is replicated."""
        group = replica_group(state, given)
        if group is None:
            return _shard_hsdp(flat)
        size = torch.distributed.get_world_size(group)
        if size < 2:
            return flat
        replicated = self._replicated(state, flat, group)
        if not replicated:
            return flat
        return shard_replicated(flat, replicated, size, torch.distributed.get_rank(group))

    def _replicated(self, state: Mapping[str, Any], flat: Flat, group: Any) -> list[int]:
        """Indices of the whole tensors of ``flat`` replicated under data parallelism."""
        sig = signature_of(flat)
        cached = self._cached
        if (
            cached is not None
            and cached[0] == (sig, id(group))
            and all(flat.tensors[i].data_ptr() == p for i, p in cached[2])
        ):
            return cached[1]
        ptrs = replicated_storage_ptrs(state)
        chunks = flat.chunks or [None] * len(flat.tensors)
        found = [
            i
            for i, t in enumerate(flat.tensors)
            if chunks[i] is None and t.untyped_storage().data_ptr() in ptrs
        ]
        self._cached = ((sig, id(group)), found, [(i, flat.tensors[i].data_ptr()) for i in found])
        return found


def _shard_hsdp(flat: Flat) -> Flat:
    """DTensors replicated along a mesh dimension (HSDP's replicate dimension): each
    replica of that dimension keeps 1/R of their local shards."""
    groups = flat.replica_groups or [None] * len(flat.tensors)
    group = next((g for g in groups if g is not None), None)
    if group is None:
        return flat
    size = torch.distributed.get_world_size(group)
    replicated = [i for i, g in enumerate(groups) if g is group]
    return shard_replicated(flat, replicated, size, torch.distributed.get_rank(group))


def replicated_storage_ptrs(state: Mapping[str, Any]) -> set[int]:
    """Storages replicated under data parallelism: the (plain) parameters of the modules in
    ``state`` and the optimizer state of those parameters. Buffers (BatchNorm statistics...)
    are per rank: each rank's forward updates its own."""
    values = walk_values(state)
    params: dict[int, torch.Tensor] = {}
    for mod in (v for v in values if isinstance(v, torch.nn.Module)):
        for p in mod.parameters():
            if type(p) in (torch.Tensor, torch.nn.Parameter):
                params[id(p)] = p
    ptrs = {storage_ptr(p) for p in params.values()}
    for opt in (v for v in values if isinstance(v, torch.optim.Optimizer)):
        for param, st in opt.state.items():
            if id(param) in params:
                ptrs.update(storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


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
