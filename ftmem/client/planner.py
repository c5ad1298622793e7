"""What a save of one state copies, and when: the one door a :class:`Checkpointer` save plans
through.

:class:`CopyPlanner` reads a state for a save and owns every cache that makes the next read
cheap: the full walk (:func:`~ftmem.client.flatten.flatten_state`), this replica's share
(:class:`ReplicaSharder`), the :class:`CopyPlan` (which tensors are copied when, and their
:class:`Placement` in a slot, reused while :func:`signature_of` is the same) and the
steady-state check (:class:`~ftmem.client.steady.SteadyState`). Planning reads the tensors'
storages, never copies a byte.

**Sharding.** Under data parallelism each rank of the replica group (the one given, else a
DDP module's; for HSDP, the DTensors' replicate dimension) saves only its share of the
replicated parameters and optimizer state (:func:`split_rows`, :func:`shard_replicated`);
``load`` gathers them back (docs/design.md, "Sharded snapshots and DTensor").
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ftmem.client import agreement, pitfalls
from ftmem.client.flatten import (
    Flat,
    flatten_state,
    optimizer_storage_ptrs,
    state_dicts,
    storage_ptr,
)
from ftmem.client.steady import SteadyState
from ftmem.format.layout import ChunkOf, TensorExtent, tensors_json
from ftmem.format.tensors import (
    DTYPE_NAMES,
    GATHER_MARK,
    REPLICAS_KEY,
    TENSOR_MARK,
    encode_skeleton,
)
from ftmem.shm import ALIGN


def walk_values(obj: Any) -> list[Any]:
    """The leaves of nested mappings, lists and tuples (a state's modules, optimizers...)."""
    out = []
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            out.append(v)
    return out


def optimizers_in(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among the leaves of ``state`` (their tensors are copied lazily)."""
    return [v for v in walk_values(state) if isinstance(v, torch.optim.Optimizer)]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_layout_ids = itertools.count(1)


@dataclass(frozen=True)
class Placement:
    """Tensor placement in a slot (reused while names, dtypes and shapes stay the same)."""

    extents: tuple[TensorExtent, ...]
    tensors_end: int
    id: int = field(default_factory=lambda: next(_layout_ids), compare=False)
    """Unique in this process: a COMMIT names the layout by it once the SMP holds it."""

    @functools.cached_property
    def tensors_json(self) -> str:
        """The layout's ``tensors`` array (no checksums), made once per layout."""
        return tensors_json(self.extents)


def signature_of(
    flat: Flat,
) -> tuple[tuple[str, torch.dtype, tuple[int, ...], ChunkOf | None], ...]:
    """The layout signature of a flattened state (names, dtypes, shapes, chunks): equal
    signatures give equal layouts."""
    chunks = flat.chunks or [None] * len(flat.tensors)
    return tuple(
        (n, t.dtype, t.shape, c) for n, t, c in zip(flat.names, flat.tensors, chunks, strict=True)
    )


def plan_layout(flat: Flat) -> Placement:
    """Place every tensor of ``flat`` in a slot, largest first, each aligned to ALIGN bytes."""
    order = sorted(range(len(flat.tensors)), key=lambda i: -flat.tensors[i].nbytes)
    chunks = flat.chunks or [None] * len(flat.tensors)
    offset = 0
    extents = []
    for i in order:
        t = flat.tensors[i]
        extents.append(
            TensorExtent(
                i, flat.names[i], DTYPE_NAMES[t.dtype], tuple(t.shape), offset, t.nbytes, chunks[i]
            )
        )
        offset = _align(offset + t.nbytes)
    return Placement(tuple(sorted(extents, key=lambda e: e.index)), offset)


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
            [flat.names[j], DTYPE_NAMES[flat.tensors[j].dtype], list(flat.tensors[j].shape)]
            for j in rep
        ],
        "pieces": pieces,
    }
    return Flat(tensors, names, skeleton, chunks, groups)


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """What a save of a state of one signature does (cached while the signature and the
    tensors' storages stay the same)."""

    key: tuple[Any, ...]
    layout: Placement
    eager: list[int]
    """CPU tensors copied inside ``save`` (buffers, RNG, anything the forward may change)."""
    lazy: list[int]
    """CPU tensors only the optimizers change: copied by the worker, largest first."""
    cuda: list[int]
    """Device tensors the optimizers do not own (buffers...): copied first by a side stream,
    which the current stream then waits for (on the device)."""
    cuda_lazy: list[int]
    """Device tensors only the optimizers change: copied next by the side stream, fenced by
    the optimizer pre-hook."""

    def fits(self, sig: Any, tensors: list[torch.Tensor]) -> bool:
        """True if this plan serves a state of signature ``sig`` whose lazily copied
        tensors are still the same storages."""
        return self.key[0] == sig and all(
            tensors[i].data_ptr() == p
            for i, p in zip(self.lazy + self.cuda_lazy, self.key[1], strict=True)
        )


def plan_save(
    flat: Flat, previous: CopyPlan | None, optimizers: list[torch.optim.Optimizer]
) -> CopyPlan:
    """The plan of a save of ``flat`` (``previous`` if it still fits).

    Reused while the state's signature is the same and the tensors it copies lazily are
    still the same storages (other tensors, e.g. a fresh RNG state each save, may be new
    objects every time: they are copied eagerly wherever they live). ``optimizers``: those
    in the state; their parameters and state tensors are copied lazily.
    """
    sig = signature_of(flat)
    tensors = flat.tensors
    if previous is not None and previous.fits(sig, tensors):
        return previous
    same = previous is not None and previous.key[0] == sig
    layout = previous.layout if previous is not None and same else plan_layout(flat)
    lazy_ptrs = optimizer_storage_ptrs(optimizers)
    eager: list[int] = []
    lazy: list[int] = []
    cuda: list[int] = []
    cuda_lazy: list[int] = []
    for i, t in enumerate(tensors):
        owned = bool(lazy_ptrs) and t.untyped_storage().data_ptr() in lazy_ptrs
        if t.device.type != "cpu":
            (cuda_lazy if owned else cuda).append(i)
        elif owned:
            lazy.append(i)
        else:  # buffers, RNG, anything the forward pass or the user may change
            eager.append(i)
    lazy.sort(key=lambda i: -tensors[i].nbytes)
    key = (sig, tuple(tensors[i].data_ptr() for i in lazy + cuda_lazy))
    return CopyPlan(key, layout, eager, lazy, cuda, cuda_lazy)


@dataclass(frozen=True, slots=True)
class ReadState:
    """What :meth:`CopyPlanner.read_state` found: the save's tensors and how to copy them."""

    flat: Flat
    """This save's tensors (this replica's share) and the skeleton around them."""
    plan: CopyPlan
    objects: bytes
    """The encoded skeleton (everything in the state that is not a tensor)."""
    unsharded: int
    """Bytes of the whole state's tensors when only a share is saved (0: not sharded)."""


class CopyPlanner:
    """Reads a state for a save, save after save, and keeps what the next read reuses.

    ``shard``: each replica keeps only its share of the replicated tensors (data
    parallelism; ``ClientConfig.shard_replicated``)."""

    def __init__(self, shard: bool) -> None:
        self._shard = shard
        self._plan: CopyPlan | None = None
        self._steady: SteadyState | None = None
        """What the last full read found (the next reads check only that)."""
        self._unsharded = 0
        self._sharder = ReplicaSharder()
        self._checked = False
        """The pitfalls (:mod:`ftmem.client.pitfalls`) were looked for at the first read."""

    def forget_group(self) -> None:
        """The process group is gone (in-process rejoin): drop what was tied to it."""
        self._sharder = ReplicaSharder()
        self._steady = None

    def read_state(
        self,
        state: Mapping[str, Any],
        optimizers: list[torch.optim.Optimizer],
        replicated_over: Any,
    ) -> ReadState:
        """Read ``state`` for a save. While the state keeps the structure of the last full
        read, only what may change is read again (:class:`~ftmem.client.steady.SteadyState`);
        otherwise it is walked, sharded, planned and encoded in full. ``optimizers``: those in
        the state (their tensors are copied lazily). The first read also warns of the loop's
        pitfalls that would make a resume inexact (:mod:`ftmem.client.pitfalls`)."""
        if not self._checked:  # once: the DDP check walks the garbage collector's referrers
            self._checked = True
            pitfalls.check_optimizer(bool(optimizers))
            pitfalls.check_ddp(state, agreement.current_world_size())
            pitfalls.check_loaders(state)
        sds = state_dicts(state)
        if self._steady is not None and self._plan is not None:
            got = self._steady.refresh(state, sds, optimizers, replicated_over)
            if got is not None:
                return ReadState(got[0], self._plan, got[1], self._unsharded)
        whole = flatten_state(state, sds)
        flat = whole
        if self._shard and agreement.distributed():
            flat = self._sharder.shard(state, whole, replicated_over)
        self._plan = plan_save(flat, self._plan, optimizers)
        self._unsharded = sum(t.nbytes for t in whole.tensors) if flat is not whole else 0
        self._steady = SteadyState.build(state, sds, whole, flat, optimizers, replicated_over)
        return ReadState(flat, self._plan, encode_skeleton(flat.skeleton), self._unsharded)
