"""An encode worker process: encodes stripes that its :class:`~ftmem.exchange.encode_pool.EncodePool`
placed in shared memory, and writes their parity back there.

Started by the pool as ``python -m ftmem.exchange.encode_worker K M FD SLOT_BYTES SLOTS``: ``FD``
is an inherited memfd of ``SLOTS`` slots of ``SLOT_BYTES`` each, shared with the parent. The
parent owns the memory and the slots; the worker only reads a slot's data and writes its
parity, one request at a time.

Wire (fixed-size little-endian structs on the worker's stdin and stdout, nothing pickled):

* request (:data:`request_struct`): slot, chunk_bytes, then the ``k`` real column lengths;
* reply (:data:`reply_struct`): slot, status (1 = encoded; 0 = refused: the request was out of
  range), the fragments' header bytes, then the ``k + m`` xxh3-64 checksums. The ``m`` parity
  fragments (header included, ``chunk_bytes + header`` each) follow the data in the slot.
  The first reply, sent once the worker is set up, is READY: slot :data:`READY_SLOT`, status
  :data:`READY`.

A worker exits on end of input (its parent closed the pipe or died) and, on Linux, is killed
when the thread that started it ends (``PR_SET_PDEATHSIG`` follows the creating thread: the
protector's owner, which closes the pool before it ends anyway). Its errors go to stderr,
which it shares with its parent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import signal
import struct
import sys

__all__ = ["MAX_WORKERS", "READY", "READY_SLOT", "reply_struct", "request_struct"]

MAX_WORKERS = 64
"""Most encode workers per SMP (``--ftmem-tune ec-encode-workers``; the SMP clamps a PEER_BIND's
count to it). Here, not in encode_pool.py, because this module imports nothing heavy: the
launcher's command line checks the flag against it."""


READY_SLOT = 0xFFFFFFFF
READY = 2
"""The status of the READY reply (its slot: READY_SLOT)."""


def request_struct(k: int) -> struct.Struct:
    """Wire layout of a request: ``slot, chunk_bytes, lengths[k]``."""
    return struct.Struct(f"<II{k}Q")


def reply_struct(k: int, m: int) -> struct.Struct:
    """Wire layout of a reply: ``slot, status, header_bytes, checksums[k + m]``."""
    return struct.Struct(f"<III{k + m}Q")


def _read_exact(fd: int, n: int) -> bytes | None:
    """``n`` bytes from ``fd``, or None at end of input."""
    parts: list[bytes] = []
    while n:
        part = os.read(fd, n)
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: end of input still stops the worker


def serve(k: int, m: int, fd: int, slot_bytes: int, slots: int) -> None:
    """Encode requests from stdin until end of input (see the module docstring)."""
    from ftmem.exchange.codec import StripeCodec

    codec = StripeCodec(k, m)
    mem = mmap.mmap(fd, slot_bytes * slots)
    os.close(fd)
    view = memoryview(mem)
    req, rep = request_struct(k), reply_struct(k, m)
    zeros = (0,) * (k + m)
    os.write(1, rep.pack(READY_SLOT, READY, 0, *zeros))
    while (raw := _read_exact(0, req.size)) is not None:
        slot, chunk, *lengths = req.unpack(raw)
        header = codec.header_bytes(chunk) if chunk and chunk % 64 == 0 else 0
        need = k * chunk + m * (chunk + header)
        if slot >= slots or not header or need > slot_bytes or max(lengths) > chunk:
            print(f"encode worker: refused slot {slot}, chunk {chunk}", file=sys.stderr)
            os.write(1, rep.pack(slot, 0, 0, *zeros))
            continue
        base = slot * slot_bytes
        enc = codec.encode_stripe(view[base : base + k * chunk], lengths)
        at = base + k * chunk
        for frag in enc.parity:
            view[at : at + len(frag)] = frag
            at += len(frag)
        os.write(1, rep.pack(slot, 1, header, *enc.checksums))


if __name__ == "__main__":  # ``K M FD SLOT_BYTES SLOTS``
    _die_with_parent()
    serve(*(int(a) for a in sys.argv[1:]))
