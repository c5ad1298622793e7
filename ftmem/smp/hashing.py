"""HashService: the SMP checksums committed slots, so the training process only moves bytes.

A rank commits as soon as its copy is done, with a layout without checksums. A coordinator
thread takes the committed slots in order and hashes every extent (xxh3-64, piece by piece:
``HASH_PIECE``) on a pool of ``threads`` threads; python-xxhash releases the GIL, so the loop
thread keeps answering the ranks. The loop takes the results (:meth:`HashService.results`)
and fills the checksums into the layout: the snapshot is then *verified*.

Resource handling: the coordinator keeps each slot file mapped read-only for as long as that
file exists and reuses the mapping for later jobs of the slot (setting up a mapping's page
tables costs more than the hashing). Before each job it unmaps every cached file that is
gone or was replaced (one ``stat`` each). Only the coordinator touches the mappings, so they
need no lock. :meth:`close` stops it, shuts the pool down (bounded) and unmaps everything.

Error handling: a slot that cannot be read yields a result with ``error`` set (the loop drops
that snapshot); nothing raises out of the threads.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ftmem import faults, shm
from ftmem._logging import get_logger
from ftmem.format.layout import StoredSnapshot, hash_bytes, pieces
from ftmem.smp import drain

log = get_logger(__name__)

HASH_NICE = 10
"""Niceness of the hashing threads: where the ranks keep every core busy, training wins and
the hash (which loads wait for) finishes later."""


INLINE_BYTES = 256 << 10
"""Snapshots of at most this many bytes are hashed on the SMP's loop thread
(:meth:`HashService.submit`)."""


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
    snap: StoredSnapshot
    """The committed layout, checked against the slot (once, at the commit)."""


@dataclass(frozen=True, slots=True)
class HashResult:
    """The checksums of a job's extents (``digests``, ordered as
    :meth:`StoredSnapshot.extents`; empty and ``error`` set if it failed), of ``nbytes``."""

    job: HashJob
    digests: list[str]
    seconds: float
    nbytes: int
    error: str = ""


class HashService:
    """Checksums committed slots off the SMP's loop thread (see the module docstring)."""

    def __init__(self, node: str, threads: int = 1, inline_bytes: int = INLINE_BYTES) -> None:
        if threads < 1:
            raise ValueError(f"hash threads must be >= 1, got {threads}")
        self.node = node
        self.threads = threads
        self.inline_bytes = inline_bytes
        """Jobs of at most this many bytes are hashed on the submitting thread
        (:meth:`submit`)."""
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
        self._maps: dict[str, tuple[mmap.mmap, os.stat_result]] = {}
        """Slot file path -> its read-only mapping, kept while that file exists. Only the
        coordinator thread touches it (and :meth:`close` once the coordinator has stopped),
        so it has no lock."""
        self.maps_made = 0
        """Slot files mapped so far (a remap of a replaced file counts again)."""

    def start(self) -> None:
        """Start the coordinator thread."""
        self._thread.start()

    def submit(self, job: HashJob) -> None:
        """Queue ``job``; its result shows up in :meth:`results`. A job of at most
        :attr:`inline_bytes` is hashed at once on the calling (loop) thread while the
        coordinator is idle: the thread hand-off and the loop's next wake-up would cost more
        than the hash (the coordinator touches the mappings only while it has a job)."""
        with self._count_lock:
            inline = self._queued == 0 and job.snap.used_bytes <= self.inline_bytes
            if not inline:
                self._queued += 1
                self._idle.clear()
        if inline:
            self._results.put(self._checked(job))
        else:
            self._jobs.put(job)

    def results(self) -> list[HashResult]:
        """The results finished since the last call (loop thread)."""
        return drain(self._results)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted job has a result; False on timeout."""
        return self._idle.wait(timeout_s)

    @property
    def pending(self) -> int:
        """Jobs submitted and not finished."""
        return self._queued

    @property
    def mapped(self) -> list[str]:
        """The slot files mapped now, sorted (exact while idle; for tests and diagnostics)."""
        return sorted(self._maps.copy())

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the job in progress, then unmap every slot file (idempotent, bounded:
        a coordinator still busy after ``timeout_s`` keeps its mappings, which go with it)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            log.warning(
                "[%s/smp] the hasher is still busy after %.0f s; not unmapping its slots",
                self.node,
                timeout_s,
            )
        else:  # the coordinator has stopped (or never ran): its mappings are ours now
            self._unmap_all()

    def _mapping(self, path: str, need: int) -> mmap.mmap:
        """The read-only mapping of the whole slot file ``path``: the cached one, else mapped
        now (and cached). First unmaps every cached file that is gone or was replaced, this
        one included. Coordinator thread only.

        Raises:
            OSError: the file is missing.
            ValueError: the file is empty or shorter than ``need`` bytes.
        """
        self._prune()
        held = self._maps.get(path)
        if held is None:
            held = self._maps[path] = shm.map_readonly(path)
            self.maps_made += 1
        mm, st = held
        if st.st_size < need:
            raise ValueError(f"segment {path} has {st.st_size} bytes, fewer than {need}")
        return mm

    def _prune(self) -> None:
        """Unmap every cached slot file that no longer exists, or that another file (or
        size) replaced at its path: one ``stat`` each."""
        for path, (_, st) in list(self._maps.items()):
            try:
                now = os.stat(path, follow_symlinks=False)
                same = (now.st_dev, now.st_ino, now.st_size) == (st.st_dev, st.st_ino, st.st_size)
            except OSError:
                same = False
            if not same:
                self._unmap(path)

    def _unmap(self, path: str) -> None:
        """Forget the mapping of ``path`` and close it (if no view of it is left)."""
        held = self._maps.pop(path, None)
        if held is None:
            return
        try:
            held[0].close()
        except BufferError:  # a view outlived a failed job: unmapped when the last one goes
            log.debug("[%s/smp] %s still referenced; unmapped later", self.node, path)

    def _unmap_all(self) -> None:
        for path in list(self._maps):
            self._unmap(path)

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._results.put(self._checked(job))
            with self._count_lock:
                self._queued -= 1
                if self._queued == 0:
                    self._idle.set()

    def _checked(self, job: HashJob) -> HashResult:
        try:
            return self._hash(job)
        except Exception as exc:  # keep serving: one bad slot must not stop verification
            log.exception("[%s/smp] hashing rank %d step %d failed", self.node, job.rank, job.step)
            return HashResult(job, [], 0.0, 0, f"{type(exc).__name__}: {exc}")

    def _hash(self, job: HashJob) -> HashResult:
        t0 = time.perf_counter()
        snap = job.snap
        faults.maybe_inject(faults.Point.IN_HASH, job.rank, job.step)
        used = snap.used_bytes
        try:
            mm = self._mapping(job.path, max(1, used))
        except (OSError, ValueError) as exc:
            return HashResult(job, [], 0.0, 0, f"cannot map {job.path}: {exc}")
        view = memoryview(mm)  # the mapping stays: later jobs of this slot reuse it
        try:
            extents = snap.extents()
            work = [
                (k, off + a, off + b)
                for k, (_, off, n, _) in enumerate(extents)
                for a, b in pieces(n)
            ]

            def one(w: tuple[int, int, int]) -> str:
                return hash_bytes(view[w[1] : w[2]])

            if self._pool is not None and len(work) > 1 and used > self.inline_bytes:
                got = list(self._pool.map(one, work))
            else:
                got = [one(w) for w in work]
        finally:
            view.release()
        parts: list[list[str]] = [[] for _ in extents]
        for (k, _, _), h in zip(work, got, strict=True):
            parts[k].append(h)
        digests = [".".join(p) for p in parts]
        nbytes = sum(e[2] for e in extents)
        return HashResult(job, digests, time.perf_counter() - t0, nbytes)
