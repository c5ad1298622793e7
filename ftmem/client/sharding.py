"""Which tensors of a state are replicated over a process group, and this rank's share.

Under data parallelism the parameters of the modules in a state, and their optimizer
state, are the same on every rank of the replica group: each rank saves only its share of
those bytes (``ClientConfig.shard_replicated``) and ``load`` gathers them back over the
same group. The group is the one given, else a DDP module's; DTensors replicated along a
mesh dimension (HSDP's replicate dimension) use that dimension's group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ftmem.client import agreement
from ftmem.client.flatten import Flat, flatten_state, shard_replicated, signature_of
from ftmem.client.save_plan import storage_ptr, walk_values


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
