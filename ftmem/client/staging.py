"""The lazy asynchronous copy into a slot, its checksums, and the fence.

``copy_tensor`` moves one tensor into a slot in pieces and hashes each piece right after
copying it (the piece is still in cache). The :class:`CopyWorker` thread does this for
the lazily-copied tensors (parameters and optimizer state: only the optimizer mutates them)
and then commits the snapshot to the SMP over its own socket. :meth:`CopyJob.wait_copied`
is the fence: it blocks only while the copy is still running.

CUDA: device tensors are copied with ``non_blocking=True`` on a side stream into the
slot's page-locked memory (registered with cudaHostRegister once per mapping) and the
worker waits on an event before hashing. This path is kept small; CI runs on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import xxhash

from ftmem._logging import get_logger
from ftmem.client.flatten import Layout, layout_json
from ftmem.client.smp_client import SmpClient
from ftmem.errors import FtmemError
from ftmem.protocol import messages as m
from ftmem.shm import MappedSegment
from ftmem.testing import faults

log = get_logger(__name__)


def hash_bytes(view: memoryview) -> str:
    """Return the checksum (xxh3-64, hex) of ``view``."""
    return xxhash.xxh3_64_hexdigest(view)


def copy_tensor(src: torch.Tensor, seg: MappedSegment, offset: int, chunk: int) -> str:
    """Copy ``src`` (CPU) into ``seg`` at ``offset``; return the checksum of the copied bytes."""
    n = src.nbytes
    dst = seg.tensor[offset : offset + n]
    h = xxhash.xxh3_64()
    if src.is_contiguous() and n > 0:
        flat = src.reshape(-1).view(torch.uint8)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            dst[i:j].copy_(flat[i:j])
            h.update(seg.view[offset + i : offset + j])
    elif n > 0:
        dst.view(src.dtype).view(src.shape).copy_(src)
        h.update(seg.view[offset : offset + n])
    return h.hexdigest()


@dataclass(eq=False)
class CopyJob:
    """One snapshot being written: what to copy, where, and how it ends."""

    rank: int
    step: int
    slot: int
    gen: int
    seg: MappedSegment
    layout: Layout
    tensors: list[torch.Tensor]
    lazy: list[int]
    """Indices (into ``tensors``) copied by the worker, largest first."""
    hashes: list[str | None]
    objects: tuple[int, int, str]
    stall_s: float = 0.0
    skipped: int = 0
    unsharded_nbytes: int = 0
    """What this rank would hold without sharding (0: not sharded)."""
    chunk: int = 2 << 20
    cuda_event: Any = None
    copied: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    copy_s: float = 0.0
    cancelled: bool = False
    """Set by the fence when it gave up waiting: the copy may be torn, so it must not commit."""

    def wait_copied(self, timeout: float | None = None) -> None:
        """The fence: return once the source tensors may change; raise if the copy failed."""
        if not self.copied.wait(timeout):
            raise TimeoutError(f"copy of step {self.step} not done within {timeout} s")
        if self.error is not None and not isinstance(self.error, _CommitError):
            raise FtmemError(
                f"snapshot copy of step {self.step} failed: {self.error}"
            ) from self.error


class _CommitError(FtmemError):
    """The copy finished but the commit failed (the sources are free to change)."""


class CopyWorker:
    """The background thread that copies, hashes and commits snapshots, one job at a time.

    Resource handling: owns a thread ("ftmem-copy") and that thread's own SmpClient.
    :meth:`close` finishes the queued jobs (bounded) and stops the thread with a sentinel.
    """

    def __init__(self, run_dir: Any, timeout: timedelta) -> None:
        self._run_dir = run_dir
        self._timeout = timeout
        self._q: queue.Queue[CopyJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ftmem-copy", daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> None:
        """Queue ``job``; the worker copies its lazy tensors and commits it."""
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
                        job.error = exc
                        job.copied.set()
                        job.finished.set()
                        continue
                self._do(job, client)
        finally:
            if client is not None:
                client.close()

    def _do(self, job: CopyJob, client: SmpClient) -> None:
        t0 = time.perf_counter()
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            extents = job.layout.extents
            for i in job.lazy:
                faults.maybe_inject(faults.Point.IN_COPY, job.rank, job.step)
                t = job.tensors[i]
                if t.device.type == "cpu":
                    job.hashes[i] = copy_tensor(t, job.seg, extents[i].offset, job.chunk)
                else:  # already moved by the side stream; hash what landed
                    e = extents[i]
                    job.hashes[i] = hash_bytes(job.seg.view[e.offset : e.offset + e.nbytes])
        except BaseException as exc:  # report the failure to the training thread, keep serving
            log.error("copy of step %d failed: %s", job.step, exc)
            job.error = exc
            job.copied.set()
            self._abort(job, client)
            job.finished.set()
            return
        job.copy_s = time.perf_counter() - t0
        job.copied.set()
        if job.cancelled:
            job.error = FtmemError(f"copy of step {job.step} was abandoned at the fence")
            self._abort(job, client)
            job.finished.set()
            return
        faults.maybe_inject(faults.Point.BEFORE_COMMIT, job.rank, job.step)
        try:
            text = layout_json(
                job.layout,
                job.step,
                [h or "" for h in job.hashes],
                job.objects,
                job.unsharded_nbytes,
            )
            client.request(
                m.Commit(
                    rank=job.rank,
                    slot=job.slot,
                    gen=job.gen,
                    step=job.step,
                    layout=text,
                    stall_s=job.stall_s,
                    copy_s=job.copy_s,
                    skipped=job.skipped,
                )
            )
        except FtmemError as exc:
            log.error("commit of step %d failed: %s", job.step, exc)
            job.error = _CommitError(str(exc))
        finally:
            job.finished.set()

    @staticmethod
    def _abort(job: CopyJob, client: SmpClient) -> None:
        try:
            client.request(m.Abort(rank=job.rank, slot=job.slot, gen=job.gen))
        except FtmemError as exc:
            log.warning("abort of slot %d failed: %s", job.slot, exc)


def start_cuda_copies(job: CopyJob, cuda_indices: list[int]) -> None:
    """Enqueue device->host copies of CUDA tensors on a side stream; record ``job.cuda_event``.

    The destination is the slot's shared memory, which must be page-locked
    (see :func:`register_pinned`) for the copy to be truly asynchronous.
    """
    if not cuda_indices:
        return
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in cuda_indices:
            src = job.tensors[i]
            e = job.layout.extents[i]
            dst = job.seg.tensor[e.offset : e.offset + e.nbytes].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
    job.cuda_event = event


_pinned: set[int] = set()


def register_pinned(seg: MappedSegment) -> None:
    """Page-lock a slot mapping once (cudaHostRegister) so D2H copies into it are async."""
    if not torch.cuda.is_available() or id(seg) in _pinned:
        return
    ptr = seg.tensor.data_ptr()
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    err = cudart.cudaHostRegister(ptr, seg.nbytes, 0)
    if int(err) != 0:
        log.warning("cudaHostRegister of %s failed (%s); copies will be synchronous", seg.path, err)
        return
    _pinned.add(id(seg))
