"""A step held in SMP memory as a DCP checkpoint: ``dcp.load`` reshards it to any world size
without a byte on disk, across hosts (docs/api.md, "A step in memory as a DCP checkpoint").

:class:`MemoryCheckpoint` maps this host's committed slots of the step read-only and plans
them as a node's flush does (:func:`ftmem.tiers.export.step_state`, saved through DCP's own
planner into a writer that keeps references instead of writing files): a *part*. The
processes exchange their parts' metadata (JSON; nothing unpickled) and merge it as the disk
tier assembles a multi-node checkpoint (:func:`ftmem.tiers.assemble.merge_parts`). Its
:meth:`~MemoryCheckpoint.reader` serves DCP's load planner: extents this host holds are copied
from the slots, the others come in one ``all_to_all`` over the group from a process that
holds them. Every process of ``group`` must open one for the same step and load together.
The slots must not be reused meanwhile; non-tensor values from another process are read with
``weights_only``.
"""

from __future__ import annotations

import io
import itertools
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import digest
from ftmem.tiers.assemble import Part, merge_parts, part_prefix
from ftmem.tiers.checkpoints import Checkpoint
from ftmem.tiers.dcp_meta import metadata_from_json
from ftmem.tiers.export import ExportError, RankSource, StepState, step_state

__all__ = ["MemoryCheckpoint", "all_gather_json"]

Kept = torch.Tensor | bytes
"""A captured entry: a tensor (a view of a slot) or a non-tensor value's bytes."""


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class _Capture(StorageWriter):
    """A StorageWriter that keeps what DCP's save planner hands it, each tensor (a view of a
    slot) or byte string under an entry name of its own (``relative_path``)."""

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[str, Kept] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one capture per step."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans as DCP made them."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Keep a reference to each item's data (no copy of a tensor)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            kept: Kept
            if isinstance(data, torch.Tensor):
                kept = data.detach()
                size = kept.numel() * kept.element_size()
            else:  # BYTE_IO: what DCP serialized of a non-tensor value, in this process
                kept = data.getvalue()
                size = len(kept)
            name = str(len(self.items))
            self.items[name] = kept
            info = _StorageInfo(name, 0, size)
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=info))
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Record where each entry's data is in ``metadata`` (what ``dcp.save`` returns)."""
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A capture has no checkpoint id."""
        return False


def _verify(st: StepState, items: dict[str, Kept]) -> None:
    """Check every kept tensor that lies in a slot against the slot's checksums."""
    for data in items.values():
        if not isinstance(data, torch.Tensor) or data.nbytes == 0:
            continue
        want = st.expected.get(data.data_ptr())
        if want is None:
            continue  # made here (the skeleton's bytes, the names): not a slot's
        if not want:
            raise CorruptSnapshotError("a slot of the step has not been verified by its SMP")
        raw = data.reshape(-1).view(torch.uint8).numpy()
        if digest(raw.data) != want:
            raise CorruptSnapshotError("a tensor of the step in memory fails its checksum")


MAX_GATHERED_JSON = 256 << 20
"""Most bytes of one process's JSON (a part's metadata, a list of extents) the others take."""


def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """Every process's ``obj`` (JSON), gathered over ``group`` as bytes.

    Raises:
        ExportError: a process's JSON is larger than :data:`MAX_GATHERED_JSON` (checked on
            every process before anything is allocated for it).
    """
    data = json.dumps(obj).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    most = max(int(s) for s in sizes)
    if most > MAX_GATHERED_JSON or min(int(s) for s in sizes) < 0:
        raise ExportError(f"a process sent {most} bytes of metadata (at most {MAX_GATHERED_JSON})")
    buf = torch.zeros(most, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(bufs, sizes, strict=True)]


class _Reader(StorageReader):
    """DCP's StorageReader over the merged parts (see the module docstring)."""

    def __init__(self, ckpt: MemoryCheckpoint) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.storage_data: dict[Any, Any] = dict(ckpt.metadata.storage_data or {})

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's merged metadata (as the assembled flush's ``.metadata`` would hold it)."""
        return self.ckpt.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the storage map of the metadata DCP settled on (the coordinator's)."""
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as DCP made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Serve each request from this host's slots, or from another process's (collective:
        every process of the group calls it once)."""
        local: list[tuple[ReadItem, str]] = []
        remote: list[tuple[ReadItem, str]] = []
        for req in plan.items:
            path = self.storage_data[req.storage_index].relative_path
            (local if path in self.ckpt.items else remote).append((req, path))
        for req, path in local:
            src = self.ckpt.items[path]
            if isinstance(src, torch.Tensor):
                src = _narrow(src, req.storage_offsets, req.lengths)
            _deliver(planner, req, src)
        if self.ckpt.group is not None:
            self._exchange(planner, remote)
        elif remote:
            raise ExportError(f"{len(remote)} extents of the step are not in this host's memory")
        return _done(None)

    def _exchange(self, planner: LoadPlanner, remote: list[tuple[ReadItem, str]]) -> None:
        """Fetch ``remote`` from the processes that hold them, in one all_to_all; send what
        the others asked of this process in the same call."""
        ck = self.ckpt
        needs = [[path, list(r.storage_offsets), list(r.lengths)] for r, path in remote]
        asked = all_gather_json(needs, ck.group)
        send: list[torch.Tensor] = []
        in_splits = []
        for wanted in asked:
            n = 0
            for path, offsets, lengths in wanted:
                if ck.holder(path) != ck.rank:
                    continue
                src = ck.items[path]
                if isinstance(src, bytes):
                    piece = torch.frombuffer(bytearray(src), dtype=torch.uint8)
                else:
                    view = _narrow(src, offsets, lengths).contiguous()
                    piece = view.reshape(-1).view(torch.uint8)
                send.append(piece)
                n += piece.numel()
            in_splits.append(n)
        out_splits = [0] * len(asked)
        sizes = []
        for req, path in remote:
            nbytes = self._nbytes(req)
            out_splits[ck.holder(path)] += nbytes
            sizes.append(nbytes)
        inp = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8)
        out = torch.empty(sum(out_splits), dtype=torch.uint8)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=ck.group)
        pos = list(itertools.accumulate(out_splits, initial=0))
        for (req, path), nbytes in zip(remote, sizes, strict=True):
            server = ck.holder(path)
            piece = out[pos[server] : pos[server] + nbytes]
            pos[server] += nbytes
            if req.type == LoadItemType.BYTE_IO:
                _deliver(planner, req, bytes(piece.numpy()), foreign=True)
            else:
                dtype = ck.metadata.state_dict_metadata[req.storage_index.fqn].properties.dtype  # type: ignore[union-attr]
                if piece.storage_offset() % dtype.itemsize:  # after an odd-sized piece
                    piece = piece.clone()
                _deliver(planner, req, piece.view(dtype).reshape(req.lengths))

    def _nbytes(self, req: ReadItem) -> int:
        """Bytes of the extent ``req`` asks for (from the metadata)."""
        if req.type == LoadItemType.BYTE_IO:
            return int(self.storage_data[req.storage_index].length)
        entry = self.ckpt.metadata.state_dict_metadata[req.storage_index.fqn]
        return int(torch.Size(req.lengths).numel()) * entry.properties.dtype.itemsize  # type: ignore[union-attr]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A step in memory has no checkpoint id."""
        return False


def _narrow(src: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    view = src
    for dim, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        view = view.narrow(dim, int(off), int(n))
    return view


def _deliver(planner: LoadPlanner, req: ReadItem, src: Kept, *, foreign: bool = False) -> None:
    """Hand ``src`` (the extent asked for) to the planner: bytes through ``load_bytes``, a
    tensor copied into its target. ``foreign`` bytes were serialized by another process:
    read with ``weights_only`` and serialized again here before DCP's planner reads them."""
    if isinstance(src, bytes):
        if foreign:
            obj = torch.load(io.BytesIO(src), weights_only=True)
            buf = io.BytesIO()
            torch.save(obj, buf)
            src = buf.getvalue()
        planner.load_bytes(req, io.BytesIO(src))
        return
    target = planner.resolve_tensor(req).detach()
    if target.size() != src.size():
        raise ExportError(
            f"{req.dest_index.fqn}: {tuple(src.size())} in memory, {tuple(target.size())} asked for"
        )
    target.copy_(src)
    planner.commit_tensor(req, target)


class MemoryCheckpoint:
    """One step held in SMP memory as a DCP checkpoint (see the module docstring).

    ``sources``: the committed slots of the step on this host (one per rank; none on a host
    that holds nothing); ``world_size``: the world size the step was saved at (default: the
    number of sources, which must then be every rank); ``group``: the process group of the
    processes that load together (None: this process alone, holding every rank).

    Resource handling: holds the slots mapped until :meth:`close` (or the ``with`` block's
    end); every tensor it served was copied out, so nothing refers to the slots afterwards.

    Raises (at construction; with ``group``, collectively):
        ExportError: ranks missing, at different steps, or held by no process.
        CorruptSnapshotError: a slot's layout, objects or tensors fail their checks, or a
            part's metadata from another process is malformed.
    """

    def __init__(
        self, sources: list[RankSource], world_size: int | None = None, group: Any = None
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.items: dict[str, Kept] = {}
        self._stack = ExitStack()
        try:
            part = self._open_part(sources, world_size) if sources else None
            docs = all_gather_json(part, group) if group is not None else [part]
            parts = self._parts(docs)
            self.metadata: Metadata = metadata_from_json(merge_parts(parts))
        except BaseException:
            self.close()
            raise

    def _open_part(self, sources: list[RankSource], world_size: int | None) -> dict[str, Any]:
        """Map and check this host's slots; keep the captured entries; the part's JSON."""
        st = self._stack.enter_context(step_state(sources, world_size))
        capture = _Capture()
        meta, chunked = st.save(capture)
        _verify(st, capture.items)
        prefix = part_prefix(st.ranks[0])
        self.items = {f"{prefix}/{k}": v for k, v in capture.items.items()}
        self._stack.callback(self.items.clear)
        return {
            "step": st.step,
            "world": st.world,
            "ranks": st.ranks,
            **st.part_fields(meta, chunked),
        }

    def _parts(self, docs: list[Any]) -> list[Part]:
        """The distinct parts the processes hold, checked to cover every rank once; sets
        :attr:`step`, :attr:`world_size` and which process serves each part."""
        held = [(i, d) for i, d in enumerate(docs) if d is not None]
        if not held:
            raise ExportError("no process holds a slot of the step")
        try:
            steps = {int(d["step"]) for _, d in held}
            worlds = {int(d["world"]) for _, d in held}
            if len(steps) != 1 or len(worlds) != 1:
                raise ExportError(f"the processes hold steps {sorted(steps)} of worlds {worlds}")
            self.step, self.world_size = steps.pop(), worlds.pop()
            parts: dict[str, Part] = {}
            self.chunked: frozenset[str] = frozenset(str(n) for _, d in held for n in d["chunked"])
            """Tensors the step holds as chunks (sharded rows, DTensor shards)."""
            self._holders: dict[str, int] = {}
            for i, d in held:
                ranks = tuple(int(r) for r in d["ranks"])
                prefix = part_prefix(ranks[0])
                self._holders.setdefault(prefix, i)  # the lowest process that holds it
                if prefix in parts:
                    continue
                ckpt = Checkpoint(Path(prefix), self.step, self.world_size, 0, {}, ranks)
                parts[prefix] = Part.parse(ckpt, d["dcp"], d["hashes"], d["chunked"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptSnapshotError(f"malformed part metadata from a process: {exc!r}") from exc
        covered = sorted(r for p in parts.values() for r in p.ckpt.ranks)
        if covered != list(range(self.world_size)):
            raise ExportError(f"the step's ranks held in memory are {covered}, not 0..N-1")
        return list(parts.values())

    def holder(self, path: str) -> int:
        """The process (rank in the group) that serves entry ``path``."""
        server = self._holders.get(path.split("/", 1)[0])
        if server is None:
            raise ExportError(f"no process holds {path} of the step in memory")
        return server

    def reader(self) -> StorageReader:
        """A StorageReader for ``dcp.load(..., storage_reader=...)`` over this step."""
        return _Reader(self)

    def close(self) -> None:
        """Drop every reference to the slots and unmap them (idempotent)."""
        self._stack.close()

    def __enter__(self) -> MemoryCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
