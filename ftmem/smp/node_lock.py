"""One SMP per run and node: an exclusive lock held for the SMP's whole life.

Two SMPs of the same user, run and node would adopt each other's slot files, and the first to
stop cleanly would delete the other's live snapshots. :class:`NodeLock` takes ``flock`` on
``<private base>/locks/<run id>@<node>.lock`` before the SMP touches any slot file; the kernel
drops it when the process dies (even by SIGKILL). The lock directory is private to the user,
so no one else can plant or hold the lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ftmem.config import check_name, user_base_dir
from ftmem.errors import SmpStartError, UnsafePathError
from ftmem.secure_fs import open_owned, prepare_private_dir


class NodeLock:
    """The lock of one run and node. :meth:`acquire` once, :meth:`release` (idempotent).

    Raises ValueError at construction if ``run_id`` or ``node`` is not a valid name
    (:func:`ftmem.config.check_name`: never ``@``, so the lock's name is unambiguous).
    """

    def __init__(self, run_id: str, node: str, base: Path | None = None) -> None:
        check_name("run_id", run_id)
        check_name("node", node)
        self.path = (base or user_base_dir()) / "locks" / f"{run_id}@{node}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write this pid into it.

        Raises:
            SmpStartError: another live SMP holds it (its pid named), or the lock directory
                is unsafe.
        """
        try:
            prepare_private_dir(self.path.parent, "lock directory")
            if not os.path.lexists(self.path):
                flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    os.close(os.open(self.path, flags, 0o600))
                except FileExistsError:
                    pass
            fd = open_owned(self.path, "SMP lock", os.O_RDWR, private=True)
        except UnsafePathError as exc:
            raise SmpStartError(str(exc)) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SmpStartError(
                f"another SMP (pid {holder}) serves run {self.path.stem.replace('@', ', node ')}"
                f" for this user (lock {self.path}); give this one another --run-id or --node"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays: removing it could let a third SMP lock a new
        file while a second still waits on the old one)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
