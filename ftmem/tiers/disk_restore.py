"""Read one rank's snapshot back from a flushed DCP checkpoint, for ``ftmem.load``'s fallback.

Once the files pass their manifest's hashes, DCP's own reader loads the rank's tensors (its
per-rank entry where it has one, else the shared top level), in place, into one buffer laid out
like a slot, in the order the rank saved them; with its skeleton, it feeds the same
plan/apply restore as a snapshot in memory. Nothing is unpickled (:mod:`ftmem.tiers.dcp_read`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import StoredSnapshot, StoredTensor
from ftmem.format.tensors import dtype_name
from ftmem.shm import ALIGN
from ftmem.tiers.checkpoints import Checkpoint, verify_checkpoint
from ftmem.tiers.dcp_read import CheckedReader, load_into
from ftmem.tiers.export import PER_RANK_KEY


@dataclass
class BufferSegment:
    """A slot-like buffer in process memory (what apply_restore reads from)."""

    tensor: torch.Tensor
    view: memoryview


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def load_rank(
    ckpt: Checkpoint, rank: int, verify: bool = True
) -> tuple[StoredSnapshot, bytes, BufferSegment]:
    """Rank ``rank``'s snapshot of ``ckpt`` as (layout, skeleton bytes, buffer).

    Raises:
        CorruptSnapshotError: a file fails its checksum, or the checkpoint lacks this rank.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if verify:
        verify_checkpoint(ckpt)
    path = str(ckpt.path)
    try:
        md = CheckedReader(ckpt).read_metadata().state_dict_metadata
        prefix = f"{PER_RANK_KEY}.{rank}"
        small = {}
        for key in ("names", "skeleton"):
            tm = md[f"{prefix}.{key}"]
            small[key] = torch.empty(tuple(tm.size), dtype=torch.uint8)
        load_into({f"{prefix}.{k}": v for k, v in small.items()}, ckpt)
        names = json.loads(small["names"].numpy().tobytes() or b"[]")
        skeleton = small["skeleton"].numpy().tobytes()
        fqns = []
        offset = 0
        specs = []
        for name in names:
            own = f"{prefix}.tensors.{name}"
            fqn = own if own in md else str(name)
            tm = md[fqn]
            if not isinstance(tm, TensorStorageMetadata):
                raise CorruptSnapshotError(f"{fqn} is not a tensor in {path}")
            dtype = tm.properties.dtype
            shape = tuple(int(s) for s in tm.size)
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            specs.append((str(name), dtype, shape, offset, nbytes))
            fqns.append(fqn)
            offset = _align(offset + nbytes)
        buf = torch.empty(max(offset, 1), dtype=torch.uint8)
        targets = {
            fqn: buf[off : off + n].view(dtype).reshape(shape)
            for fqn, (_, dtype, shape, off, n) in zip(fqns, specs, strict=True)
        }
        if targets:
            load_into(targets, ckpt)
    except CorruptSnapshotError:
        raise
    except (KeyError, ValueError, RuntimeError, OSError) as exc:
        raise CorruptSnapshotError(f"{path} has no snapshot of rank {rank}: {exc!r}") from exc
    tensors = tuple(
        StoredTensor(i, name, dtype_name(dtype), shape, off, n)
        for i, (name, dtype, shape, off, n) in enumerate(specs)
    )
    snap = StoredSnapshot(ckpt.step, tensors, 0, len(skeleton), "")
    return snap, skeleton, BufferSegment(buf, memoryview(buf.numpy()))  # type: ignore[arg-type]
