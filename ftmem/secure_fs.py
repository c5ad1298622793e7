"""Checks on the paths ftmem trusts: owner, mode, file type, no symlinks.

Every directory and file that another process reads as ftmem's own (the run directory and its
key, the shared-memory directory and its slot files, the disk tiers and their checkpoints)
goes through one of these functions first. They use ``lstat``/``O_NOFOLLOW`` and check the
object they opened (``fstat`` on the descriptor), so a symlink or a swapped file is refused
rather than followed. A refusal raises :class:`~ftmem.errors.UnsafePathError` naming the path
and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from ftmem.errors import UnsafePathError

_OTHERS_WRITE = 0o022
_OTHERS_ANY = 0o077


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def _lstat(path: Path, what: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except OSError as exc:
        raise UnsafePathError(f"{what} {path}: {exc.strerror or exc}") from exc


def check_owned(st: os.stat_result, path: Path, what: str, *, private: bool) -> None:
    """Raise UnsafePathError unless ``st`` (of ``path``) is this user's and not writable by
    others (with ``private``: no group or other bits at all)."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path} is a symbolic link; refusing to follow it")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); "
            "another user may have planted it"
        )
    mask = _OTHERS_ANY if private else _OTHERS_WRITE
    if st.st_mode & mask:
        raise UnsafePathError(
            f"{what} {path} is {'open to' if private else 'writable by'} others "
            f"({_describe(st)}); chmod {'700/600' if private else 'go-w'} it"
        )


def check_dir(path: Path, what: str, *, private: bool = False) -> None:
    """``path`` is a real directory of this user, not writable by others (``private``: mode
    0700 or stricter). Raises UnsafePathError."""
    st = _lstat(path, what)
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a directory")
    check_owned(st, path, what, private=private)


def check_parent(path: Path, what: str) -> None:
    """Nobody but this user (or root) can rename entries of ``path``'s parent: it is ours or
    root's, and writable by others only with the sticky bit (like /tmp). Raises
    UnsafePathError."""
    parent = path.parent
    st = _lstat(parent, f"the directory holding the {what}")
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (0, os.geteuid()):
            raise UnsafePathError(
                f"{parent} (holding the {what}) is a symbolic link of uid {st.st_uid}"
            )
        st = os.stat(parent)  # ours or the system's (/var/run -> /run): judge its target
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePathError(
            f"{parent} (holding the {what}) belongs to uid {st.st_uid}; it could swap {path.name}"
        )
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        raise UnsafePathError(
            f"{parent} (holding the {what}) is writable by others without the sticky bit "
            f"({_describe(st)})"
        )


def ensure_private_dir(path: Path, what: str) -> None:
    """Create ``path`` (mode 0700; its parent must exist) or accept an existing one that is
    ours and not a symlink, tightening its mode to 0700. Raises UnsafePathError if it is
    another user's, a symlink, or not a directory."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafePathError(f"cannot create {what} {path}: {exc.strerror or exc}") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{what} {path} is a symbolic link or not a directory") from exc
        raise UnsafePathError(f"cannot open {what} {path}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        check_owned(st, path, what, private=False)
        if st.st_mode & _OTHERS_ANY:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def prepare_private_dir(path: Path, what: str) -> None:
    """Make ``path`` a private directory of this user (mode 0700) whose entries nobody else
    can swap: missing ancestors are created with mode 0700, the parent is checked
    (:func:`check_parent`), then the directory itself (:func:`ensure_private_dir`).

    Raises:
        UnsafePathError: the parent or the directory is another user's, a symlink, or open
            to others.
    """
    missing: list[Path] = []
    probe = path.parent
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    check_parent(path, what)
    ensure_private_dir(path, what)


def open_owned(path: Path, what: str, flags: int = os.O_RDONLY, *, private: bool) -> int:
    """Open the regular file ``path`` without following a symlink and return the descriptor,
    after checking the opened file is ours (``private``: readable by nobody else; otherwise
    not writable by others). The caller closes it. Raises UnsafePathError (also for a
    missing file)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise UnsafePathError(f"cannot open {what} {path}: {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{what} {path} is not a regular file")
        check_owned(st, path, what, private=private)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_private_file(path: Path, what: str, max_bytes: int = 1 << 20) -> bytes:
    """The bytes of ``path``, a regular file of this user that nobody else can read or write
    (a key). Raises UnsafePathError."""
    fd = open_owned(path, what, private=True)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePathError(f"{what} {path} is larger than {max_bytes} bytes")
    return data


def create_private_file(path: Path, data: bytes) -> bool:
    """Write ``data`` to a new file ``path`` (mode 0600) atomically: it appears complete or
    not at all, and an existing file is never replaced. Returns False if ``path`` existed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        os.unlink(tmp)


def replace_private_file(path: Path | str, data: bytes, tmp: Path | str | None = None) -> None:
    """Write ``data`` to ``path`` (mode 0600) atomically: to a new temporary file (``tmp``,
    default ``.<name>.tmp-<pid>`` beside it), renamed over ``path``. The temporary file is
    created ``O_EXCL|O_NOFOLLOW``: one left by a write that died, or planted, is removed
    first, and nothing is written through a symlink. Raises OSError (no file is left)."""
    if tmp is None:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
