"""Named shared-memory segments (files under /dev/shm) that hold snapshot slots.

The SMP creates each slot file (mode 0600, pre-faulted so no rank ever pays first-touch
page faults on the training path) and removes it; ranks map the files it names.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ftmem._logging import get_logger
from ftmem.secure_fs import open_owned

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

_MADV_POPULATE_WRITE = 23  # linux >= 5.14; not exported by Python 3.11's mmap module
ALIGN = 64  # byte alignment of every tensor inside a slot
SLOT_ROUND = 2 << 20  # slot capacities are multiples of 2 MiB


def slot_file_name(run_id: str, node: str, rank: int, slot: int, gen: int) -> str:
    """Return the file name of a slot: it carries the run id, node, rank, slot and generation."""
    return f"ftmem-{run_id}-{node}-r{rank}-s{slot}-g{gen}"


def round_capacity(nbytes: int) -> int:
    """Round a byte count up to the slot granularity (at least one granule)."""
    return max(SLOT_ROUND, -(-nbytes // SLOT_ROUND) * SLOT_ROUND)


def _prefault(mm: mmap.mmap, nbytes: int) -> None:
    try:
        mm.madvise(_MADV_POPULATE_WRITE, 0, nbytes)
        return
    except (OSError, ValueError):
        pass
    # Older kernels: write one byte per page, which allocates it in the tmpfs.
    import torch

    view = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    view[:: mmap.PAGESIZE].zero_()
    del view


def create_segment(path: Path, nbytes: int) -> None:
    """Create the file ``path`` of ``nbytes`` (mode 0600, must not exist) and pre-fault it.

    Error handling: on any failure (e.g. /dev/shm full) the partial file is removed and
    the OSError propagates.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
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


class MappedSegment:
    """A rank's read/write mapping of one slot file, exposed as a uint8 tensor.

    The file must be an ftmem segment in ``shm_dir``, a regular file (opened without
    following a symlink) of this user that nobody else can read or write; otherwise
    UnsafePathError (or ValueError for a wrong place or size) is raised and nothing is mapped.

    Resource handling: the mapping lives until :meth:`close` (idempotent); tensors taken
    from :attr:`tensor` must be dropped first.
    """

    def __init__(self, path: Path, expect_bytes: int, shm_dir: Path = Path("/dev/shm")) -> None:
        resolved = Path(os.path.realpath(path))
        if resolved.parent != Path(os.path.realpath(shm_dir)) or not resolved.name.startswith(
            "ftmem-"
        ):
            raise ValueError(f"refusing to map {path}: not an ftmem segment in {shm_dir}")
        fd = open_owned(resolved, "slot file", os.O_RDWR, private=True)
        try:
            st = os.fstat(fd)
            if st.st_size != expect_bytes:
                raise ValueError(f"segment {path} has size {st.st_size}, expected {expect_bytes}")
            self._mm = mmap.mmap(fd, expect_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
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


def map_readonly(path: Path, nbytes: int) -> mmap.mmap:
    """Map the first ``nbytes`` of an existing slot file read-only (the SMP reads, ranks write).

    Raises:
        OSError: the file is missing.
        ValueError: the file is shorter than ``nbytes``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"segment {path} has {size} bytes, fewer than {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def write_segment(path: Path, data: memoryview) -> None:
    """Write ``data`` at the start of the existing slot file ``path`` (used by a rebuild)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        done = 0
        while done < data.nbytes:
            done += os.pwrite(fd, data[done : done + (64 << 20)], done)
    finally:
        os.close(fd)
