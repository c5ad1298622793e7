"""Named shared-memory segments (slot files on a tmpfs) that hold snapshot slots.

The SMP creates each slot file (mode 0600, its pages allocated with ``posix_fallocate``) and
removes it; ranks map the files it names, populating their page tables on the copy thread
without the GIL (:func:`populate_write`), so no rank pays first-touch faults on the training
path.

Every slot file and commit record lives in this user's private directory (mode 0700, default
``/dev/shm/ftmem-<uid>``: :func:`ftmem.config.default_shm_dir`), never directly in the
world-writable ``/dev/shm``, so no other user can plant a file under a slot's name. A slot
file is named ``<run>@<node>@<nonce>@r<rank>-s<slot>-g<gen>`` (:func:`slot_file_name`): run
ids and node names cannot contain ``@`` (:func:`ftmem.config.check_name`), so a name belongs
to exactly one run and node, and ``<nonce>`` is random per SMP (:func:`new_nonce`). A
restarted SMP of the same run and node adopts slot files of any nonce.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ftmem._logging import get_logger
from ftmem.config import NAME_PATTERN
from ftmem.secure_fs import check_dir, open_owned

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

_MADV_POPULATE_WRITE = 23  # linux >= 5.14; not exported by Python 3.11's mmap module
ALIGN = 64  # byte alignment of every tensor inside a slot
SLOT_ROUND = 2 << 20  # slot capacities are multiples of 2 MiB


NAME_SEP = "@"
"""Separates run id, node name, nonce and slot in a slot file's name (never in a name)."""
_NONCE_HEX = 16
BOARD_SUFFIX = "grants"
"""The "suffix" :func:`parse_slot_name` gives an SMP's grant board (:class:`GrantBoard`)."""
_SLOT_NAME_RE = re.compile(
    rf"(?P<run>{NAME_PATTERN})@(?P<node>{NAME_PATTERN})@(?P<nonce>[0-9a-f]{{{_NONCE_HEX}}})"
    r"@(?:r(?P<rank>\d{1,9})-s(?P<slot>\d{1,9})-g(?P<gen>\d{1,18})"
    rf"(?P<suffix>\.commit(?:\.tmp)?)?|(?P<board>{BOARD_SUFFIX}))"
)


@dataclass(frozen=True, slots=True)
class SlotName:
    """The parts of a slot file's (or its commit record's) name."""

    run_id: str
    node: str
    nonce: str
    rank: int
    slot: int
    gen: int
    suffix: str
    """``""`` for a slot file, :data:`BOARD_SUFFIX` for a grant board (rank, slot and gen
    -1), ``.commit`` or ``.commit.tmp`` for a commit record (:mod:`ftmem.smp.records`)."""


def new_nonce() -> str:
    """A random nonce (16 hex digits) for the names of one SMP's slot files."""
    return secrets.token_hex(_NONCE_HEX // 2)


def slot_file_name(run_id: str, node: str, nonce: str, rank: int, slot: int, gen: int) -> str:
    """Return the file name of a slot, ``<run>@<node>@<nonce>@r<rank>-s<slot>-g<gen>``;
    :func:`parse_slot_name` gives the parts back (ValueError if they cannot round-trip)."""
    name = f"{run_id}{NAME_SEP}{node}{NAME_SEP}{nonce}{NAME_SEP}r{rank}-s{slot}-g{gen}"
    if parse_slot_name(name) != SlotName(run_id, node, nonce, rank, slot, gen, ""):
        raise ValueError(f"not a valid slot file name: {name!r}")
    return name


def parse_slot_name(name: str) -> SlotName | None:
    """The parts of a slot file's, commit record's or grant board's name; None for any
    other name."""
    m = _SLOT_NAME_RE.fullmatch(name)
    if m is None:
        return None
    if m["board"]:
        return SlotName(m["run"], m["node"], m["nonce"], -1, -1, -1, BOARD_SUFFIX)
    return SlotName(
        m["run"],
        m["node"],
        m["nonce"],
        int(m["rank"]),
        int(m["slot"]),
        int(m["gen"]),
        m["suffix"] or "",
    )


def round_capacity(nbytes: int) -> int:
    """Round a byte count up to the slot granularity (at least one granule)."""
    return max(SLOT_ROUND, -(-nbytes // SLOT_ROUND) * SLOT_ROUND)


_LIBC: ctypes.CDLL | None = None
POPULATE_CHUNK = 32 << 20
"""Bytes :func:`populate_write` faults in per system call."""


def populate_write(mm: mmap.mmap, nbytes: int) -> bool:
    """Fault in the first ``nbytes`` of the writable mapping ``mm`` for writing (its pages and
    page tables: ``MADV_POPULATE_WRITE``, Linux >= 5.14) without holding the GIL, so the
    training thread runs meanwhile (CPython holds the GIL through ``MAP_POPULATE`` and
    ``mmap.madvise``); False where the kernel refuses."""
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the GIL
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    anchor = ctypes.c_char.from_buffer(mm)  # the mapping's address (pins it meanwhile)
    try:
        base = ctypes.addressof(anchor)
        # In pieces: the kernel holds the process's mmap lock through each call, and the
        # training thread's own faults and allocations wait for it meanwhile.
        for off in range(0, nbytes, POPULATE_CHUNK):
            n = min(POPULATE_CHUNK, nbytes - off)
            if _LIBC.madvise(base + off, n, _MADV_POPULATE_WRITE) != 0:
                return False
        return True
    finally:
        del anchor


def _prefault(mm: mmap.mmap, nbytes: int) -> None:
    if populate_write(mm, nbytes):
        return
    # Older kernels: write one byte per page, which allocates it in the tmpfs.
    import torch

    view = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    view[:: mmap.PAGESIZE].zero_()
    del view


def space_shortfall(directory: Path, needed: int, *, node_total: int, what: str) -> str | None:
    """None if ``directory`` (a tmpfs such as /dev/shm) has ``needed`` bytes free; else an
    error that says how much is missing and how to size shared memory (containers,
    Kubernetes, a host), ``node_total`` being what every slot of the node will take."""
    import shutil

    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None  # cannot tell: the creation itself will report
    if free >= needed:
        return None
    gib = 2**30
    want = max(1, -(-int(node_total * 1.2) // gib))  # GiB, rounded up, with 20% headroom
    return (
        f"{directory} has {free / gib:.2f} GiB free but {what} need {needed / gib:.2f} GiB "
        f"(every snapshot slot of this node: about {node_total / gib:.2f} GiB). Give the "
        f"node more shared memory: `docker run --shm-size={want}g`; in Kubernetes mount an "
        f"emptyDir with `medium: Memory` and `sizeLimit: {want}Gi` at /dev/shm; on a host "
        f"`mount -o remount,size={want}G /dev/shm`. Or set FTMEM_SHM_DIR to a larger tmpfs, "
        "or use fewer slots (--ftmem-tune slots)."
    )


def create_segment(path: Path, nbytes: int) -> None:
    """Create the file ``path`` of ``nbytes`` (mode 0600, must not exist) and allocate its
    pages. On any failure (e.g. /dev/shm full) the partial file is removed and the OSError
    propagates."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            # On a tmpfs this allocates every page, with the GIL released (the kernel zeroes
            # each at its first touch: the rank's pre-fault when it maps the slot).
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, nbytes)  # a file system without fallocate: touch every page
            with mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED) as mm:
                _prefault(mm, nbytes)
    except BaseException:
        os.close(fd)
        remove_segment(path)
        raise
    os.close(fd)


def remove_segment(path: Path) -> None:
    """Remove a segment file if it exists."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_slot_path(path: Path, shm_dir: Path | None = None, suffix: str = "") -> Path:
    """Return ``path`` resolved, after checking that it names a slot file (``suffix``
    :data:`BOARD_SUFFIX`: a grant board) directly in ``shm_dir`` (default: the directory it
    names) and that ``shm_dir`` is a real directory of this user with mode 0700, so nobody
    else can have planted or swapped an entry (its parent, ``/dev/shm``, is sticky).

    Raises:
        ValueError: ``path`` is not such a name, or lies elsewhere.
        UnsafePathError: ``shm_dir`` is a symlink, another user's, or open to others.
    """
    shm_dir = Path(path).parent if shm_dir is None else shm_dir
    resolved = Path(os.path.realpath(path))
    name = parse_slot_name(resolved.name)
    if resolved.parent != Path(os.path.realpath(shm_dir)) or name is None or name.suffix != suffix:
        what = "a grant board" if suffix else "a slot file"
        raise ValueError(f"refusing to map {path}: not {what} in {shm_dir}")
    check_dir(shm_dir, "shared-memory directory", private=True)
    return resolved


class MappedSegment:
    """A rank's read/write mapping of one slot file, exposed as a uint8 tensor.

    The path is checked by :func:`check_slot_path` (``shm_dir``: the one the SMP's HELLO
    reply names) and the file must be a regular file of this user that nobody else can read
    or write; otherwise UnsafePathError (or ValueError for a wrong place, name or size) is
    raised and nothing is mapped.

    Resource handling: the mapping lives until :meth:`close` (idempotent); tensors taken
    from :attr:`tensor` must be dropped first.
    """

    def __init__(self, path: Path, expect_bytes: int, shm_dir: Path | None = None) -> None:
        resolved = check_slot_path(path, shm_dir)
        fd = open_owned(resolved, "slot file", os.O_RDWR, private=True)
        try:
            st = os.fstat(fd)
            if st.st_size != expect_bytes:
                raise ValueError(f"segment {path} has size {st.st_size}, expected {expect_bytes}")
            self._mm = mmap.mmap(fd, expect_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        # The page tables, filled now and without the GIL (else the first copy takes the faults).
        populate_write(self._mm, expect_bytes)
        import torch

        self.path = resolved
        self.nbytes = expect_bytes
        self.tensor: torch.Tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        """Unmap (idempotent). Fails silently if tensors still reference the buffer."""
        if self._mm is None:
            return
        self.view.release()
        del self.tensor
        try:
            self._mm.close()
        except BufferError:
            log.debug("segment %s still referenced; unmapped at exit", self.path)
        self._mm = None  # type: ignore[assignment]


def map_readonly(path: Path | str, nbytes: int = 0) -> tuple[mmap.mmap, os.stat_result]:
    """Map the first ``nbytes`` (0: all) of an existing slot file read-only (the SMP reads,
    ranks write), without following a symlink; the mapping and the file's ``fstat``.

    Raises:
        OSError: the file is missing (or a symlink).
        ValueError: the file is empty or shorter than ``nbytes``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_size < max(nbytes, 1):
            raise ValueError(f"segment {path} has {st.st_size} bytes, fewer than {nbytes or 1}")
        mm = mmap.mmap(fd, nbytes or st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return mm, st
    finally:
        os.close(fd)


def write_segment(path: Path, data: memoryview) -> None:
    """Write ``data`` at the start of the existing slot file ``path`` (used by a rebuild)."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done : done + (64 << 20)], done)
    finally:
        os.close(fd)


GRANT_PENDING, GRANT_READY, GRANT_REVOKED = 0, 1, 2
"""A cell of a grant board: the rank may not write its granted slot yet (it asks with a
BEGIN), may write it, or the slot was taken back (it asks with a BEGIN)."""
BOARD_CELLS = 4096
"""Cells (bytes) of a grant board: one per rank the SMP serves."""


def board_file_name(run_id: str, node: str, nonce: str) -> str:
    """The file name of an SMP's grant board, ``<run>@<node>@<nonce>@grants``."""
    name = f"{run_id}{NAME_SEP}{node}{NAME_SEP}{nonce}{NAME_SEP}{BOARD_SUFFIX}"
    if parse_slot_name(name) != SlotName(run_id, node, nonce, -1, -1, -1, BOARD_SUFFIX):
        raise ValueError(f"not a valid grant board name: {name!r}")
    return name


class GrantBoard:
    """An SMP's grant board: one byte per rank saying whether the slot granted to its next
    save may be written (:data:`GRANT_READY`), which the rank reads from its read-only mapping
    (:func:`map_board`) without a message. Only the SMP writes it, a byte at a time (never
    torn). The file (mode 0600) is made at construction and removed by :meth:`close`.
    """

    def __init__(self, path: Path) -> None:
        create_segment(path, BOARD_CELLS)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._mm: mmap.mmap | None = mmap.mmap(fd, BOARD_CELLS, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path

    def set(self, cell: int, value: int) -> None:
        """Write ``value`` into ``cell`` (no-op once closed)."""
        if self._mm is not None:
            self._mm[cell] = value

    def close(self) -> None:
        """Unmap and remove the file (idempotent)."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
            remove_segment(self.path)


def map_board(path: Path, shm_dir: Path) -> mmap.mmap:
    """A rank's read-only mapping of the grant board ``path``, checked as
    :func:`check_slot_path` does and opened as a regular file of this user, readable by
    nobody else, of ``BOARD_CELLS`` bytes.

    Raises:
        UnsafePathError: the directory or the file is not this user's private one.
        ValueError: a wrong name, place or size.
    """
    resolved = check_slot_path(path, shm_dir, BOARD_SUFFIX)
    fd = open_owned(resolved, "grant board", os.O_RDONLY, private=True)
    try:
        if os.fstat(fd).st_size != BOARD_CELLS:
            raise ValueError(f"grant board {path} is not {BOARD_CELLS} bytes")
        return mmap.mmap(fd, BOARD_CELLS, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
