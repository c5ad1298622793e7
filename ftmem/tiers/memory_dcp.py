"""A step held in SMP memory as a DCP checkpoint: ``dcp.load`` reshards it to any world size
without a byte on disk.

:class:`MemoryCheckpoint` maps the ranks' committed slots of one step read-only, checks every
tensor it will serve against the slot's checksums, and plans the step exactly as the disk
export does (:func:`ftmem.tiers.export.step_state`: the same state, saved through DCP's own
planner into a writer that keeps references instead of writing files, the same metadata, chunks
described as DCP describes a sharded tensor). Its :meth:`~MemoryCheckpoint.reader` then serves
DCP's load planner from the mapped bytes. So::

    with MemoryCheckpoint(find_sources([run_dir])) as ckpt:
        dcp.load({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_reader=ckpt.reader())

fills the state at this process's world size as ``dcp.load`` of the flushed checkpoint of the
same step would, bit for bit: DCP's planners do the resharding.

Limits: every process that reads maps the slots itself, so today they must be on its host (the
SMPs of this machine); the slots must not be reused meanwhile (the ranks that own them are
stopped, or the step is pinned).
"""

from __future__ import annotations

import io
import warnings
from contextlib import ExitStack
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import digest
from ftmem.tiers.export import ExportError, RankSource, StepState, step_state

__all__ = ["MemoryCheckpoint"]


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class _Capture(StorageWriter):
    """A StorageWriter that keeps what DCP's save planner hands it: each tensor (a view of a
    slot) or byte string, by its metadata index."""

    def __init__(self) -> None:
        super().__init__()
        self.items: dict[MetadataIndex, torch.Tensor | bytes] = {}
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one capture per checkpoint."""

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
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            kept: torch.Tensor | bytes
            if isinstance(data, torch.Tensor):
                kept = data.detach()
                size = kept.numel() * kept.element_size()
            else:  # BYTE_IO: what DCP serialized of a non-tensor value, in this process
                kept = data.getvalue()
                size = len(kept)
            self.items[item.index] = kept
            results.append(
                WriteResult(index=item.index, size_in_bytes=size, storage_data=item.index)
            )
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Record where each entry's data is (its own index) in ``metadata``."""
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A capture has no checkpoint id."""
        return False


class _Reader(StorageReader):
    """DCP's StorageReader over a capture: each read item is a narrow of a kept tensor."""

    def __init__(self, metadata: Metadata, items: dict[MetadataIndex, torch.Tensor | bytes]):
        super().__init__()
        self.metadata = metadata
        self.items = items
        self.storage_data: dict[MetadataIndex, Any] = dict(metadata.storage_data or {})

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The step's metadata (as the disk export's ``.metadata`` would hold it)."""
        return self.metadata

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
        """Copy each requested extent of a kept tensor into the planner's target."""
        for req in plan.items:
            src = self.items.get(self.storage_data.get(req.storage_index))  # type: ignore[arg-type]
            if src is None:
                raise ExportError(f"the step in memory has no entry {req.storage_index}")
            if isinstance(src, bytes):
                planner.load_bytes(req, io.BytesIO(src))
                continue
            view = src
            for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                view = view.narrow(dim, off, n)
            target = planner.resolve_tensor(req).detach()
            if target.size() != view.size():
                raise ExportError(
                    f"{req.dest_index.fqn}: {tuple(view.size())} in memory, "
                    f"{tuple(target.size())} asked for"
                )
            target.copy_(view)
            planner.commit_tensor(req, target)
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A step in memory has no checkpoint id."""
        return False


def _verify(st: StepState, items: dict[MetadataIndex, torch.Tensor | bytes]) -> None:
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


class MemoryCheckpoint:
    """One step of ``sources`` (every rank's committed slot of it) as a DCP checkpoint in
    memory (see the module docstring).

    Resource handling: holds the slots mapped until :meth:`close` (or the ``with`` block's
    end); every tensor it served was copied out, so nothing refers to the slots afterwards.

    Raises (at construction):
        ExportError: ranks missing or at different steps.
        CorruptSnapshotError: a slot's layout, objects or tensors fail their checks.
    """

    def __init__(self, sources: list[RankSource], world_size: int | None = None) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        self._stack = ExitStack()
        try:
            st = self._stack.enter_context(step_state(sources, world_size))
            capture = _Capture()
            with warnings.catch_warnings():
                # DCP warns that it saves in one process: that is what no_dist asks for.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_save(st.state, storage_writer=capture, no_dist=True)
            assert capture.metadata is not None
            st.add_chunks(capture.metadata)
            st.check_names(capture.metadata)
            _verify(st, capture.items)
        except BaseException:
            self._stack.close()
            raise
        self.step = st.step
        self.world_size = st.world
        self.metadata: Metadata = capture.metadata
        self._items = capture.items
        self._stack.callback(self._items.clear)

    def reader(self) -> StorageReader:
        """A StorageReader for ``dcp.load(..., storage_reader=...)`` over this step."""
        return _Reader(self.metadata, self._items)

    def close(self) -> None:
        """Drop every reference to the slots and unmap them (idempotent)."""
        self._stack.close()

    def __enter__(self) -> MemoryCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
