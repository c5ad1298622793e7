"""Reed-Solomon encode/rebuild of one stripe with pyeclib's ISA-L backend, and fragment checksums.

A stripe is ``k`` data chunks of ``chunk_bytes`` (short chunks zero-padded) and ``m`` parity
fragments; :mod:`ftmem.exchange.placement` decides which node owns which.

How pyeclib is used. ``ECDriver.encode`` takes one contiguous payload and splits it itself:
for a payload of ``k * chunk_bytes`` (``chunk_bytes`` a multiple of 64) fragment ``i < k`` is
an 80-byte header followed by exactly ``payload[i*chunk_bytes:(i+1)*chunk_bytes]``, and the
headers depend only on ``(k, m, chunk_bytes)``. So:

* Encoding hands pyeclib the stripe as one buffer: either the caller's own contiguous buffer
  (:meth:`StripeCodec.encode_stripe`, zero copy) or the codec's reused stripe buffer, into which
  :meth:`StripeCodec.encode` gathers the chunks (one memcpy per chunk; the transport can also
  receive straight into :meth:`StripeCodec.stripe_buffer`). pyeclib's C code only accepts
  buffers that need no release (``bytes``, numpy arrays; *not* memoryview, bytearray or mmap),
  so memoryviews are wrapped in a numpy view (no copy). Only the ``m`` parity fragments are
  kept (header included, ``chunk_bytes + 80`` bytes each); the data fragments pyeclib returns
  are copies of the input and are dropped at once.
* Rebuilding gives pyeclib data fragments made of a cached header template plus the chunk
  (one copy per fragment), and ``reconstruct`` returns the missing ones.

Checksums. Every fragment has an xxh3-64 checksum: a data column over its real bytes (no
padding), a parity fragment over all its bytes. :class:`EncodedStripe` carries all ``k + m``
of them; parity holders keep them, and a rebuild verifies every fragment against them before
use: a mismatch counts as a lost fragment.

GIL and memory. pyeclib holds the GIL while it encodes, so long stripes stall every other
thread of the process: keep stripes at a few MiB, or encode in a worker process. pyeclib
allocates its output per call; glibc returns such large blocks to the kernel and page-faults
them back each time, which :func:`tune_malloc` prevents. A :class:`StripeCodec` is not
thread-safe (its stripe buffer is reused).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import xxhash
from pyeclib.ec_iface import ECDriver

from ftmem.errors import UnrecoverableError
from ftmem.exchange.placement import ALIGN
from ftmem.exchange.segments import Buffer

__all__ = [
    "EC_TYPE",
    "EncodedStripe",
    "Rebuilt",
    "StripeCodec",
    "checksum",
    "tune_malloc",
]

log = logging.getLogger(__name__)

EC_TYPE = "isa_l_rs_vand"
"""pyeclib backend: ISA-L Reed-Solomon (Vandermonde)."""


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: 2 GiB, not the 4 GiB of the env variable
_malloc_lock = threading.Lock()
_malloc_tuned: bool | None = None


def tune_malloc() -> bool:
    """Make glibc reuse large blocks instead of unmapping them (idempotent, process-wide).

    Same effect as ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=...`` in the
    environment, applied with ``mallopt``: blocks below 32 MiB come from the heap, and the heap
    is trimmed only once 2 GiB are free at its top. Fixing the thresholds also turns off
    glibc's dynamic threshold.

    Returns:
        True if the settings are in effect, False when the C library has no ``mallopt``
        (musl, macOS) or refused them; nothing else changes then.
    """
    global _malloc_tuned
    with _malloc_lock:
        if _malloc_tuned is not None:
            return _malloc_tuned
        _malloc_tuned = False
        try:
            mallopt = ctypes.CDLL(ctypes.util.find_library("c") or None).mallopt
        except (OSError, AttributeError):
            log.info("no mallopt in this C library: large-buffer reuse not tuned")
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = int(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) == 1
        _malloc_tuned = int(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)) == 1 and ok
        if not _malloc_tuned:
            log.warning("mallopt refused the thresholds: erasure coding runs slower")
        return _malloc_tuned


def checksum(data: Buffer | np.ndarray[tuple[int], np.dtype[np.uint8]]) -> int:
    """xxh3-64 of ``data`` (the checksum every fragment carries)."""
    return xxhash.xxh3_64_intdigest(cast(bytes, data))


@dataclass(frozen=True, slots=True)
class EncodedStripe:
    """The parity of one stripe and the checksums of all its fragments."""

    chunk_bytes: int
    lengths: tuple[int, ...]
    """Real bytes of each of the ``k`` data columns."""
    parity: tuple[bytes, ...]
    """``m`` pyeclib fragments (80-byte header + ``chunk_bytes``); fragment index ``k + t``."""
    checksums: tuple[int, ...]
    """xxh3-64 of fragments ``0..k+m-1``: data over its real bytes, parity over all its bytes."""


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """The result of :meth:`StripeCodec.reconstruct`."""

    fragments: dict[int, bytes]
    """Index -> fragment: data trimmed to its real length, parity as pyeclib stores it."""
    corrupt: tuple[int, ...]
    """Indices that were supplied but failed their checksum (treated as lost)."""


class StripeCodec:
    """Encodes and rebuilds stripes of ``k`` data chunks and ``m`` parity fragments.

    Resource handling: holds one pyeclib driver and one reused stripe buffer
    (``k * chunk_bytes``, reallocated only when the chunk size changes); not thread-safe.

    Error handling: bad shapes raise ``ValueError``; too few valid fragments raise
    :class:`~ftmem.errors.UnrecoverableError`.
    """

    def __init__(self, k: int, m: int, *, tune: bool = True) -> None:
        """``k`` data chunks (>= 2: the ISA-L backend rejects 1) and ``m`` parity fragments
        (>= 1) per stripe, else ValueError; ``tune=False`` skips :func:`tune_malloc`."""
        if k < 2 or m < 1:
            raise ValueError(f"need k >= 2 and m >= 1, got k={k}, m={m}")
        if tune:
            tune_malloc()
        self.k = k
        self.m = m
        self._driver = ECDriver(k=k, m=m, ec_type=EC_TYPE)
        self._buf: np.ndarray[tuple[int], np.dtype[np.uint8]] = np.zeros(0, dtype=np.uint8)
        self._headers: dict[int, tuple[bytes, ...]] = {}

    def __repr__(self) -> str:
        return f"StripeCodec(k={self.k}, m={self.m}, ec_type={EC_TYPE!r})"

    def _check_chunk(self, chunk_bytes: int) -> None:
        if chunk_bytes < ALIGN or chunk_bytes % ALIGN:
            raise ValueError(
                f"chunk_bytes must be a positive multiple of {ALIGN}, got {chunk_bytes}"
            )

    def stripe_buffer(self, chunk_bytes: int) -> memoryview:
        """The reused, writable stripe buffer (``k * chunk_bytes``), e.g. to receive into.

        Column ``c`` is ``[c * chunk_bytes, (c + 1) * chunk_bytes)``. Its content is kept
        between calls, so padding the caller relies on must be written (or left from zeros).
        """
        self._check_chunk(chunk_bytes)
        size = self.k * chunk_bytes
        if self._buf.nbytes != size:
            self._buf = np.zeros(size, dtype=np.uint8)
        return memoryview(cast(bytes, self._buf)).cast("B")

    def encode(self, chunks: Sequence[Buffer], chunk_bytes: int | None = None) -> EncodedStripe:
        """Encode ``k`` data chunks in order (``b""`` for a pure-padding column), each at most
        ``chunk_bytes`` (a multiple of 64; default: the longest chunk, aligned up) and
        zero-padded to it.

        Raises:
            ValueError: Not ``k`` chunks, or one longer than ``chunk_bytes``.
        """
        if len(chunks) != self.k:
            raise ValueError(f"need {self.k} chunks, got {len(chunks)}")
        views = [memoryview(c).cast("B") for c in chunks]
        lengths = tuple(v.nbytes for v in views)
        if chunk_bytes is None:
            chunk_bytes = max(-(-max(lengths) // ALIGN) * ALIGN, ALIGN)
        if max(lengths) > chunk_bytes:
            raise ValueError(f"chunk of {max(lengths)} bytes > chunk_bytes={chunk_bytes}")
        self.stripe_buffer(chunk_bytes)
        buf = self._buf
        for c, v in enumerate(views):
            start = c * chunk_bytes
            buf[start : start + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            buf[start + v.nbytes : start + chunk_bytes] = 0
        return self._encode(self._buf, chunk_bytes, lengths)

    def encode_stripe(self, stripe: Buffer, lengths: Sequence[int]) -> EncodedStripe:
        """Encode a contiguous ``stripe`` of ``k * chunk_bytes`` bytes, its column padding
        already zero, in place (no copy); ``lengths``: real bytes of each column.

        Raises:
            ValueError: Size not ``k`` aligned chunks, or a length out of range.
        """
        arr = np.frombuffer(stripe, dtype=np.uint8)  # pyeclib takes numpy, not memoryview
        chunk_bytes, rest = divmod(arr.nbytes, self.k)
        self._check_chunk(chunk_bytes)
        if rest or len(lengths) != self.k or not all(0 <= n <= chunk_bytes for n in lengths):
            raise ValueError(f"bad stripe: {arr.nbytes} bytes, k={self.k}, lengths {lengths}")
        return self._encode(arr, chunk_bytes, tuple(lengths))

    def _encode(
        self,
        arr: np.ndarray[tuple[int], np.dtype[np.uint8]],
        chunk_bytes: int,
        lengths: tuple[int, ...],
    ) -> EncodedStripe:
        # pyeclib's stub says bytes; its C code takes any buffer without a release hook.
        frags: list[bytes] = self._driver.encode(cast(bytes, arr))
        if len(frags[0]) - chunk_bytes != self.header_bytes(chunk_bytes):
            raise AssertionError("pyeclib fragment layout changed")
        parity = tuple(frags[self.k :])
        sums = [checksum(arr[c * chunk_bytes : c * chunk_bytes + n]) for c, n in enumerate(lengths)]
        sums += [checksum(p) for p in parity]
        return EncodedStripe(chunk_bytes, lengths, parity, tuple(sums))

    def _templates(self, chunk_bytes: int) -> tuple[bytes, ...]:
        """Headers of fragments ``0..k+m-1`` for this chunk size (they do not depend on data)."""
        tpl = self._headers.get(chunk_bytes)
        if tpl is None:
            frags = self._driver.encode(bytes(self.k * chunk_bytes))
            tpl = tuple(f[: len(f) - chunk_bytes] for f in frags)
            self._headers[chunk_bytes] = tpl
        return tpl

    def header_bytes(self, chunk_bytes: int) -> int:
        """Size of pyeclib's header on every fragment (80 bytes with liberasurecode 1.x)."""
        self._check_chunk(chunk_bytes)
        return len(self._templates(chunk_bytes)[0])

    def reconstruct(
        self,
        fragments: Mapping[int, Buffer],
        missing: Iterable[int],
        *,
        chunk_bytes: int,
        lengths: Sequence[int],
        checksums: Sequence[int] | None = None,
    ) -> Rebuilt:
        """Rebuild fragments ``missing`` (data columns and/or parity) from ``fragments``:
        index -> data column with its real bytes only (``lengths``; pure-padding columns need
        not be supplied), or parity as stored. With ``checksums`` (the ``k + m`` of
        :class:`EncodedStripe`) each supplied fragment is verified first and dropped on
        mismatch; None trusts them.

        Raises:
            ValueError: Bad indices or lengths.
            UnrecoverableError: Fewer than ``k`` valid fragments remain.
        """
        k, total = self.k, self.k + self.m
        self._check_chunk(chunk_bytes)
        want = sorted(set(missing))
        if len(lengths) != k or any(not 0 <= i < total for i in [*want, *fragments]):
            raise ValueError(f"bad indices {want} / {sorted(fragments)} or lengths {lengths}")
        tpl = self._templates(chunk_bytes)
        usable: dict[int, bytes] = {}
        corrupt = []
        for i, frag in sorted(fragments.items()):
            if i in want:
                continue
            expect = lengths[i] if i < k else chunk_bytes + len(tpl[i])
            if memoryview(frag).nbytes != expect or (
                checksums is not None and checksum(frag) != checksums[i]
            ):
                corrupt.append(i)
                continue
            usable[i] = bytes(frag) if i >= k else self._data_fragment(tpl[i], frag, chunk_bytes)
        for i in range(k):
            if lengths[i] == 0 and i not in usable and i not in want:
                usable[i] = self._data_fragment(tpl[i], b"", chunk_bytes)
        if corrupt:
            log.warning("fragments %s failed their checksum: treated as lost", corrupt)
        if len(usable) < k:
            raise UnrecoverableError(
                f"stripe needs {k} valid fragments, has {sorted(usable)} "
                f"(corrupt: {corrupt}, missing: {want})"
            )
        chosen = [usable[i] for i in sorted(usable)[:k]]
        out: dict[int, bytes] = {}
        if want:
            for frag in self._driver.reconstruct(chosen, want):
                idx = int.from_bytes(frag[:4], "little")
                if idx not in want or frag[: len(tpl[idx])] != tpl[idx]:
                    raise AssertionError(f"pyeclib returned an unexpected fragment {idx}")
                out[idx] = frag[len(tpl[idx]) : len(tpl[idx]) + lengths[idx]] if idx < k else frag
                if checksums is not None and checksum(out[idx]) != checksums[idx]:
                    # Fragments that passed their checksums gave a wrong result: never use it.
                    raise UnrecoverableError(f"rebuilt fragment {idx} fails its checksum")
        return Rebuilt(out, tuple(corrupt))

    @staticmethod
    def _data_fragment(header: bytes, data: Buffer, chunk_bytes: int) -> bytes:
        pad = chunk_bytes - memoryview(data).nbytes
        return b"".join((header, data, bytes(pad))) if pad else b"".join((header, data))
