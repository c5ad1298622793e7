"""Restore a step saved at another world size: DCP reshards it from the SMPs' memory.

When the job's size changed, rank ``r`` of the new world is not rank ``r`` of the old one.
:func:`load_resharded` loads the step as ``dcp.load`` loads a flushed checkpoint at another
world size, but from memory (:class:`~ftmem.tiers.memory_dcp.MemoryCheckpoint`):

1. the ranks exchange what their host's SMPs hold and take the newest step of which every
   old rank is held somewhere;
2. every old rank's skeleton is read first: a top-level entry whose value differed between
   the old ranks (a data position, RNG states) is resharded by its object's
   ``load_resharded_state(states, rank, world_size)``; an object without it is refused
   (:class:`~ftmem.errors.SnapshotMismatchError`) before anything is changed;
3. ``dcp.load`` fills the rest of the state, as from the flushed checkpoint of that step;
   entries equal on every old rank take old rank 0's value.

A collective of every rank of the job, over a gloo group.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ftmem._logging import get_logger
from ftmem.client.flatten import is_stateful
from ftmem.errors import SmpUnavailableError, SnapshotMismatchError
from ftmem.format.tensors import GATHER_MARK, REPLICAS_KEY, TENSOR_MARK, decode_skeleton

log = get_logger(__name__)

RESHARD_METHOD = "load_resharded_state"
"""The method of a Stateful whose value differs between ranks and that can take a new world
size: ``obj.load_resharded_state(states, rank=..., world_size=...)``."""


def _inventory(run_dirs: Sequence[Path], world: int) -> dict[int, dict[int, Any]]:
    """rank -> step -> SnapshotInfo of the old ranks (< ``world``) the SMPs of ``run_dirs``
    hold (a run directory without a live SMP is skipped, with a warning)."""
    from ftmem.protocol.smp_client import SmpClient

    out: dict[int, dict[int, Any]] = {}
    for run_dir in run_dirs:
        try:
            with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:
                for rank in sorted(c.status().ranks):
                    if 0 <= rank < world:
                        out.setdefault(rank, {}).update({s.step: s for s in c.query(rank)})
        except (SmpUnavailableError, OSError) as exc:
            log.warning("resharding: no snapshots from %s: %s", run_dir, exc)
    return out


def _pick_step(gathered: list[Any], world: int, want: int | None) -> int:
    """The newest step (or ``want``) of which every old rank is held by some process."""
    holders: dict[int, set[int]] = {}
    for inv in gathered:
        for rank, steps in dict(inv).items():
            for s in steps:
                holders.setdefault(int(s), set()).add(int(rank))
    full = sorted((s for s, r in holders.items() if r >= set(range(world))), reverse=True)
    if want is not None:
        if want not in full:
            have = sorted(holders.get(want, set()))
            raise SnapshotMismatchError(
                f"cannot reshard step {want} from memory: of its {world} ranks only {have} "
                "are held by the SMPs of this job"
            )
        return want
    if not full:
        newest = max(holders, default=None)
        have = sorted(holders.get(newest, set())) if newest is not None else []
        raise SnapshotMismatchError(
            f"cannot reshard from memory: no step of the {world}-rank job is held for every "
            f"rank (the newest, {newest}, for ranks {have}); restore from a flushed checkpoint "
            "with dcp.load instead"
        )
    return full[0]


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (zero gradients, one step at lr 0) so that
    ``dcp.load`` has tensors to fill, as DCP's ``get_optimizer_state_dict`` does; the
    parameters do not change (weight decay is scaled by the learning rate too)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(opt.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    grads = [p.grad for p in params]
    try:
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def _named(tree: Any, names: list[str]) -> Any:
    """A skeleton with its tensor marks replaced by the tensors' names (comparable between
    ranks, whose tensor indices differ)."""
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == TENSOR_MARK:
        i = tree[1]
        return ("tensor", names[i] if type(i) is int and 0 <= i < len(names) else i)
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == GATHER_MARK:
        return ("gathered", tree[1])
    if isinstance(tree, dict):
        return {k: _named(v, names) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_named(v, names) for v in tree)
    return tree


def _fill(tree: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """A named skeleton (:func:`_named`) with its tensors put back (``tensor``: by name)."""
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "tensor":
        return tensor(str(tree[1]))
    if isinstance(tree, dict):
        return {k: _fill(v, tensor) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_fill(v, tensor) for v in tree)
    return tree


def _empty(meta: Any, key: str) -> torch.Tensor:
    """A tensor to load DCP entry ``key`` into (its size and dtype from the metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = meta.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        raise SnapshotMismatchError(f"the step in memory has no tensor {key!r}")
    return torch.empty(md.size, dtype=md.properties.dtype)


def load_resharded(
    state: MutableMapping[str, Any],
    *,
    world_size: int,
    run_dirs: Sequence[Path],
    step: int | None = None,
    flush_dirs: Sequence[Path] = (),
) -> int:
    """Load the step saved by a job of ``world_size`` ranks into ``state`` at this job's world
    size, from the SMPs' memory (see the module docstring); return the step.

    ``run_dirs``: the SMP run directories on this host (the rank's own first). ``step``: the
    step to load (None: the newest one held for every old rank; where ranks ask for
    different ones, the newest asked for). Every rank of the default process group calls
    this together. When memory does not hold a step for every old rank (more machines lost
    than the erasure code covers), the newest whole checkpoint of the old size in
    ``flush_dirs`` (nearest first) is resharded instead, after its files pass their checksums.

    Raises:
        SnapshotMismatchError: no step is held for every old rank (nor flushed), the state
            does not fit the step, or an entry differs between the old ranks and its object
            cannot be resharded (nothing in ``state`` was changed then).
        CorruptSnapshotError: a slot or a flushed file fails its checksums.
    """
    from ftmem.tiers.export import RankSource
    from ftmem.tiers.memory_dcp import MemoryCheckpoint, all_gather_json

    if not (dist.is_available() and dist.is_initialized()):
        raise SnapshotMismatchError("resharding a step needs torch.distributed initialised")
    group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    world = dist.get_world_size()
    held = _inventory(run_dirs, world_size)
    gathered = all_gather_json(
        {"held": {str(r): sorted(v) for r, v in held.items()}, "want": step}, group
    )
    asked = [int(d["want"]) for d in gathered if d.get("want") is not None]
    try:
        chosen = _pick_step([d["held"] for d in gathered], world_size, max(asked, default=None))
    except SnapshotMismatchError as exc:  # the same verdict on every rank (the same inputs)
        return _load_flushed(state, world_size, flush_dirs, group, exc)
    sources = [
        RankSource(r, chosen, s.path, s.capacity, s.layout)
        for r, steps in sorted(held.items())
        if (s := steps.get(chosen)) is not None
    ]
    log.info(
        "resharding step %d of a %d-rank job to %d ranks from memory (%d of its ranks here)",
        chosen,
        world_size,
        world,
        len(sources),
    )
    with MemoryCheckpoint(sources, world_size=world_size, group=group) as ckpt:
        _reshard_into(state, ckpt.metadata, ckpt.reader, ckpt.chunked, chosen, world_size, group)
    dist.barrier(group)  # every rank has read what it needs before any slot is released
    log.info("resharded step %d from %d to %d ranks", chosen, world_size, world)
    return chosen


def _load_flushed(
    state: MutableMapping[str, Any],
    world_size: int,
    flush_dirs: Sequence[Path],
    group: Any,
    why: SnapshotMismatchError,
) -> int:
    """The fallback of :func:`load_resharded`: the newest whole flushed checkpoint of the old
    size every rank finds, verified, resharded by ``dcp.load``; ``why`` if there is none."""
    from ftmem.errors import UnsafePathError
    from ftmem.tiers.checkpoints import list_checkpoints, read_manifest, verify_checkpoint
    from ftmem.tiers.dcp_meta import metadata_from_json
    from ftmem.tiers.dcp_read import CheckedReader
    from ftmem.tiers.memory_dcp import all_gather_json

    found: dict[int, Any] = {}
    for tier in flush_dirs:
        try:
            good, _ = list_checkpoints(tier)
        except (UnsafePathError, OSError) as exc:
            log.error("cannot read disk tier %s: %s", tier, exc)
            continue
        for ck in good:
            if ck.world_size == world_size and not ck.is_part:
                found.setdefault(ck.step, ck)  # the nearest tier's copy wins
    everyone = all_gather_json(sorted(found), group)
    common = set.intersection(*(set(steps) for steps in everyone)) if everyone else set()
    if not common:
        raise SnapshotMismatchError(
            f"{why}; nor is a flushed checkpoint of the {world_size}-rank job readable by "
            f"every rank in the disk tiers ({', '.join(map(str, flush_dirs)) or 'none set'})"
        ) from why
    ck = found[max(common)]
    log.warning("%s: resharding the flushed checkpoint %s instead", why, ck.path)
    verify_checkpoint(ck)  # every file against the manifest the tier key signed
    if ck.dcp_json is None:
        raise SnapshotMismatchError(f"{why}; {ck.path} has no DCP metadata in its manifest")
    meta = metadata_from_json(ck.dcp_json)  # not .metadata: nothing unpickled
    listed = read_manifest(ck.path).chunked
    chunked = frozenset(listed) if listed is not None else _chunked(meta)
    _reshard_into(state, meta, lambda: CheckedReader(ck), chunked, ck.step, world_size, group)
    dist.barrier(group)
    log.info("resharded step %d from %d ranks, from %s", ck.step, world_size, ck.path)
    return int(ck.step)


def _chunked(meta: Any) -> frozenset[str]:
    """The tensors a checkpoint without a ``chunked`` list holds as chunks: those DCP
    describes in several pieces, or in one smaller than the tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return frozenset(
        name
        for name, md in meta.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
        and (len(md.chunks) > 1 or any(tuple(c.sizes) != tuple(md.size) for c in md.chunks))
    )


def _tensor_names(tree: Any) -> list[str]:
    """The tensor names in a named skeleton."""
    if isinstance(tree, tuple) and len(tree) == 2 and tree[0] == "tensor":
        return [str(tree[1])]
    if isinstance(tree, dict):
        return [n for v in tree.values() for n in _tensor_names(v)]
    if isinstance(tree, list | tuple):
        return [n for v in tree for n in _tensor_names(v)]
    return []


def _old_rank_tensor(wanted: dict[str, torch.Tensor], r: int) -> Callable[[str], torch.Tensor]:
    """Old rank ``r``'s tensor of a name: its own entry where it differed from rank 0's."""
    from ftmem.tiers.export import PER_RANK_KEY

    def tensor(name: str) -> torch.Tensor:
        entry = f"{PER_RANK_KEY}.{r}.tensors.{name}"
        return wanted[entry] if entry in wanted else wanted[name]

    return tensor


def _reshard_into(
    state: MutableMapping[str, Any],
    meta: Any,
    reader: Callable[[], Any],
    chunked: frozenset[str],
    chosen: int,
    world_size: int,
    group: Any,
) -> None:
    """Load step ``chosen`` of a ``world_size``-rank job (DCP metadata ``meta``, read through
    a new ``reader()`` per ``dcp.load``; ``chunked``: the tensors held as chunks) into
    ``state`` at this world size (steps 2-4 of the module docstring)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ftmem.tiers.export import PER_RANK_KEY

    rank, world = dist.get_rank(), dist.get_world_size()
    # 1. Every old rank's skeleton and tensor names: what differs between them.
    per_rank = {
        str(r): {
            "skeleton": _empty(meta, f"{PER_RANK_KEY}.{r}.skeleton"),
            "names": _empty(meta, f"{PER_RANK_KEY}.{r}.names"),
        }
        for r in range(world_size)
    }
    dcp_load({PER_RANK_KEY: per_rank}, storage_reader=reader(), process_group=group)
    names = [json.loads(per_rank[str(r)]["names"].numpy().tobytes()) for r in range(world_size)]
    trees = []
    for r in range(world_size):
        skeleton = decode_skeleton(per_rank[str(r)]["skeleton"].numpy().tobytes())
        skeleton.pop(REPLICAS_KEY, None)
        trees.append(_named(skeleton, names[r]))
    own = {
        key
        for r in range(1, world_size)
        for key in meta.state_dict_metadata
        if key.startswith(f"{PER_RANK_KEY}.{r}.tensors.")
        and key.split(".tensors.", 1)[1] not in chunked
    }
    resharded: list[str] = []
    for key, obj in state.items():
        values = [t.get(key) for t in trees]
        differs = any(v != values[0] for v in values[1:]) or any(
            k.split(".tensors.", 1)[1] == key or k.split(".tensors.", 1)[1].startswith(key + ".")
            for k in own
        )
        if not differs:
            continue
        if not callable(getattr(obj, RESHARD_METHOD, None)):
            raise SnapshotMismatchError(
                f"state[{key!r}] ({type(obj).__name__}) differs between the {world_size} "
                f"ranks that saved step {chosen} (a per-rank data position?), and it cannot "
                f"be resharded to {world} ranks: give it a {RESHARD_METHOD}(states, rank, "
                "world_size) method, or keep its state the same on every rank (e.g. "
                "ftmem.ElasticSampler counts the samples of the whole job); nothing was "
                "loaded"
            )
        resharded.append(key)
    # 2. The state at this world size; DCP's planners reshard.
    targets: dict[str, Any] = {}
    for key, obj in state.items():
        if key in resharded:
            continue
        if isinstance(obj, torch.optim.Optimizer):
            init_optimizer_state(obj)
        targets[key] = obj.state_dict() if is_stateful(obj) and not torch.is_tensor(obj) else obj
    dcp_load(targets, storage_reader=reader(), process_group=group)
    # 3. Each old rank's value of the per-rank entries, for their objects to reshard.
    wanted: dict[str, torch.Tensor] = {}
    for key in resharded:
        for r in range(world_size):
            for name in _tensor_names(trees[r].get(key)):
                entry = f"{PER_RANK_KEY}.{r}.tensors.{name}"
                src = entry if entry in meta.state_dict_metadata else name
                if src not in wanted:
                    wanted[src] = _empty(meta, src)
    if wanted:
        dcp_load(wanted, storage_reader=reader(), process_group=group)
    for key, obj in state.items():
        if key in resharded:
            states = [_fill(trees[r][key], _old_rank_tensor(wanted, r)) for r in range(world_size)]
            getattr(obj, RESHARD_METHOD)(states, rank=rank, world_size=world)
        elif is_stateful(obj) and not torch.is_tensor(obj):
            obj.load_state_dict(targets[key])
        else:
            state[key] = targets[key]
