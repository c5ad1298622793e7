"""HashService: the SMP checksums committed slots, so the training process only moves bytes.

A rank commits a snapshot as soon as its copy is done, with a layout that has no checksums.
The SMP then maps the slot read-only and hashes every extent (xxh3-64) on this service's
threads: one coordinator thread takes slots in commit order and hashes their extents on a
pool of ``threads`` threads, piece by piece (``HASH_PIECE``; python-xxhash releases the GIL,
so the loop thread that serves the ranks keeps answering). The result goes back to the loop thread through a queue; the
loop fills the checksums into the layout (the digests are data: nothing is parsed again)
and the snapshot becomes *verified*.

Resource handling: the coordinator keeps each slot file mapped (read-only, the whole file)
for as long as that file exists, and reuses the mapping for every later job of the slot
(mapping the slot per job set its page tables up each time, which cost more than the hashing
itself). Before each job it unmaps every cached file
that is gone or was replaced (one ``stat`` each), so a removed slot's shared memory is held
by us until the next job at most (or :meth:`close`). Only the coordinator thread touches
these mappings, so they need no lock. :meth:`close` stops the coordinator with a sentinel,
shuts the pool down (bounded; a job in progress finishes first), then unmaps everything.

Error handling: a slot that cannot be read (removed, truncated) yields a result with
``error`` set; the loop drops that snapshot. Nothing raises out of the threads.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.format.layout import StoredSnapshot, hash_bytes, pieces

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
    snap: StoredSnapshot
    """The committed layout, checked against the slot (once, at the commit)."""


@dataclass(frozen=True, slots=True)
class HashResult:
    """The checksums of a job's extents (``digests``: the objects' first, then each
    tensor's, as :meth:`StoredSnapshot.extents` orders them; empty and ``error`` set if it
    failed);
    ``nbytes`` the bytes hashed."""

    job: HashJob
    digests: list[str]
    seconds: float
    nbytes: int
    error: str = ""


@dataclass(slots=True)
class _SlotMap:
    """A read-only mapping of a whole slot file, and which file (and size) it maps."""

    mm: mmap.mmap
    dev: int
    ino: int
    size: int

    def same_file(self, st: os.stat_result) -> bool:
        """Whether ``st`` (of the path now) is the file this maps, still of the mapped size."""
        return (st.st_dev, st.st_ino, st.st_size) == (self.dev, self.ino, self.size)


def _map_whole(path: str) -> _SlotMap:
    """Map all of the slot file ``path`` read-only, as :func:`ftmem.shm.map_readonly` does
    (no symlink followed), and note the file's identity from the same open.

    Raises:
        OSError: the file is missing (or a symlink).
        ValueError: the file is empty.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_size == 0:
            raise ValueError(f"segment {path} is empty")
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return _SlotMap(mm, st.st_dev, st.st_ino, st.st_size)


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
        self._maps: dict[str, _SlotMap] = {}
        """Slot file path -> its read-only mapping, kept while that file exists. Only the
        coordinator thread touches it (and :meth:`close` once the coordinator has stopped),
        so it has no lock."""
        self.maps_made = 0
        """Slot files mapped so far (a remap of a replaced file counts again)."""

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
            held = self._maps[path] = _map_whole(path)
            self.maps_made += 1
        if held.size < need:
            raise ValueError(f"segment {path} has {held.size} bytes, fewer than {need}")
        return held.mm

    def _prune(self) -> None:
        """Unmap every cached slot file that no longer exists, or that another file (or
        size) replaced at its path: one ``stat`` each."""
        for path, held in list(self._maps.items()):
            try:
                same = held.same_file(os.stat(path, follow_symlinks=False))
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
            held.mm.close()
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
            try:
                result = self._hash(job)
            except Exception as exc:  # keep serving: one bad slot must not stop verification
                log.exception(
                    "[%s/smp] hashing rank %d step %d failed", self.node, job.rank, job.step
                )
                result = HashResult(job, [], 0.0, 0, f"{type(exc).__name__}: {exc}")
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

            if self._pool is not None and len(work) > 1:
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
