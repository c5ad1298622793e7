"""Restoring a verified snapshot into a live state, in place: plan, copy and verify, finish.

:func:`plan_restore` matches the snapshot to the state without changing anything (its
objects were checked first). :func:`copy_verified` then copies every tensor into its place
in one pass, each piece only once its checksum matched: no corrupt byte is ever written into a
live tensor. Only when every piece passed on every rank does :func:`finish_restore` gather the
replicated rows and call ``load_state_dict`` on the Stateful objects; otherwise the caller
restores an older step over the same tensors. If no step passes, ``load`` raises and the
live tensors hold, piece by piece, either their old bytes or verified bytes of a snapshot
step that was tried (see docs/design.md, "Restore").
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ftmem import faults
from ftmem.client.device_restore import device_threads, run_all, to_device
from ftmem.client.flatten import StoredSnapshot, StoredTensor, is_stateful
from ftmem.errors import CorruptSnapshotError, SnapshotMismatchError
from ftmem.format.layout import HASH_PIECE, digest, hash_bytes, piece_hashes, pieces
from ftmem.format.tensors import (
    DTYPES,
    GATHER_MARK,
    REPLICAS_KEY,
    TENSOR_MARK,
    decode_skeleton,
    torch_dtype,
)
from ftmem.shm import MappedSegment


@dataclass
class RestorePlan:
    """What :func:`apply_restore` will do: copies into tensors, the rows of replicated tensors
    gathered from every replica, then per-key finishing calls."""

    copies: list[tuple[StoredTensor, torch.Tensor]] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    replicas: dict[str, Any] | None = None
    """The skeleton's replica table (``REPLICAS_KEY``) if the snapshot was sharded."""
    gathers: dict[int, torch.Tensor] = field(default_factory=dict)
    """Replicated tensor (table position) -> the tensor its rows are gathered into."""
    stored: tuple[StoredTensor, ...] = ()
    """The snapshot's tensors (this replica's rows are among them)."""

    def replica_group_shape(self) -> tuple[int, int] | None:
        """(replicas, this one's index) of a sharded snapshot, else None."""
        if self.replicas is None:
            return None
        return int(self.replicas["size"]), int(self.replicas["index"])


def _is_mark(obj: Any, mark: str = TENSOR_MARK) -> bool:
    return isinstance(obj, tuple) and len(obj) == 2 and obj[0] == mark and type(obj[1]) is int


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor to copy into: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _matching(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], target: torch.Tensor | None
) -> torch.Tensor | None:
    """The tensor ``target`` restores into (:func:`_local`; None without a target).

    Raises:
        SnapshotMismatchError: it has another dtype or shape than the stored tensor ``name``.
    """
    local = _local(target) if target is not None else None
    if local is not None and (local.dtype != dtype or tuple(local.shape) != tuple(shape)):
        held = str(dtype).removeprefix("torch.")
        raise SnapshotMismatchError(
            f"{name}: snapshot holds {held} {list(shape)}, the state "
            f"{str(local.dtype).removeprefix('torch.')} {list(local.shape)}"
        )
    return local


def _replica_table(doc: Any) -> dict[str, Any]:
    """Check the skeleton's replica table (it came from a file another process wrote)."""
    try:
        size, index = int(doc["size"]), int(doc["index"])
        tensors = [
            (str(n), DTYPES[str(d)], tuple(int(x) for x in sh)) for n, d, sh in doc["tensors"]
        ]
        pieces = [tuple(int(x) for x in p) for p in doc["pieces"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptSnapshotError(f"malformed replica table: {exc!r}") from exc
    if not 0 <= index < size:
        raise CorruptSnapshotError("replica index out of range")
    for p in pieces:
        if len(p) != 5 or not 0 <= p[0] < len(tensors) or not 0 <= p[3] < size:
            raise CorruptSnapshotError("malformed replica piece")
        shape = tensors[p[0]][2]
        rows = shape[0] if shape else 1
        if not 0 <= p[1] <= p[2] <= rows:
            raise CorruptSnapshotError("replica piece rows out of range")
    return {"size": size, "index": index, "tensors": tensors, "pieces": pieces}


def _live_tensors(
    obj: Any, prefix: tuple[Any, ...], out: dict[tuple[Any, ...], torch.Tensor]
) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _live_tensors(v, (*prefix, k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _live_tensors(v, (*prefix, i), out)


def plan_restore(
    state: MutableMapping[str, Any], snap: StoredSnapshot, objects: bytes
) -> RestorePlan:
    """Match the snapshot to ``state`` without changing anything.

    Raises:
        CorruptSnapshotError: the skeleton is malformed or refers to missing tensors.
        SnapshotMismatchError: a key of ``state`` is missing from the snapshot, or a plain
            tensor in ``state`` has another shape or dtype than the stored one.
    """
    faults.maybe_inject(faults.Point.IN_RESTORE, faults.process_rank(), snap.step)
    skeleton = decode_skeleton(objects)
    stored = snap.tensors
    plan = RestorePlan(stored=stored)
    if REPLICAS_KEY in skeleton:
        plan.replicas = _replica_table(skeleton[REPLICAS_KEY])
    # Reset for each key of the state, read by place(): the key's live tensors by path, the
    # paths met, the tensors restored (in place, newly allocated), an optimizer's parameters.
    live: dict[tuple[Any, ...], torch.Tensor] = {}
    seen: set[tuple[Any, ...]] = set()
    counts = [0, 0]
    like: Callable[[tuple[Any, ...]], Any] = _no_param

    def place(
        name: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        path: tuple[Any, ...],
        like_param: bool,
    ) -> tuple[Any, torch.Tensor]:
        """(what the state gets at ``path``, the tensor the stored bytes go into): the live
        tensor if it matches, else a new one (``like_param``: a DTensor like the optimizer's
        parameter, e.g. its state under FSDP2)."""
        target = live.get(path)
        local = _matching(name, dtype, shape, target)
        seen.add(path)
        if target is not None and local is not None:
            counts[0] += 1
            return target, local
        counts[1] += 1
        local = torch.empty(shape, dtype=dtype)
        model = like(path) if like_param else None
        if model is not None and tuple(_local(model).shape) == tuple(shape):
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                local, model.device_mesh, model.placements, run_check=False
            ), local
        return local, local

    def build(skel: Any, path: tuple[Any, ...]) -> Any:
        if _is_mark(skel, GATHER_MARK):
            pos = skel[1]
            if plan.replicas is None or not 0 <= pos < len(plan.replicas["tensors"]):
                raise CorruptSnapshotError(f"skeleton refers to replicated tensor {pos}")
            name, dtype, shape = plan.replicas["tensors"][pos]
            out, plan.gathers[pos] = place(name, dtype, shape, path, True)
            return out
        if _is_mark(skel):
            idx = skel[1]
            if not 0 <= idx < len(stored):
                raise CorruptSnapshotError(f"skeleton refers to tensor {idx} of {len(stored)}")
            st = stored[idx]
            dtype = torch_dtype(st.dtype)
            out, local = place(st.name, dtype, st.shape, path, st.chunk is not None)
            plan.copies.append((st, local))
            return out
        if isinstance(skel, dict):
            return {k: build(v, (*path, k)) for k, v in skel.items()}
        if isinstance(skel, list):
            return [build(v, (*path, i)) for i, v in enumerate(skel)]
        if isinstance(skel, tuple):
            return tuple(build(v, (*path, i)) for i, v in enumerate(skel))
        return skel

    for key, value in state.items():
        if key not in skeleton:
            raise SnapshotMismatchError(f"key {key!r} of the state is not in snapshot {snap.step}")
        like = _param_of_state(value)
        live.clear()
        seen.clear()
        counts[:] = [0, 0]
        module = isinstance(value, torch.nn.Module)
        stateful = is_stateful(value) and not isinstance(value, torch.Tensor)
        _live_tensors(value.state_dict() if stateful else value, (), live)
        new = build(skeleton[key], ())
        if isinstance(value, torch.Tensor):
            if new is not value:
                raise SnapshotMismatchError(
                    f"{key!r} is a tensor in the state but not in the snapshot"
                )
        elif not stateful:
            plan.finish.append(functools.partial(state.__setitem__, key, new))
        elif module and seen != set(live):
            missing = sorted(".".join(map(str, p)) for p in set(live) - seen)[:5]
            extra = sorted(".".join(map(str, p)) for p in seen - set(live))[:5]
            raise SnapshotMismatchError(
                f"module {key!r} does not match snapshot {snap.step}: missing {missing}, unexpected {extra}"
            )
        elif not (module and counts[1] == 0):
            plan.finish.append(functools.partial(value.load_state_dict, new))
    return plan


def _no_param(path: tuple[Any, ...]) -> Any:
    return None


def _param_of_state(value: Any) -> Callable[[tuple[Any, ...]], Any]:
    """For an optimizer: the parameter whose state a ``("state", index, key)`` path is (its
    DTensor-ness and placements are what a newly made state tensor must copy)."""
    if not isinstance(value, torch.optim.Optimizer):
        return _no_param
    params = [p for g in value.param_groups for p in g["params"]]

    def of(path: tuple[Any, ...]) -> Any:
        if len(path) == 3 and path[0] == "state" and isinstance(path[1], int):
            if 0 <= path[1] < len(params) and hasattr(params[path[1]], "device_mesh"):
                return params[path[1]]
        return None

    return of


def restore_threads() -> int:
    """Threads used to verify and copy at load (the training loop is not running then)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def apply_restore(plan: RestorePlan, seg: Any, threads: int = 1, group: Any = None) -> None:
    """Copy every planned tensor out of ``seg`` (unchecked: a flushed checkpoint's files were
    verified whole; in 16 MiB pieces on ``threads`` threads), then :func:`finish_restore`."""
    piece = 16 << 20
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for st, target in plan.copies:
        if st.nbytes == 0:
            continue
        src = seg.tensor[st.offset : st.offset + st.nbytes]
        if target.is_contiguous() and target.device.type == "cpu":
            dst = target.reshape(-1).view(torch.uint8)
            jobs += [(dst[i : i + piece], src[i : i + piece]) for i in range(0, st.nbytes, piece)]
        else:
            target.copy_(src.view(torch_dtype(st.dtype)).view(st.shape))
    run_all(lambda j: j[0].copy_(j[1]), jobs, threads)  # copy_ releases the GIL
    finish_restore(plan, seg, group)


def finish_restore(
    plan: RestorePlan, seg: Any, group: Any = None, peers: PeerPieces | None = None
) -> None:
    """After the copies: gather the rows of replicated tensors from every replica (a
    collective over ``group``: every replica must call this), then run the finishing calls."""
    if plan.replicas is not None:
        gather_replicated(plan, seg, group, peers)
    for fn in plan.finish:
        fn()


_Piece = tuple[StoredTensor, "np.ndarray[Any, Any] | None", int, int, str]
"""One checksummed piece to restore: (stored tensor, the target's bytes (None: check only),
start, end (within the tensor), expected xxh3-64)."""


def copy_verified(plan: RestorePlan, seg: MappedSegment, threads: int = 1) -> None:
    """Copy every planned tensor out of the slot, checking each piece's checksum before any of
    its bytes are copied (the piece still in cache). A task is one piece of a large tensor, or
    consecutive small tensors up to ``HASH_PIECE`` bytes; it copies nothing unless all its
    pieces match. Tasks run on ``threads`` threads; the copy is numpy's (``Tensor.copy_``
    would spread over torch's intra-op threads and oversubscribe the cores). Stored tensors
    without a target (this replica's rows, read by :func:`gather_replicated`) are only
    checked; a contiguous CUDA target goes through
    :func:`ftmem.client.device_restore.to_device`; a strided one is checked whole, then copied.

    Raises:
        CorruptSnapshotError: naming the tensors with a piece that does not match.
    """
    targets = {id(st): t for st, t in plan.copies}
    view = seg.view
    src = seg.tensor.numpy()  # a view of the slot, no copy
    failed: set[str] = set()
    lock = threading.Lock()
    tasks: list[list[_Piece]] = []
    small: list[_Piece] = []  # consecutive one-piece tensors, until HASH_PIECE bytes
    small_bytes = 0
    whole: list[tuple[StoredTensor, torch.Tensor]] = []
    device: list[tuple[StoredTensor, torch.Tensor, list[str]]] = []
    for st in plan.stored:
        dst = targets.get(id(st))
        try:
            expect = piece_hashes(st.hash, st.nbytes)
        except CorruptSnapshotError:
            expect = []
        if not expect:
            failed.add(repr(st.name))
            continue
        direct = dst is not None and dst.is_contiguous() and dst.device.type == "cpu"
        if dst is not None and dst.is_cuda and dst.is_contiguous():  # shape and dtype matched
            device.append((st, dst.reshape(-1).view(torch.uint8), expect))
            continue
        out = dst.reshape(-1).view(torch.uint8).numpy() if dst is not None and direct else None
        if len(expect) > 1:
            tasks += [
                [(st, out, a, b, h)] for (a, b), h in zip(pieces(st.nbytes), expect, strict=True)
            ]
        else:
            small.append((st, out, 0, st.nbytes, expect[0]))
            small_bytes += st.nbytes
            if small_bytes >= HASH_PIECE:
                tasks.append(small)
                small, small_bytes = [], 0
        if dst is not None and not direct:
            whole.append((st, dst))
    if small:
        tasks.append(small)

    def run(task: list[_Piece]) -> None:
        bad = [
            repr(st.name)
            for st, _, a, b, h in task
            if hash_bytes(view[st.offset + a : st.offset + b]) != h
        ]
        if bad:  # nothing of this task is copied
            with lock:
                failed.update(bad)
            return
        for st, out, a, b, _ in task:
            if out is not None and b > a:
                np.copyto(out[a:b], src[st.offset + a : st.offset + b])

    run_all(run, tasks, threads)
    if device:
        failed |= to_device(device, seg, device_threads())
    for st, dst in whole:
        if repr(st.name) not in failed and st.nbytes:
            raw = seg.tensor[st.offset : st.offset + st.nbytes]
            dst.copy_(raw.view(torch_dtype(st.dtype)).view(st.shape))
    if failed:
        raise CorruptSnapshotError(f"{', '.join(sorted(failed)[:5])} fail their checksum")


PeerPieces = Callable[[int], "tuple[Any, Sequence[StoredTensor]] | None"]
"""Replica index -> (its slot mapping, its snapshot's tensors) if this node's SMP holds it."""


def gather_replicated(
    plan: RestorePlan, seg: MappedSegment, group: Any = None, peers: PeerPieces | None = None
) -> None:
    """Rebuild every replicated tensor from the rows each replica stored, in place.

    When every replica's snapshot is on this node (``peers`` finds it in the SMP's shared
    memory, and its rows pass their checksums) on *every* rank of ``group`` (one all-reduce
    decides), the rows are copied straight from the other replicas' slots; otherwise one
    all-gather of each replica's rows (padded to the largest share) over ``group``.
    """
    import torch.distributed as dist

    table = plan.replicas
    assert table is not None
    size, index = int(table["size"]), int(table["index"])
    tensors, pieces = table["tensors"], table["pieces"]

    def row_bytes(pos: int) -> int:
        _, dtype, shape = tensors[pos]
        return int(math.prod(shape[1:]) * dtype.itemsize)

    owned: list[list[tuple[int, int, int, int]]] = [[] for _ in range(size)]
    for pos, a, b, owner, _ in pieces:
        owned[owner].append((pos, a, b, (b - a) * row_bytes(pos)))
    mine_stored = []
    for pos, a, b, owner, idx in pieces:
        if owner != index:
            continue
        st = plan.stored[idx] if 0 <= idx < len(plan.stored) else None
        if st is None or st.nbytes != (b - a) * row_bytes(pos):
            raise CorruptSnapshotError(f"replica rows of {tensors[pos][0]} are not in the snapshot")
        mine_stored.append(st)
    sources: dict[int, tuple[Any, Sequence[StoredTensor]]] = {index: (seg, mine_stored)}
    local = size == 1 or peers is not None
    for k in range(size):
        if k == index or not local or peers is None:
            continue
        found = peers(k)
        theirs = list(found[1])[-len(owned[k]) :] if found is not None and owned[k] else []
        if (
            found is None
            or len(theirs) != len(owned[k])
            or any(
                st.nbytes != n or digest(found[0].view[st.offset : st.offset + n]) != st.hash
                for st, (_, _, _, n) in zip(theirs, owned[k], strict=True)
            )
        ):
            local = False
        else:
            sources[k] = (found[0], theirs)
    if size > 1:
        flag = torch.tensor([1 if local else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        local = bool(flag.item())
    if local:
        for k in range(size):
            src_seg, stored = sources[k]
            for (pos, a, _, n), st in zip(owned[k], stored, strict=True):
                _put(
                    plan.gathers.get(pos),
                    a * row_bytes(pos),
                    a,
                    src_seg.tensor[st.offset : st.offset + n],
                )
        return
    width = max(1, max(sum(n for *_, n in run) for run in owned))
    mine = torch.zeros(width, dtype=torch.uint8)
    at = 0
    for st in mine_stored:
        mine[at : at + st.nbytes].copy_(seg.tensor[st.offset : st.offset + st.nbytes])
        at += st.nbytes
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]  # size > 1 here
    dist.all_gather(outs, mine, group=group)
    for k in range(size):
        at = 0
        for pos, a, _, n in owned[k]:
            _put(plan.gathers.get(pos), a * row_bytes(pos), a, outs[k][at : at + n])
            at += n


def _put(target: torch.Tensor | None, start: int, row: int, src: torch.Tensor) -> None:
    """Copy the bytes ``src`` (rows from ``row`` on, ``start`` bytes in) into ``target``."""
    n = src.numel()
    if target is None or n == 0:
        return
    if target.is_contiguous():
        target.reshape(-1).view(torch.uint8)[start : start + n].copy_(src)
    else:
        rows = target[row : row + n // max(1, target[0].nbytes)] if target.dim() > 0 else target
        rows.copy_(src.view(target.dtype).view(rows.shape))
