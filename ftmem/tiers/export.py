"""Export a step held in SMP memory as a stock torch.distributed.checkpoint (DCP) directory.

What ftmem writes to disk loads with stock ``dcp.load`` at any world size and converts with
``dcp_to_torch_save``; DCP itself plans it (``dcp.save(..., no_dist=True)``) from the ranks'
committed slots, whose checksums every byte written is checked against. The top level is rank
0's state as passed to ``ftmem.save``; tensors equal on every rank (by checksum) are written
once; under ``ftmem_per_rank.<R>`` each rank has its tensors that differ from rank 0's, its
skeleton and its tensor names (uint8 tensors), so ftmem restores each rank exactly;
``ftmem_meta`` holds the step and world size (docs/api.md, "ftmem export").

Crash safety: the directory is written as ``<out>.tmp-<host>-<pid>`` and renamed into place
only once every file and the signed manifest are fsynced, so a partial export is never taken
for a complete one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.format.layout import StoredSnapshot, parse_layout
from ftmem.format.tensors import (
    GATHER_MARK,
    REPLICAS_KEY,
    TENSOR_MARK,
    decode_skeleton,
    read_objects,
    torch_dtype,
)
from ftmem.protocol.flush_jobs import SlotSource
from ftmem.protocol.messages import SnapshotInfo
from ftmem.shm import MappedSegment
from ftmem.tiers.checkpoints import (
    fsync_dir,
    read_checkpoint,
    temp_name,
    verify_checkpoint,
    write_manifest,
)
from ftmem.tiers.dcp_meta import metadata_to_json, write_metadata
from ftmem.tiers.dcp_read import in_one_process, load_whole
from ftmem.tiers.dcp_writer import SlotWriter

log = get_logger(__name__)

PER_RANK_KEY = "ftmem_per_rank"
META_KEY = "ftmem_meta"


class ExportError(FtmemError):
    """The requested step cannot be exported (missing on a rank, corrupt, or the output exists)."""


RankSource = SlotSource
"""One rank's committed slot of the step to export (the flush worker's job carries them)."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What an export wrote."""

    path: Path
    step: int
    world_size: int
    nbytes: int
    """Bytes of the DCP files."""
    shared_tensors: int
    """Tensors equal on every rank, written once."""
    per_rank_tensors: int
    """Tensors written per rank (they differ between ranks)."""


def find_sources(run_dirs: Sequence[Path], step: int | None = None) -> list[RankSource]:
    """Ask each SMP for its ranks' committed snapshots; pick ``step`` or the newest common one.

    Raises:
        ExportError: no step is committed by every rank, or ``step`` is missing on a rank.
    """
    from ftmem.protocol.smp_client import SmpClient

    per_rank: dict[int, list[SnapshotInfo]] = {}
    for run_dir in run_dirs:
        with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:
            for rank in sorted(c.status().ranks):
                per_rank[rank] = c.query(rank)
    if not per_rank:
        raise ExportError(f"no rank has a snapshot in {', '.join(map(str, run_dirs))}")
    common = set.intersection(*({s.step for s in snaps} for snaps in per_rank.values()))
    if step is None:
        if not common:
            raise ExportError("no step is committed by every rank")
        step = max(common)
    elif step not in common:
        raise ExportError(f"step {step} is not committed by every rank (common: {sorted(common)})")
    out = []
    for rank, snaps in sorted(per_rank.items()):
        s = next(s for s in snaps if s.step == step)
        out.append(RankSource(rank, step, s.path, s.capacity, s.layout))
    return out


def _tensors(snap: StoredSnapshot, seg: MappedSegment) -> list[torch.Tensor]:
    """Each tensor on a storage of its own over its bytes of the mapping (no copy): DCP clones
    a tensor whose storage is larger than the tensor, which for views of one slot-wide storage
    meant a second full copy of the state in memory."""
    out = []
    for t in snap.tensors:
        if t.nbytes == 0:
            out.append(torch.empty(t.shape, dtype=torch_dtype(t.dtype)))
            continue
        raw = torch.frombuffer(seg.view, dtype=torch.uint8, count=t.nbytes, offset=t.offset)
        out.append(raw.view(torch_dtype(t.dtype)).reshape(t.shape))
    return out


_CHUNK = object()
"""Stands in for a tensor stored as a chunk while a tree is rebuilt (never left in it)."""


def _mark(skeleton: Any) -> tuple[str, int] | None:
    if (
        isinstance(skeleton, tuple)
        and len(skeleton) == 2
        and skeleton[0] in (TENSOR_MARK, GATHER_MARK)
    ):
        return str(skeleton[0]), int(skeleton[1])
    return None


def _fill(skeleton: Any, tensors: list[torch.Tensor], chunked: set[int]) -> Any:
    """The skeleton with its tensors put back, leaving out those stored as chunks (gathered
    rows, or the indices ``chunked``): dropped from a dict, None in a list or tuple."""
    mark = _mark(skeleton)
    if mark is not None:
        return _CHUNK if mark[0] == GATHER_MARK or mark[1] in chunked else tensors[mark[1]]
    if isinstance(skeleton, dict):
        kids = {k: _fill(v, tensors, chunked) for k, v in skeleton.items()}
        return {k: v for k, v in kids.items() if v is not _CHUNK}
    if isinstance(skeleton, list | tuple):
        seq = [_fill(v, tensors, chunked) for v in skeleton]
        seq = [None if v is _CHUNK else v for v in seq]
        return seq if isinstance(skeleton, list) else tuple(seq)
    return skeleton


def _paths_of(
    skeleton: Any,
    path: tuple[Any, ...],
    snap: StoredSnapshot,
    tables: Any,
    out: dict[str, tuple[Any, ...]],
) -> None:
    """Where each chunked tensor sits in the state (DCP's planner data), by tensor name."""
    mark = _mark(skeleton)
    if mark is not None:
        kind, i = mark
        if kind == TENSOR_MARK and 0 <= i < len(snap.tensors) and snap.tensors[i].chunk:
            out.setdefault(snap.tensors[i].name, path)
        elif kind == GATHER_MARK and tables is not None and 0 <= i < len(tables["tensors"]):
            out.setdefault(str(tables["tensors"][i][0]), path)
        return
    if isinstance(skeleton, dict):
        for k, v in skeleton.items():
            _paths_of(v, (*path, k), snap, tables, out)
    elif isinstance(skeleton, list | tuple):
        for k, v in enumerate(skeleton):
            _paths_of(v, (*path, k), snap, tables, out)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


@dataclass(eq=False)
class StepState:
    """A step of ``sources`` as the DCP state the export saves (see the module docstring),
    over read-only views of the mapped slots; built by :func:`step_state`."""

    step: int
    world: int
    ranks: list[int]
    part: bool
    """True when the sources are some ranks of a larger world (a node's part)."""
    snaps: list[StoredSnapshot]
    state: dict[str, Any]
    paths: dict[str, tuple[Any, ...]]
    """Where each chunked tensor sits in the state (DCP's planner data)."""
    expected: dict[int, str]
    """Each tensor's checksum, by the address of its bytes."""
    shared: set[str]
    """Tensors equal on every rank (saved once)."""
    per_rank_tensors: int

    def save(self, writer: Any) -> tuple[Any, set[str]]:
        """Save :attr:`state` with DCP into ``writer`` and describe the chunked tensors in the
        metadata DCP returns; return (metadata, names of the chunked tensors).

        Raises:
            ExportError: DCP named a tensor of rank 0 differently, or wrote no chunk's entry.
            The writer's ``error`` where it set one (DCP's CheckpointException wraps it).
        """
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        with in_one_process():
            try:
                meta = dcp_save(self.state, storage_writer=writer, no_dist=True)
            except BaseException as exc:
                error = getattr(writer, "error", None)
                if error is not None and error is not exc:
                    raise error from exc
                raise
        chunked = self._add_chunks(meta)
        missing = {t.name for t in self.snaps[0].tensors} - set(meta.state_dict_metadata)
        if missing:  # ftmem's names must be DCP's keys, or ftmem could not read it back
            raise ExportError(f"DCP named some tensors differently: {sorted(missing)[:5]}")
        return meta, chunked

    def _add_chunks(self, meta: Any) -> set[str]:
        """Describe in ``meta`` every tensor the ranks stored as chunks, as DCP describes a
        sharded tensor: its global size and each chunk's offsets, the bytes being those of the
        chunk's per-rank entry. Returns the names of those tensors."""
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        names: set[str] = set()
        for rank, snap in zip(self.ranks, self.snaps, strict=True):
            for t in snap.tensors:
                if t.chunk is None:
                    continue
                own = f"{PER_RANK_KEY}.{rank}.tensors.{t.name}"
                src = meta.storage_data.get(MetadataIndex(own, torch.Size([0] * len(t.shape))))
                if src is None:
                    raise ExportError(f"DCP wrote no entry for {own}")
                entry = meta.state_dict_metadata.get(t.name)
                if entry is None:
                    entry = meta.state_dict_metadata[t.name] = TensorStorageMetadata(
                        properties=TensorProperties(dtype=torch_dtype(t.dtype)),
                        size=torch.Size(t.chunk.shape),
                        chunks=[],
                    )
                    meta.planner_data[t.name] = self.paths.get(t.name, (t.name,))
                elif (
                    not isinstance(entry, TensorStorageMetadata)
                    or tuple(entry.size) != t.chunk.shape
                ):
                    raise ExportError(f"{t.name}: chunks of different tensors")
                offsets = torch.Size(t.chunk.offset)
                if any(c.offsets == offsets for c in entry.chunks):
                    continue  # the same chunk from another replica (HSDP)
                entry.chunks.append(
                    ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(t.shape))
                )
                meta.storage_data[MetadataIndex(t.name, offsets, len(entry.chunks) - 1)] = src
                names.add(t.name)
        return names

    def part_fields(self, meta: Any, chunked: set[str]) -> dict[str, Any]:
        """The part's fields of its manifest (or of a process's part in memory): its DCP
        metadata as JSON, its chunked tensors and each rank's tensor hashes, by name (what
        :func:`ftmem.tiers.assemble.merge_parts` compares between ranks)."""
        hashes = {
            str(r): {t.name: t.hash for t in sn.tensors}
            for r, sn in zip(self.ranks, self.snaps, strict=True)
        }
        return {"dcp": metadata_to_json(meta), "chunked": sorted(chunked), "hashes": hashes}


@contextmanager
def step_state(sources: Sequence[RankSource], world_size: int | None = None) -> Iterator[StepState]:
    """Map the slots of ``sources`` (one per rank, all of one step) read-only and yield the
    step as the state the export saves; unmapped on exit (every view must be gone by then).

    Raises:
        ExportError: ranks missing or at different steps, or the state uses a reserved key.
        FtmemError: a slot's layout or objects are corrupt.
    """
    ranks = sorted(s.rank for s in sources)
    world = len(ranks) if world_size is None else world_size
    part = ranks != list(range(world))
    if len(set(ranks)) != len(ranks) or not ranks or ranks[-1] >= world or ranks[0] < 0:
        raise ExportError(f"need distinct ranks of 0..{world - 1}, got {ranks}")
    if part and world_size is None:
        raise ExportError(f"need every rank 0..N-1, got {ranks}")
    if len({s.step for s in sources}) != 1:
        raise ExportError("sources are of different steps")
    step = sources[0].step
    segs: list[MappedSegment] = []
    tensor_lists: list[list[torch.Tensor]] = []
    expected: dict[int, str] = {}
    state: dict[str, Any] = {}
    try:
        snaps = []
        for s in sorted(sources, key=lambda s: s.rank):
            snaps.append(parse_layout(s.layout, s.capacity))
            segs.append(MappedSegment(Path(s.path), s.capacity))
        skeletons = []
        paths: dict[str, tuple[Any, ...]] = {}
        for snap, seg in zip(snaps, segs, strict=True):
            raw = read_objects(snap, seg.view)  # checks the objects' checksum (and verified)
            skeleton = decode_skeleton(raw)
            tables = skeleton.pop(REPLICAS_KEY, None)
            tensors = _tensors(snap, seg)
            for t, stored in zip(tensors, snap.tensors, strict=True):
                if stored.nbytes:
                    expected[t.data_ptr()] = stored.hash
            skeletons.append(raw)
            tensor_lists.append(tensors)
            if snap is snaps[0]:  # the top level is the lowest rank's state
                chunked = {i for i, t in enumerate(snap.tensors) if t.chunk is not None}
                state = dict(_fill(skeleton, tensors, chunked))
            _paths_of(skeleton, (), snap, tables, paths)
        for reserved in (PER_RANK_KEY, META_KEY):
            if reserved in state:
                raise ExportError(f"the state uses the reserved key {reserved!r}")
        hashes0 = {t.name: t.hash for t in snaps[0].tensors}
        shared = {t.name for t in snaps[0].tensors if t.chunk is None}
        per_rank: dict[str, Any] = {}
        for r, rank in enumerate(ranks):
            # Chunks (a DTensor's shard, a replica's rows) are kept per rank; the whole tensor
            # is described by the metadata (StepState.save), as DCP describes a sharded tensor.
            differ = {
                t.name: tensor_lists[r][i]
                for i, t in enumerate(snaps[r].tensors)
                if t.chunk is not None or (r > 0 and hashes0.get(t.name) != t.hash)
            }
            shared -= set(differ)
            names = json.dumps([t.name for t in snaps[r].tensors]).encode()
            per_rank[str(rank)] = {
                "tensors": differ,
                "skeleton": _bytes_tensor(skeletons[r]),
                "names": _bytes_tensor(names),
            }
        state[PER_RANK_KEY] = per_rank
        state[META_KEY] = {"step": step, "world_size": world, "format": "ftmem-export-1"}
        count = sum(len(v["tensors"]) for v in per_rank.values())
        yield StepState(step, world, ranks, part, snaps, state, paths, expected, shared, count)
    finally:
        state.clear()  # drop every view of the mappings before unmapping
        tensor_lists.clear()
        for seg in segs:
            seg.close()


def export_dcp(
    sources: Sequence[RankSource],
    out: Path,
    world_size: int | None = None,
    *,
    threads: int = 2,
    direct: bool = True,
) -> ExportResult:
    """Write the step of ``sources`` (one per rank, ranks 0..N-1) as a DCP directory ``out``.

    The data files are written by :class:`ftmem.tiers.dcp_writer.SlotWriter` (``threads``
    files in parallel, ``direct``: O_DIRECT where possible), checking every byte against the
    slots' checksums as it copies it. With ``world_size`` larger than the ranks given, ``out``
    is a node's *part*, whose manifest also carries each rank's tensor hashes for
    :func:`ftmem.tiers.assemble.assemble`.

    Raises:
        ExportError: ranks missing or at different steps, ``out`` exists, or a slot fails its
            checksums (a rank reused it while it was written; nothing is left at ``out`` then).
        OSError: writing failed (a full disk...); nothing is left at ``out`` then.
    """
    out = Path(out)
    if out.exists():
        raise ExportError(f"{out} exists; choose a new directory")
    step = sources[0].step if sources else -1
    tmp = out.with_name(temp_name(out.name))
    try:
        with step_state(sources, world_size) as st:
            tmp.mkdir(mode=0o700)  # the checkpoint holds the model: owner only
            writer = SlotWriter(
                str(tmp), expected=st.expected, threads=threads, direct=direct, step=step
            )
            meta, chunked = st.save(writer)
            if chunked:
                write_metadata(tmp, meta)  # DCP's, plus the global tensors made of chunks
            # The metadata as JSON: readers take it from the signed manifest instead of
            # unpickling .metadata; a coordinator writes the global metadata from the parts'.
            extra = st.part_fields(meta, chunked)
            if not st.part:
                del extra["hashes"]
            write_manifest(tmp, step, st.world, ranks=st.ranks, known=writer.files, extra=extra)
            fsync_dir(tmp)
            if faults.maybe_inject(faults.Point.IN_FLUSH, 0, step):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            os.rename(tmp, out)
            fsync_dir(out.parent)
            result = ExportResult(
                out, step, st.world, _dir_bytes(out), len(st.shared), st.per_rank_tensors
            )
            log.info(
                "exported step %d of %d ranks to %s (%.1f MiB, %d shared tensors, %d per-rank; %s)",
                step,
                len(st.snaps),
                out,
                result.nbytes / 2**20,
                result.shared_tensors,
                result.per_rank_tensors,
                "O_DIRECT" if writer.used_direct else "buffered writes",
            )
            return result
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, FtmemError) and not isinstance(exc, ExportError):
            raise ExportError(f"cannot export step {step}: {exc}") from exc
        raise


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _load_checked(dcp_dir: Path) -> dict[str, Any]:
    """The whole state of a checkpoint of a tier, after checking it (owner, signature, every
    file's hash); nothing in it is unpickled (:func:`ftmem.tiers.dcp_read.load_whole`).

    Raises:
        CorruptSnapshotError, UnsafePathError: the checkpoint failed a check.
    """
    ckpt = read_checkpoint(dcp_dir)
    verify_checkpoint(ckpt)
    return load_whole(ckpt)


def _write_synced(out_file: Path, write: Any) -> None:
    """``write(path)`` to a temporary name beside ``out_file``, fsync, rename into place."""
    tmp = out_file.with_name(temp_name(out_file.name))
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, out_file)
    finally:
        tmp.unlink(missing_ok=True)


def to_torch_save(dcp_dir: Path, out_file: Path) -> None:
    """Convert a checkpoint of a tier to one ``torch.save`` file (what stock
    ``dcp_to_torch_save`` writes), once checked (:func:`_load_checked`, whose errors it raises).
    """
    whole = _load_checked(dcp_dir)
    _write_synced(out_file, lambda path: torch.save(whole, path))


def to_safetensors(dcp_dir: Path, out_file: Path) -> int:
    """Convert a DCP directory to one safetensors file; return the number of tensors.

    Nested keys are joined with ``.`` (as DCP names them); values that are not tensors (an
    optimizer's hyper-parameters, ``ftmem_meta``) go into the file's metadata as JSON under
    ``ftmem.objects``. Needs the ``safetensors`` package (``pip install safetensors``).

    Raises:
        ExportError: safetensors is not installed.
        CorruptSnapshotError, UnsafePathError: the checkpoint failed a check.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ExportError(
            "--safetensors needs the safetensors package: pip install safetensors"
        ) from exc

    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    _flatten_into(_load_checked(dcp_dir), "", tensors, objects)
    meta = {"ftmem.objects": json.dumps(objects, default=repr)}
    _write_synced(out_file, lambda path: save_file(tensors, str(path), metadata=meta))
    return len(tensors)


def _flatten_into(
    value: Any, key: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]
) -> None:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().contiguous().clone()  # safetensors refuses shared storage
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(v, f"{key}.{k}" if key else str(k), tensors, objects)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _flatten_into(v, f"{key}.{i}" if key else str(i), tensors, objects)
    else:
        objects[key] = value
