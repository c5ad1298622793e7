"""HashService: the SMP checksums committed slots, so the training process only moves bytes.

A rank commits a snapshot as soon as its copy is done, with a layout that has no checksums.
The SMP then maps the slot read-only and hashes every extent (xxh3-64) on this service's
threads: one coordinator thread takes slots in commit order and hashes their extents on a
pool of ``threads`` threads, piece by piece (``HASH_PIECE``; python-xxhash releases the GIL,
so the loop thread that serves the ranks keeps answering). The result goes back to the loop thread through a queue; the
loop fills the checksums into the layout and the snapshot becomes *verified*.

Resource handling: :meth:`close` stops the coordinator with a sentinel and shuts the pool
down (bounded); a job in progress finishes first.

Error handling: a slot that cannot be read (removed, truncated) yields a result with
``error`` set; the loop drops that snapshot. Nothing raises out of the threads.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ftmem import faults, shm
from ftmem._logging import get_logger
from ftmem.format.layout import StoredSnapshot, hash_bytes, pieces, with_hashes

log = get_logger(__name__)

HASH_NICE = 10
"""Niceness of the hashing threads: where the ranks keep every core busy (a CPU-only node
like ours, where a rank's ``save()`` was seen taking 2-3x longer while the SMP hashed), the
training should win; the hash then finishes later, which loads wait for. (The effect was
within this machine's noise in a quick A/B; the choice stands on the reasoning.)"""


def _lower_priority() -> None:
    """Lower this thread's scheduling priority (Linux niceness is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASH_NICE)
    except (OSError, AttributeError) as exc:  # not Linux, or not allowed: keep going
        log.debug("cannot lower the hashing thread's priority: %s", exc)


@dataclass(frozen=True, slots=True)
class HashJob:
    """One committed slot to checksum."""

    rank: int
    slot: int
    gen: int
    step: int
    path: str
    layout: str
    snap: StoredSnapshot
    """``layout`` as the SMP parsed and checked it against the slot (once, at the commit)."""


@dataclass(frozen=True, slots=True)
class HashResult:
    """The checksummed layout of a job (``layout`` empty and ``error`` set if it failed);
    ``nbytes`` the bytes hashed."""

    job: HashJob
    layout: str
    seconds: float
    nbytes: int
    error: str = ""


class HashService:
    """Checksums committed slots off the SMP's loop thread (see the module docstring)."""

    def __init__(
        self, node: str, threads: int = 1, on_result: Callable[[], None] | None = None
    ) -> None:
        if threads < 1:
            raise ValueError(f"hash threads must be >= 1, got {threads}")
        self.node = node
        self.threads = threads
        self._on_result = on_result
        self._jobs: queue.Queue[HashJob | None] = queue.Queue()
        self._results: queue.Queue[HashResult] = queue.Queue()
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="ftmem-smp-hash")
            if threads > 1
            else None
        )
        self._idle = threading.Event()
        self._idle.set()
        self._queued = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ftmem-smp-hasher", daemon=True)
        self._closed = False

    def start(self) -> None:
        """Start the coordinator thread."""
        self._thread.start()

    def submit(self, job: HashJob) -> None:
        """Queue ``job``; its result shows up in :meth:`results`."""
        with self._count_lock:
            self._queued += 1
            self._idle.clear()
        self._jobs.put(job)

    def results(self) -> list[HashResult]:
        """The results finished since the last call (loop thread)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted job has a result; False on timeout."""
        return self._idle.wait(timeout_s)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._queued

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the job in progress (idempotent, bounded)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                result = self._hash(job)
            except Exception as exc:  # keep serving: one bad slot must not stop verification
                log.exception(
                    "[%s/smp] hashing rank %d step %d failed", self.node, job.rank, job.step
                )
                result = HashResult(job, "", 0.0, 0, f"{type(exc).__name__}: {exc}")
            self._results.put(result)
            with self._count_lock:
                self._queued -= 1
                if self._queued == 0:
                    self._idle.set()
            if self._on_result is not None:
                self._on_result()

    def _hash(self, job: HashJob) -> HashResult:
        t0 = time.perf_counter()
        snap = job.snap
        faults.maybe_inject(faults.Point.IN_HASH, job.rank, job.step)
        used = snap.used_bytes
        try:
            mm = shm.map_readonly(Path(job.path), max(1, used))
        except (OSError, ValueError) as exc:
            return HashResult(job, "", 0.0, 0, f"cannot map {job.path}: {exc}")
        try:
            view = memoryview(mm)
            try:
                extents = snap.extents()
                work = [
                    (k, off + a, off + b)
                    for k, (_, off, n, _) in enumerate(extents)
                    for a, b in pieces(n)
                ]

                def one(w: tuple[int, int, int]) -> str:
                    return hash_bytes(view[w[1] : w[2]])

                if self._pool is not None and len(work) > 1:
                    got = list(self._pool.map(one, work))
                else:
                    got = [one(w) for w in work]
            finally:
                view.release()
        finally:
            mm.close()
        parts: list[list[str]] = [[] for _ in extents]
        for (k, _, _), h in zip(work, got, strict=True):
            parts[k].append(h)
        digests = [".".join(p) for p in parts]
        layout = with_hashes(job.layout, digests[1:], digests[0])
        nbytes = sum(e[2] for e in extents)
        return HashResult(job, layout, time.perf_counter() - t0, nbytes)
