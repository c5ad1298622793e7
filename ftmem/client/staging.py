"""The lazy asynchronous copy into a slot, and the fence.

The rank only moves bytes (the SMP hashes a slot after its COMMIT, :mod:`ftmem.smp.hashing`).
The :class:`CopyWorker` thread copies the lazily copied tensors (parameters and optimizer
state) with :func:`copy_into`, then commits the snapshot over its own socket; it also runs the
rank's other background requests (:class:`PrepareJob`, :class:`SkipNotice`). The fence is
:attr:`CopyJob.copied`. Device tensors are copied with ``non_blocking=True`` on a side stream
into the slot's page-locked memory (:func:`start_cuda_copies`); the worker waits on an event.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.client.planner import Placement
from ftmem.errors import ErrorKind, FtmemError, SmpRequestError
from ftmem.format.tensors import torch_dtype
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.shm import MappedSegment

log = get_logger(__name__)

BATCH_BYTES = 64 << 20
"""Bytes moved per ``_foreach_copy_`` call (fault points and cancellation are checked between)."""


def slot_views(seg: MappedSegment, layout: Placement) -> list[torch.Tensor]:
    """Views of ``seg`` shaped like each tensor of ``layout`` (made once per slot and layout)."""
    out = []
    for e in layout.extents:
        raw = seg.tensor[e.offset : e.offset + e.nbytes]
        out.append(raw.view(torch_dtype(e.dtype)).view(e.shape))
    return out


def copy_into(
    dsts: Sequence[torch.Tensor],
    srcs: Sequence[torch.Tensor],
    between: Callable[[], None] | None = None,
    batch_bytes: int = BATCH_BYTES,
) -> None:
    """Copy every ``srcs[i]`` into ``dsts[i]`` in batches of about ``batch_bytes``;
    ``between`` runs before each batch (a fault point, a cancellation check)."""
    i, n = 0, len(srcs)
    while i < n:
        if between is not None:
            between()
        j, size = i, 0
        while j < n and (j == i or size + srcs[j].nbytes <= batch_bytes):
            size += srcs[j].nbytes
            j += 1
        torch._foreach_copy_(list(dsts[i:j]), list(srcs[i:j]))
        i = j


@dataclass(eq=False)
class CopyJob:
    """One snapshot being written: what to copy, where, and how it ends."""

    rank: int
    step: int
    slot: int
    gen: int
    seg: MappedSegment
    layout: Placement
    dsts: list[torch.Tensor]
    """The slot's views of the lazily copied CPU tensors."""
    srcs: list[torch.Tensor]
    """The lazily copied CPU tensors, largest first."""
    objects: tuple[int, int]
    """(offset, nbytes) of the encoded skeleton in the slot."""
    next_nbytes: int = 0
    """Ask the SMP (with the COMMIT) for a slot of this many bytes for the next save."""
    grant: m.BeginReply | None = None
    """The SMP's answer to ``next_nbytes`` (set when the commit succeeded)."""
    premap: Callable[[str, int], Any] | None = None
    """Maps a granted slot file (path, capacity): called by the copy thread once the job is
    finished, so that a new slot is never mapped (and page-locked) on the training thread."""
    stall_s: float = 0.0
    skipped: int = 0
    unsharded_nbytes: int = 0
    """What this rank would hold without sharding (0: not sharded)."""
    cuda_event: Any = None
    copied: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    premapped: threading.Event = field(default_factory=threading.Event)
    """Set once ``premap`` ran (or was not needed), whether or not it succeeded."""
    error: BaseException | None = None
    copy_s: float = 0.0
    cancelled: bool = False
    """Set by the fence when it gave up waiting: the copy may be torn, so it must not commit."""


@dataclass(eq=False)
class PrepareJob:
    """Grow this rank's free slots to ``nbytes`` (the SMP allocates and pre-faults them), then
    map them with ``on_slots`` (off the training thread)."""

    rank: int
    nbytes: int
    timeout: timedelta
    on_slots: Callable[[list[m.SlotFile]], None]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass(frozen=True)
class SkipNotice:
    """A snapshot the rank skipped on its own: told to the SMP (counted per reason)."""

    rank: int
    step: int
    reason: str


class _CommitError(FtmemError):
    """The copy finished but the commit failed (the sources are free to change)."""


Work = CopyJob | PrepareJob | SkipNotice


class CopyWorker:
    """The background thread that copies and commits snapshots, one job at a time, and runs
    the rank's other background requests in order.

    Resource handling: owns a thread ("ftmem-copy") and that thread's own SmpClient.
    :meth:`close` finishes the queued work (bounded) and stops the thread with a sentinel.
    """

    def __init__(self, run_dir: Any, timeout: timedelta) -> None:
        self._registered: set[int] = set()
        """Layout ids this worker registered with the SMP (sent with their first commit)."""
        self._run_dir = run_dir
        self._timeout = timeout
        self._q: queue.Queue[Work | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ftmem-copy", daemon=True)
        self._thread.start()

    def submit(self, job: Work) -> None:
        """Queue ``job``: a copy to do and commit, slots to prepare, or a skip to report."""
        self._q.put(job)

    def close(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Stop after the queued jobs (idempotent)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout.total_seconds())

    def _run(self) -> None:
        client: SmpClient | None = None
        try:
            while True:
                job = self._q.get()
                if job is None:
                    return
                if client is None:
                    try:
                        client = SmpClient(self._run_dir, self._timeout)
                    except FtmemError as exc:
                        _fail(job, exc)
                        continue
                if isinstance(job, CopyJob):
                    self._do(job, client)
                elif isinstance(job, PrepareJob):
                    self._prepare(job, client)
                else:
                    try:
                        client.request(m.Skipped(rank=job.rank, step=job.step, reason=job.reason))
                    except FtmemError as exc:
                        log.debug("skip notice not delivered: %s", exc)
        finally:
            if client is not None:
                client.close()

    @staticmethod
    def _prepare(job: PrepareJob, client: SmpClient) -> None:
        try:
            made = client.call(
                m.Prepare(rank=job.rank, slot=-1, nbytes=job.nbytes), timeout=job.timeout
            )
            job.on_slots(made.slots)
        except (FtmemError, OSError, ValueError) as exc:
            log.error("allocating slots of %d bytes failed: %s", job.nbytes, exc)
            job.error = exc
        finally:
            job.done.set()

    def _do(self, job: CopyJob, client: SmpClient) -> None:
        t0 = time.perf_counter()
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()

            def fault_point() -> None:
                faults.maybe_inject(faults.Point.IN_COPY, job.rank, job.step)

            copy_into(job.dsts, job.srcs, fault_point)
            job.copy_s = time.perf_counter() - t0
        except BaseException as exc:  # report the failure to the training thread, keep serving
            log.error("copy of step %d failed: %s", job.step, exc)
            job.error = exc
        job.copied.set()
        if job.error is None and job.cancelled:
            job.error = FtmemError(f"copy of step {job.step} was abandoned at the fence")
        if job.error is not None:
            self._abort(job, client)
            job.finished.set()
            return
        faults.maybe_inject(faults.Point.BEFORE_COMMIT, job.rank, job.step)
        try:
            job.grant = self._commit(job, client)
        except FtmemError as exc:
            log.error("commit of step %d failed: %s", job.step, exc)
            job.error = _CommitError(str(exc))
        finally:
            job.finished.set()
        grant = job.grant
        if grant is not None and grant.action is m.Decision.WRITE and job.premap is not None:
            try:
                job.premap(grant.path, grant.capacity)
            except (OSError, ValueError, FtmemError) as exc:  # the save that uses it says why
                log.warning("cannot map the slot granted after step %d: %s", job.step, exc)
        job.premapped.set()

    def _commit(self, job: CopyJob, client: SmpClient) -> m.BeginReply:
        """COMMIT ``job``, naming its layout by id (sent along the first time, and again
        if the SMP no longer holds it); the reply grants the next save its slot."""
        lid = job.layout.id

        def commit(register: bool) -> m.BeginReply:
            return client.call(
                m.Commit(
                    rank=job.rank,
                    slot=job.slot,
                    gen=job.gen,
                    step=job.step,
                    layout_id=lid,
                    objects_offset=job.objects[0],
                    objects_nbytes=job.objects[1],
                    layout=job.layout.tensors_json if register else "",
                    unsharded_nbytes=job.unsharded_nbytes,
                    next_nbytes=job.next_nbytes,
                    stall_s=job.stall_s,
                    copy_s=job.copy_s,
                    skipped=job.skipped,
                )
            )

        if lid in self._registered:
            try:
                return commit(False)
            except SmpRequestError as exc:
                if exc.kind is not ErrorKind.UNKNOWN_LAYOUT:
                    raise
                self._registered.discard(lid)  # a restarted SMP, or it forgot the oldest
        reply = commit(True)
        self._registered.add(lid)
        return reply

    @staticmethod
    def _abort(job: CopyJob, client: SmpClient) -> None:
        try:
            client.request(m.Abort(rank=job.rank, slot=job.slot, gen=job.gen))
        except FtmemError as exc:
            log.warning("abort of slot %d failed: %s", job.slot, exc)


def _fail(job: Work, exc: BaseException) -> None:
    """The worker could not reach the SMP: end ``job`` with ``exc``."""
    if isinstance(job, CopyJob):
        job.error = exc
        job.copied.set()
        job.finished.set()
    elif isinstance(job, PrepareJob):
        job.error = exc
        job.done.set()


def start_cuda_copies(
    eager: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    lazy: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
) -> Any:
    """Enqueue device->host copies of CUDA tensors on a side stream; return the event that
    marks their end. ``eager`` and ``lazy`` are (slot views, device tensors).

    The ``eager`` tensors (buffers such as BatchNorm statistics, which the next forward pass
    changes) are copied first, and the current stream waits for them on the device (no CPU
    wait): work queued after ``save`` cannot change them before they are copied. The
    ``lazy`` ones (parameters, optimizer state) are fenced by the optimizer pre-hook, which
    waits for the returned event. The destination is the slot's shared memory, which must be
    page-locked (see :func:`register_pinned`) for the copy to be truly asynchronous.
    """
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for dst, src in zip(*eager, strict=True):
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
        if eager[0]:
            eager_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            eager_done.record(stream)
            current.wait_event(eager_done)
        for dst, src in zip(*lazy, strict=True):
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    return event


_pinned: dict[int, int] = {}
"""id of a page-locked MappedSegment -> the registered address."""
_pin_lock = threading.Lock()
"""Held while a mapping is page-locked (the copy thread and the training thread may both ask
for the same one; the second waits, then finds it done)."""


def register_pinned(seg: MappedSegment) -> None:
    """Page-lock a slot mapping once (cudaHostRegister) so D2H copies into it are async."""
    if not torch.cuda.is_available() or id(seg) in _pinned:
        return
    with _pin_lock:
        if id(seg) in _pinned:
            return
        ptr = seg.tensor.data_ptr()
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(ptr, seg.nbytes, 0)
        if int(err) != 0:
            log.warning(
                "cudaHostRegister of %s failed (%s); copies will be synchronous", seg.path, err
            )
            return
        _pinned[id(seg)] = ptr


def unregister_pinned(seg: MappedSegment) -> None:
    """Undo :func:`register_pinned` (before the mapping goes away); no-op if not pinned."""
    with _pin_lock:
        ptr = _pinned.pop(id(seg), None)
    if ptr is None:
        return
    torch.cuda.synchronize()  # no copy into it may still be in flight
    err = torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]
    if int(err) != 0:
        log.warning("cudaHostUnregister of %s failed (%s)", seg.path, err)
