"""Slot files of the SMP: their names, their removal, and their creation off the loop thread.

:class:`SlotFiles` knows where this run's and node's slot files live (:mod:`ftmem.shm`) and
removes them with their commit records. :class:`Allocator` creates new slot files on a worker
thread (it takes time in proportion to the size), so the loop keeps answering other ranks and
sends a PREPARE's reply when the job comes back.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.config import ENV_SHM_DIR, check_name
from ftmem.errors import UnsafePathError
from ftmem.secure_fs import prepare_private_dir
from ftmem.smp import drain, records

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SlotFiles:
    """The slot files of one run on one node (no state: every answer comes from the disk).

    New files carry this SMP's random ``nonce``; :meth:`ours` and :meth:`adoptable` match the
    run and node with any nonce, so a restarted SMP finds its predecessor's files. Raises
    ValueError at construction if ``run_id`` or ``node`` is not a valid name.
    """

    shm_dir: Path
    run_id: str
    node: str
    nonce: str = field(default_factory=shm.new_nonce)

    def __post_init__(self) -> None:
        check_name("run_id", self.run_id)
        check_name("node", self.node)
        shm.slot_file_name(self.run_id, self.node, self.nonce, 0, 0, 0)  # a valid nonce

    def prepare(self) -> None:
        """Make ``shm_dir`` this user's private directory
        (:func:`ftmem.secure_fs.prepare_private_dir`).

        Raises:
            UnsafePathError: it (or its parent) is another user's, a symlink, not a directory,
                or writable by others; the message says how to choose another directory.
                Another user can thereby deny service, never plant or read a slot.
        """
        try:
            prepare_private_dir(self.shm_dir, "shared-memory directory")
        except UnsafePathError as exc:
            raise UnsafePathError(
                f"{exc}; choose another private directory with {ENV_SHM_DIR}=DIR "
                "(python -m ftmem.smp --shm-dir DIR) on a tmpfs such as /dev/shm"
            ) from exc

    def ours(self) -> list[Path]:
        """Every file of exactly this run and node, any nonce (:func:`records.run_files`),
        that belongs to this user; another user's file is skipped with a warning."""
        found = []
        for p, _ in records.run_files(self.shm_dir, self.run_id, self.node):
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if st.st_uid != os.geteuid():
                log.warning(
                    "[%s/smp] leaving %s alone: it belongs to uid %d", self.node, p, st.st_uid
                )
                continue
            found.append(p)
        return found

    def path(self, rank: int, index: int, gen: int) -> Path:
        """The new file of generation ``gen`` of slot ``index`` of ``rank`` (this SMP's
        nonce)."""
        name = shm.slot_file_name(self.run_id, self.node, self.nonce, rank, index, gen)
        return self.shm_dir / name

    def board_path(self) -> Path:
        """This SMP's grant board (:class:`ftmem.shm.GrantBoard`)."""
        return self.shm_dir / shm.board_file_name(self.run_id, self.node, self.nonce)

    def discard(self, path: Path | str) -> None:
        """Remove a slot file that is being replaced: its commit record first, then its data."""
        records.remove_record(path)
        shm.remove_segment(Path(path))

    def remove_all(self) -> int:
        """Remove every file of this run and node (stale arenas, records); return how many."""
        n = 0
        for p in self.ours():
            try:
                shm.remove_segment(p)
                n += 1
            except OSError as exc:  # e.g. a directory planted under a slot's name
                log.warning("[%s/smp] cannot remove %s: %s", self.node, p, exc)
        return n

    def adoptable(self, nslots: int) -> list[records.Adoptable]:
        """The committed slot files a previous SMP of this run and node left (any nonce; see
        records.scan); every other file of this run and node is removed."""
        found, leftovers = records.scan(self.shm_dir, self.run_id, self.node, nslots)
        for p in leftovers:
            try:
                shm.remove_segment(p)
                records.remove_record(p)
            except OSError as exc:
                log.warning("[%s/smp] cannot remove %s: %s", self.node, p.name, exc)
        return found


@dataclass(slots=True)
class AllocJob:
    """New slot files one PREPARE asked for, and whom to answer when they exist."""

    ident: bytes | None
    """None: nobody waits for these files (the rest of a PREPARE, made after its reply)."""
    req_id: int
    rank: int
    slots: list[tuple[int, Path, int]]
    """(slot index, new path, capacity) of every slot to make."""
    error: str = ""
    """Set by the worker when a file could not be made (the later ones were not tried)."""


class Allocator:
    """Creates slot files on the ``ftmem-smp-alloc`` thread; :meth:`submit` and
    :meth:`finished` belong to the loop thread.

    Resource handling: :meth:`close` stops the thread with a sentinel (bounded join); a job
    in progress finishes first. Error handling: a file that cannot be made (e.g. /dev/shm is
    full) sets the job's ``error``; the thread keeps serving.
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self._jobs: queue.Queue[AllocJob | None] = queue.Queue()
        self._done: queue.Queue[AllocJob] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.pending = 0
        """Jobs submitted and not yet taken back by :meth:`finished`."""

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="ftmem-smp-alloc", daemon=True)
        self._thread.start()

    def submit(self, job: AllocJob) -> None:
        """Queue ``job``; it comes back from :meth:`finished` once its files exist (or not)."""
        self.pending += 1
        self._jobs.put(job)

    def finished(self) -> list[AllocJob]:
        """The jobs done since the last call (non-blocking)."""
        out = drain(self._done)
        self.pending -= len(out)
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread after the job in progress (idempotent, bounded)."""
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            for _, path, capacity in job.slots:
                try:
                    shm.create_segment(path, capacity)
                except OSError as exc:
                    job.error = f"cannot create {path.name} ({capacity} bytes): {exc}"
                    log.error("[%s/smp] %s", self.node, job.error)
                    break
            self._done.put(job)
