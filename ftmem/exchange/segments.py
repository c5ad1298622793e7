"""SegmentedBytes: several buffers read as one byte string, without joining them.

A node's snapshot for the peer exchange is the concatenation of its ranks' slot files (each up
to the bytes its layout uses). The protector reads byte ranges of it; a range inside one
segment is a zero-copy memoryview, a range across a boundary is joined into new bytes (rare:
at most one per segment boundary and stripe).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Buffer = memoryview | bytes | bytearray
"""Any contiguous bytes (wrap a numpy array or tensor storage in ``memoryview`` first)."""


class SegmentedBytes:
    """Read-only concatenation of ``segments`` (see the module docstring)."""

    def __init__(self, segments: Sequence[Buffer]) -> None:
        self._views = [memoryview(s).cast("B") for s in segments]
        self._starts: list[int] = []
        total = 0
        for v in self._views:
            self._starts.append(total)
            total += v.nbytes
        self.nbytes = total

    @classmethod
    def of(cls, data: SegmentedBytes | Buffer) -> SegmentedBytes:
        """``data`` itself if already segmented, else one segment over it."""
        return data if isinstance(data, SegmentedBytes) else cls([data])

    def read(self, offset: int, length: int) -> memoryview | bytes:
        """Bytes ``[offset, offset + length)``; raises ValueError if outside the data."""
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(f"range {offset}+{length} is outside {self.nbytes} bytes")
        if length == 0:
            return b""
        i = bisect.bisect_right(self._starts, offset) - 1
        start = offset - self._starts[i]
        v = self._views[i]
        if start + length <= v.nbytes:
            return v[start : start + length]
        parts = []
        left = length
        while left:
            v = self._views[i]
            take = min(left, v.nbytes - start)
            parts.append(v[start : start + take])
            left -= take
            i, start = i + 1, 0
        return b"".join(parts)

    def release(self) -> None:
        """Release the views (the underlying buffers can then be closed)."""
        for v in self._views:
            v.release()
        self._views = []
