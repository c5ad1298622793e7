"""ftmem's storage layer for DCP: a ``FileSystemWriter`` whose ``write_data`` streams each
tensor from its slot into ``.distcp`` files, checking and hashing it as it writes.

``dcp.save`` still plans the checkpoint and writes ``.metadata``, so stock ``dcp.load`` reads
the result. Each tensor item is a ``torch.save`` archive (DCP's reader ``torch.load``s it):
its framing comes from ``torch.save`` itself under ``skip_data`` with ``compute_crc32`` off
(torch.load checks no zip CRC); the data bytes are copied once, piece by piece, from the slot
into a page-aligned staging buffer, where each piece is checked against the SMP's checksum
(what is written is exactly what was verified) and hashed into the file's xxh3-64 for the
manifest (no file is read back). Buffers go to the file with ``O_DIRECT`` where the file
system allows it, then ``fsync``; items are split over ``threads`` files written in parallel.
After ``dcp.save(..., storage_writer=SlotWriter(...))``, :attr:`SlotWriter.files` holds the
data files' manifest entries.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import HASH_PIECE, hash_bytes, pieces

log = get_logger(__name__)

STAGING_BYTES = 8 << 20
"""Bytes of each staging buffer (a multiple of the page size, more than a checksummed piece)."""
STAGING_DEPTH = 3
"""Staging buffers per file: one filled while the others are written."""
_ALIGN = 4096
"""O_DIRECT's alignment of file offsets, lengths and buffer addresses."""
_SUFFIX = ".distcp"
if STAGING_BYTES < HASH_PIECE + _ALIGN or STAGING_BYTES % mmap.PAGESIZE:
    raise ImportError("STAGING_BYTES must be whole pages holding a piece and a block")
_FRAMING_LOCK = threading.Lock()


def _frame(tensor: torch.Tensor) -> list[bytes | int]:
    """The pieces of ``torch.save(tensor)``'s archive: bytes, and an int (the data's length)
    where the storage's bytes go. No data byte is read."""
    rec = _FramingRecorder()
    from torch.utils.serialization import config

    # The setting is process-wide: one framing at a time, restored at once.
    with _FRAMING_LOCK, config.patch({"save.compute_crc32": False}):  # type: ignore[attr-defined]
        with torch.serialization.skip_data():
            torch.save(tensor, rec)  # type: ignore[arg-type]  # a binary file, as torch needs
    return rec.parts


class _FramingRecorder(io.RawIOBase):
    """A write-only file for torch.save that records the written bytes and the holes."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[bytes | int] = []
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        if self.parts and isinstance(self.parts[-1], bytes):
            self.parts[-1] += data
        else:
            self.parts.append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        # skip_data: the storage's bytes are skipped with one relative seek.
        if whence == os.SEEK_CUR and offset > 0:
            self.parts.append(offset)
            self.pos += offset
        elif (whence, offset) not in ((os.SEEK_CUR, 0), (os.SEEK_SET, self.pos)):
            raise io.UnsupportedOperation("only forward relative seeks")
        return self.pos

    def tell(self) -> int:
        return self.pos


def _exact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a CPU storage of exactly its bytes (a copy only if it is not already)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a tensor on an exact storage, as a flat uint8 array (no copy)."""
    if t.nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


class _SequentialFile:
    """One file written front to back through page-aligned staging buffers, hashed as it goes.

    The caller's thread copies and hashes into one buffer while an I/O thread writes the one
    filled before it (:data:`STAGING_DEPTH` buffers of :data:`STAGING_BYTES`), so the copy and
    the write overlap. ``direct``: try ``O_DIRECT`` (large writes straight to the device, no
    page cache); where the file system refuses it the writes are buffered. Either way
    :meth:`close` fsyncs.
    """

    def __init__(self, path: Path, *, direct: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:  # EINVAL: no O_DIRECT on this file system (tmpfs before Linux 6.6)
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o600)
        self.path = path
        # Page-aligned, as O_DIRECT needs; each with a numpy view for GIL-free copies.
        self._bufs = [mmap.mmap(-1, STAGING_BYTES) for _ in range(STAGING_DEPTH)]
        self._arrs = {id(b): np.frombuffer(b, dtype=np.uint8) for b in self._bufs}
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        for b in self._bufs[1:]:
            self._free.put(b)
        self._full: queue.Queue[tuple[mmap.mmap, int] | None] = queue.Queue()
        self._io_error: BaseException | None = None
        self._io = threading.Thread(target=self._io_loop, name="ftmem-dcp-io", daemon=True)
        self._io.start()
        self.buf = self._bufs[0]
        self.arr = self._arrs[id(self.buf)]
        self.fill = 0  # bytes staged in ``buf``, not yet handed to the I/O thread
        self.handed = 0  # bytes handed to the I/O thread (written, or being written)
        self.hash = xxhash.xxh3_64()

    @property
    def pos(self) -> int:
        """The file offset of the next byte."""
        return self.handed + self.fill

    def write(self, data: Any) -> None:
        """Append ``data`` (small: framing, a DCP byte item)."""
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        i = 0
        while i < len(src):
            n = min(len(src) - i, STAGING_BYTES - self.fill)
            if n == 0:
                self.flush()
                continue
            self._stage(src[i : i + n])
            i += n

    def write_checked(self, src: np.ndarray, want: list[str] | None, what: str) -> None:
        """Append the bytes of a tensor, one checksummed piece at a time; each staged piece is
        compared with its hash in ``want`` (the SMP's, :func:`ftmem.format.layout.digest`'s
        pieces) before it is handed on to be written.

        Raises:
            CorruptSnapshotError: a piece does not match (nothing of it is written).
        """
        if len(src) == 0:
            return
        for k, (a, b) in enumerate(pieces(len(src))):
            if STAGING_BYTES - self.fill < b - a:
                self.flush()
            got = self._stage(src[a:b], check=want is not None)
            if want is not None and got != want[k]:
                raise CorruptSnapshotError(f"{what}: bytes {a}-{b} fail their checksum")

    def _stage(self, src: np.ndarray, check: bool = False) -> str | None:
        """Copy ``src`` into the buffer and into the file's hash; its own hash if ``check``."""
        n = len(src)
        np.copyto(self.arr[self.fill : self.fill + n], src)  # releases the GIL when large
        with memoryview(self.buf) as whole, whole[self.fill : self.fill + n] as staged:
            self.hash.update(staged)
            got = hash_bytes(staged) if check else None
        self.fill += n
        return got

    def flush(self, last: bool = False) -> None:
        """Give the staged bytes to the I/O thread and go on in a free buffer (the file
        catches up with :attr:`pos`); with O_DIRECT (unless ``last``) only whole blocks, the
        tail moved to the next buffer."""
        if self._io_error is not None:
            raise self._io_error
        n = self.fill - self.fill % _ALIGN if self.direct and not last else self.fill
        nxt = self._free.get()  # blocks while every other buffer is being written
        rest = self.fill - n
        if rest:
            nxt[0:rest] = self.buf[n : self.fill]
        self._full.put((self.buf, n))
        self.handed += n
        self.buf, self.arr, self.fill = nxt, self._arrs[id(nxt)], rest

    def _io_loop(self) -> None:
        while (job := self._full.get()) is not None:
            buf, n = job
            try:
                if self._io_error is None and n:
                    done = 0
                    with memoryview(buf) as view:
                        while done < n:
                            with view[done:n] as rest:
                                done += os.write(self.fd, rest)
            except BaseException as exc:  # ENOSPC, EIO: raised in the writing thread
                self._io_error = exc
            finally:
                self._free.put(buf)

    def close(self) -> dict[str, Any]:
        """Write what is staged, fsync, close; the file's manifest entry (bytes, xxh3).

        Raises:
            OSError: a write or the fsync failed (a full disk...).
        """
        try:
            size = self.pos
            if self.direct and self.fill % _ALIGN:
                pad = _ALIGN - self.fill % _ALIGN  # whole blocks, then cut back to size
                self.arr[self.fill : self.fill + pad] = 0
                self.fill += pad
            self.flush(last=True)
            self._stop_io()
            if self._io_error is not None:
                raise self._io_error
            if self.direct:
                os.ftruncate(self.fd, size)
            os.fsync(self.fd)
            return {"bytes": size, "xxh3": self.hash.hexdigest()}
        finally:
            self.abort()

    def _stop_io(self) -> None:
        if self._io.is_alive():
            self._full.put(None)
            self._io.join()

    def abort(self) -> None:
        """Stop the I/O thread, close the file, free the buffers (the caller removes the
        directory)."""
        self._stop_io()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.arr = None  # type: ignore[assignment]
        self._arrs.clear()
        for b in self._bufs:
            b.close()
        self._bufs.clear()


def _split(
    items: list[WriteItem], size_of: Callable[[WriteItem], int], bins: int
) -> list[list[WriteItem]]:
    """Items over ``bins`` files, largest first onto the emptiest (empty bins dropped)."""
    out: list[list[WriteItem]] = [[] for _ in range(max(1, bins))]
    sizes = [0] * len(out)
    for item in sorted(items, key=size_of, reverse=True):
        i = sizes.index(min(sizes))
        out[i].append(item)
        sizes[i] += size_of(item)
    return [b for b in out if b]


class _Cancelled(Exception):
    """A data file stopped because another one failed (never the error reported)."""


class SlotWriter(FileSystemWriter):
    """DCP's file-system writer with ftmem's data path (:mod:`ftmem.tiers.dcp_writer`).

    ``expected``: for a tensor whose bytes come from a slot, its data pointer -> the SMP's
    checksum of it (:func:`ftmem.format.layout.digest`); its bytes are checked piece by piece as
    they are written. ``threads``: data files written in parallel. ``direct``: try O_DIRECT.
    ``step``: the step written (fault points match it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        expected: dict[int, str] | None = None,
        threads: int = 2,
        direct: bool = True,
        step: int = 0,
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.expected = dict(expected or {})
        self.threads = max(1, threads)
        self.direct = direct
        self.files: dict[str, dict[str, Any]] = {}
        """Manifest entries of the data files written (name -> bytes, xxh3)."""
        self.error: BaseException | None = None
        """The first error met while writing (DCP wraps it; the caller re-raises this one)."""
        self.used_direct = False
        self.step = step  # only to match fault points

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """DCP's ``finish``, which also completes ``metadata``, the object ``dcp.save`` returns.

        torch >= 2.13's writer fills in that object's ``storage_data`` (where each entry's bytes
        are); torch 2.11 and 2.12 fill in a copy, leaving the returned one without it.
        """
        super().finish(metadata, results)
        if metadata.storage_data is None:
            from torch.distributed.checkpoint import filesystem

            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
            if version is not None and hasattr(metadata, "version"):
                metadata.version = version

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan`` into ``threads`` files; the future holds the results."""
        prefix = getattr(plan.storage_data, "prefix", "__0_")
        root = Path(self.path)

        def size_of(item: WriteItem) -> int:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                return 1024
            props, size = item.tensor_data.properties, item.tensor_data.size
            return max(1, int(torch.Size(size).numel()) * props.dtype.itemsize)

        bins = _split(list(plan.items), size_of, self.threads)
        fut: Future[list[WriteResult]] = Future()  # what DCP waits on
        try:
            with ThreadPoolExecutor(len(bins) or 1, thread_name_prefix="ftmem-dcp-write") as pool:
                jobs = [
                    pool.submit(self._write_file, root, i, f"{prefix}{i}{_SUFFIX}", items, planner)
                    for i, items in enumerate(bins)
                ]
                results = [r for j in jobs for r in j.result()]
            fut.set_result(results)
        except BaseException as exc:
            self.error = self.error or exc
            raise
        return fut

    def _write_file(
        self, root: Path, index: int, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        out = _SequentialFile(root / name, direct=self.direct)
        results: list[WriteResult] = []
        try:
            for item in items:
                if self.error is not None:  # another file failed: the checkpoint is lost
                    raise _Cancelled(f"{name}: stopped, another data file failed")
                data = planner.resolve_data(item)
                start = out.pos
                if isinstance(data, io.BytesIO):
                    out.write(data.getbuffer())
                else:
                    self._write_tensor(out, data, item)
                    if not results:
                        out.flush()
                        if faults.maybe_inject(faults.Point.IN_DCP_WRITE, index, self.step):
                            raise OSError(errno.ENOSPC, "No space left on device (injected)")
                length = out.pos - start
                info = _StorageInfo(name, start, length)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
                )
            self.used_direct = self.used_direct or out.direct
            self.files[name] = out.close()
            return results
        except OSError as exc:
            out.abort()
            if exc.filename is not None:
                self.error = self.error or exc
                raise
            # os.write on a descriptor names no file: name it (a full disk says where).
            named = OSError(exc.errno, exc.strerror, str(root / name))
            self.error = self.error or named
            raise named from exc
        except BaseException as exc:
            self.error = self.error or exc
            out.abort()
            raise

    def _write_tensor(self, out: _SequentialFile, tensor: torch.Tensor, item: WriteItem) -> None:
        want_text = self.expected.get(tensor.data_ptr()) if tensor.nbytes else None
        t = _exact(tensor)
        src = _bytes_of(t)
        want = want_text.split(".") if want_text else None
        if want is not None and len(want) != len(pieces(len(src))):
            raise CorruptSnapshotError(f"{item.index.fqn}: its checksum does not fit its size")
        for part in _frame(t):
            if isinstance(part, int):
                if part != len(src):
                    raise RuntimeError(f"torch.save framed {part} bytes for {len(src)}")
                out.write_checked(src, want, item.index.fqn)
            else:
                out.write(part)


__all__ = ["STAGING_BYTES", "STAGING_DEPTH", "SlotWriter"]
