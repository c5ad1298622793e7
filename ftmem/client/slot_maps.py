"""The rank's mappings of its slot files, and staging one save into a slot.

The SMP makes (and replaces) the slot files; a rank maps each one once and keeps, per
mapping, its views of every tensor of the current layout, so that a save whose state did
not change shape only copies. :func:`stage` copies a save's eager part into a slot and
returns the job that copies the rest in the background.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from ftmem._logging import get_logger
from ftmem.client.flatten import Flat
from ftmem.client.planner import CopyPlan, Placement
from ftmem.client.staging import (
    CopyJob,
    copy_into,
    register_pinned,
    slot_views,
    start_cuda_copies,
    unregister_pinned,
)
from ftmem.config import default_shm_dir
from ftmem.errors import UnsafePathError
from ftmem.protocol import messages as m
from ftmem.shm import GRANT_READY, MappedSegment, map_board

log = get_logger(__name__)


class SlotMappings:
    """The slot files this rank has mapped, and each mapping's views of the tensors.

    Resource handling: a mapping is closed when the SMP replaced its file (seen at the
    next :meth:`segment`) and by :meth:`close`. :meth:`segment` is called from the
    training thread and the copy thread: a lock guards the table of mappings but is never
    held while a file is mapped (seconds for a new slot of GiBs, which the copy thread maps
    after a COMMIT): a caller that needs the file another thread is mapping waits for that
    one, any other goes on. The grant board has a lock of its own.
    """

    def __init__(self) -> None:
        self.shm_dir = default_shm_dir()
        """Where the SMP makes the slot files (its HELLO reply says). Every mapping checks
        that the file lies directly in it and that it is this user's directory with mode
        0700 (:func:`ftmem.shm.check_slot_path`)."""
        self._segments: dict[str, MappedSegment] = {}
        self._views: dict[int, tuple[Placement, list[torch.Tensor]]] = {}
        """id of a slot mapping -> (the layout, that slot's views of every tensor); dropped
        when the mapping is closed (holding the layout keeps its identity unique)."""
        self._board: tuple[str, mmap.mmap] | None = None
        self._lock = threading.Lock()
        self._mapping: dict[str, threading.Event] = {}
        """Files being mapped now (outside the lock) -> set when that is over."""
        self._board_lock = threading.Lock()

    def grant_ready(self, grant: m.BeginReply) -> bool:
        """Whether the slot of ``grant`` may be written now: always for an unconditional
        grant; for a conditional one, once the SMP's grant board says so (a byte read from
        a read-only mapping, made at the first conditional grant; see
        :class:`ftmem.shm.GrantBoard`). A board that cannot be mapped (not a grant board in
        this user's private directory, or gone) is logged and counts as not ready: the save
        asks with a BEGIN, as without a grant."""
        if not grant.board:
            return True
        with self._board_lock:
            if self._board is None or self._board[0] != grant.board:
                if self._board is not None:
                    self._board[1].close()
                    self._board = None
                try:
                    self._board = (grant.board, map_board(Path(grant.board), self.shm_dir))
                except (OSError, ValueError, UnsafePathError) as exc:
                    log.warning("not using the SMP's grant board: %s", exc)
                    return False
            board = self._board[1]
        return 0 <= grant.cell < len(board) and board[grant.cell] == GRANT_READY

    def segment(self, path: str, capacity: int) -> MappedSegment:
        """The mapping of the slot file ``path`` of ``capacity`` bytes (mapped now if new).

        Raises:
            UnsafePathError: the shared-memory directory or the file is not this user's
                private one (nothing is mapped).
            ValueError: ``path`` is not a slot file in :attr:`shm_dir`, or has another size.
        """
        while True:
            with self._lock:
                seg = self._segments.get(path)
                if seg is not None and seg.nbytes == capacity:
                    return seg
                busy = self._mapping.get(path)
                if busy is None:
                    done = self._mapping[path] = threading.Event()
                    break
            busy.wait()  # another thread maps this file: use its mapping (or map it anew)
        try:
            seg = MappedSegment(Path(path), capacity, self.shm_dir)
        finally:
            with self._lock:
                del self._mapping[path]
            done.set()
        gone: list[MappedSegment] = []
        with self._lock:
            self._segments[path] = seg
            # Forget mappings of files the SMP replaced (one live file per slot).
            for old in [p for p in self._segments if p != path and not os.path.exists(p)]:
                if old not in self._mapping:
                    gone.append(self._segments.pop(old))
                    self._views.pop(id(gone[-1]), None)
        for g in gone:
            unregister_pinned(g)
            g.close()
        return seg

    def prepare(self, path: str, capacity: int) -> MappedSegment:
        """:meth:`segment`, and when this process uses CUDA, page-lock the mapping too
        (cudaHostRegister takes about as long as copying the slot, which the first save into
        the slot otherwise paid on the training thread). The copy thread prepares each slot
        the SMP makes or grants before a save needs it."""
        seg = self.segment(path, capacity)
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            register_pinned(seg)
        return seg

    def map_new(self, slots: list[m.SlotFile]) -> None:
        """:meth:`prepare` each slot the SMP just made (copy thread)."""
        for slot in slots:
            self.prepare(slot.path, slot.capacity)

    def views(self, seg: MappedSegment, layout: Placement) -> list[torch.Tensor]:
        """The views of every tensor of ``layout`` in the mapping ``seg`` (cached)."""
        cached = self._views.get(id(seg))
        if cached is None or cached[0] is not layout:
            cached = self._views[id(seg)] = (layout, slot_views(seg, layout))
        return cached[1]

    def close(self) -> None:
        """Drop every view and close every mapping."""
        self._views.clear()
        for seg in self._segments.values():
            unregister_pinned(seg)
            seg.close()
        self._segments.clear()
        if self._board is not None:
            self._board[1].close()
            self._board = None


def stage(
    flat: Flat,
    plan: CopyPlan,
    objects: bytes,
    seg: MappedSegment,
    views: list[torch.Tensor],
    *,
    rank: int,
    step: int,
    slot: int,
    gen: int,
) -> CopyJob:
    """Copy the eager part of a save into ``seg`` now (the skeleton's ``objects``, the eager
    tensors; the device tensors start on a side stream); return the job that copies the
    lazy part in the background and commits."""
    off = plan.layout.tensors_end
    seg.view[off : off + len(objects)] = objects
    tensors = flat.tensors
    copy_into([views[i] for i in plan.eager], [tensors[i] for i in plan.eager])
    job = CopyJob(
        rank=rank,
        step=step,
        slot=slot,
        gen=gen,
        seg=seg,
        layout=plan.layout,
        dsts=[views[i] for i in plan.lazy],
        srcs=[tensors[i] for i in plan.lazy],
        objects=(off, len(objects)),
    )
    if plan.cuda or plan.cuda_lazy:
        register_pinned(seg)
        job.cuda_event = start_cuda_copies(
            ([views[i] for i in plan.cuda], [tensors[i] for i in plan.cuda]),
            ([views[i] for i in plan.cuda_lazy], [tensors[i] for i in plan.cuda_lazy]),
        )
    return job
