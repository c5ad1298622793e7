"""Where a protector's stripes are encoded: in its thread, or by an EncodePool of workers.

pyeclib holds the GIL while it encodes, so encoding in a thread of the SMP stalls the
protector's own sending and receiving. A pool of ``workers`` processes
(:mod:`ftmem.exchange.encode_worker`) encodes instead, while the protector goes on moving
columns and parity (``--ftmem-tune ec-encode-workers``; 0 keeps encoding in the protector's
thread). :class:`StripeEncoder` is what the protector calls either way.

Memory: one memfd owned by the pool, cut into ``depth`` slots per worker; a slot holds one
stripe's ``k`` data chunks followed by its ``m`` parity fragments. The protector gathers a
stripe's columns into a free slot (:meth:`EncodePool.submit`: the one copy it made before
into the codec's buffer), a worker encodes it there, and :meth:`EncodePool.poll` hands back the
:class:`~ftmem.exchange.codec.EncodedStripe` (parity copied out, the slot freed).

Failures never lose a stripe: the data stays in the pool's memory until its parity is back,
so a stripe whose worker died (SIGKILL), stopped answering for ``stall_s`` (SIGSTOP: it is then
killed), or refused the request is encoded in the caller's thread instead, and the worker is
not used again (a warning says so). A worker's start-up is not a stall: ``stall_s`` counts
from its READY, and the start-up itself has ``START_S``. A pool with no live worker refuses
every submit: the caller encodes inline. One thread owns a pool.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import cast

from ftmem._logging import get_logger
from ftmem.exchange.codec import EncodedStripe, StripeCodec
from ftmem.exchange.encode_worker import (
    MAX_WORKERS,
    READY,
    READY_SLOT,
    reply_struct,
    request_struct,
)
from ftmem.exchange.placement import StripePlan

__all__ = ["MAX_WORKERS", "EncodePool", "StripeEncoder", "StripeKey"]

log = get_logger(__name__)

STALL_S = 10.0
"""A stripe not encoded this long after its submit (or its worker's READY, if later) counts
its worker as hung."""
START_S = 60.0
"""A worker given stripes that has not said READY this long after it was started is hung."""


@dataclass(frozen=True, slots=True)
class _Out:
    """A stripe given to a worker: its caller's tag, shape and submit time."""

    tag: Hashable
    chunk_bytes: int
    lengths: tuple[int, ...]
    since: float


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    slots: list[int]
    out_fd: int
    in_fd: int
    pending: bytes = b""
    busy: dict[int, _Out] = field(default_factory=dict)
    """Slot -> the stripe in it, for the stripes it has been given."""
    alive: bool = True
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    """When it said READY: its start-up (imports) is bounded by ``START_S``, and only the
    time since counts toward ``stall_s``."""


class EncodePool:
    """Worker processes that encode stripes in shared memory (see the module docstring).

    Resource handling: :meth:`close` stops the workers and unmaps the memory (also on garbage
    collection of the pool: the workers see end of input and exit). Error handling: a worker
    that dies, hangs or refuses is replaced by inline encoding, logged, never raised.
    """

    def __init__(
        self,
        codec: StripeCodec,
        workers: int,
        max_chunk_bytes: int,
        depth: int = 2,
        stall_s: float = STALL_S,
    ) -> None:
        """Start ``workers`` processes, each with ``depth`` slots (2: one encodes while the
        next is filled) for stripes of chunks up to ``max_chunk_bytes``, of ``codec``'s k and
        m (the codec also encodes inline after a failure).

        Raises:
            ValueError: ``workers < 1`` or ``depth < 1``.
            OSError: The memory or a process could not be created.
        """
        if workers < 1 or depth < 1:
            raise ValueError(f"need workers >= 1 and depth >= 1, got {workers}, {depth}")
        self.codec = codec
        self.k, self.m = codec.k, codec.m
        self.max_chunk_bytes = max_chunk_bytes
        self.stall_s = stall_s
        header = codec.header_bytes(max_chunk_bytes)
        self.slot_bytes = self.k * max_chunk_bytes + self.m * (max_chunk_bytes + header)
        nslots = workers * depth
        self._req = request_struct(self.k)
        self._rep = reply_struct(self.k, self.m)
        fd = os.memfd_create("ftmem-encode", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.slot_bytes * nslots)
            self._mem: mmap.mmap | None = mmap.mmap(fd, self.slot_bytes * nslots)
            self._view = memoryview(self._mem)
            self._workers: list[_Worker] = []
            for w in range(workers):
                self._workers.append(self._spawn(fd, list(range(w * depth, (w + 1) * depth))))
        except BaseException:
            os.close(fd)
            self.close()
            raise
        os.close(fd)
        self._inline: list[tuple[Hashable, EncodedStripe]] = []
        """Stripes of lost workers, encoded here, for the next :meth:`poll`."""
        self.encoded = 0
        """Stripes the workers encoded."""
        self.fell_back = 0
        """Stripes encoded inline after their worker failed."""

    def _spawn(self, fd: int, slots: list[int]) -> _Worker:
        nslots = len(self._view) // self.slot_bytes
        args = [str(a) for a in (self.k, self.m, fd, self.slot_bytes, nslots)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ftmem.exchange.encode_worker", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(fd,),
        )
        assert proc.stdin is not None and proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        return _Worker(proc, slots, proc.stdout.fileno(), proc.stdin.fileno())

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers if w.alive]

    @property
    def ready(self) -> list[int]:
        """Process ids of the live workers that said READY (seen by :meth:`poll`)."""
        return [w.proc.pid for w in self._workers if w.alive and w.ready_at is not None]

    @property
    def busy(self) -> bool:
        """True while a submitted stripe has not come back from :meth:`poll`."""
        return bool(self._inline) or any(w.busy for w in self._workers)

    def submit(
        self,
        tag: Hashable,
        chunk_bytes: int,
        lengths: tuple[int, ...],
        fill: Callable[[memoryview], None],
    ) -> bool:
        """Give a stripe to a worker; its result comes from :meth:`poll` with ``tag``.

        ``fill`` writes the stripe (``k * chunk_bytes``, padding included) into the view it
        gets. Returns False, calling nothing, when no slot is free, no worker is alive or the
        chunk is larger than the slots: the caller encodes the stripe itself.
        """
        if chunk_bytes > self.max_chunk_bytes:
            return False
        live = [w for w in self._workers if w.alive and len(w.busy) < len(w.slots)]
        if not live:
            return False
        worker = min(live, key=lambda w: len(w.busy))
        slot = next(s for s in worker.slots if s not in worker.busy)
        base = slot * self.slot_bytes
        fill(self._view[base : base + self.k * chunk_bytes])
        worker.busy[slot] = _Out(tag, chunk_bytes, lengths, time.monotonic())
        try:
            os.write(worker.in_fd, self._req.pack(slot, chunk_bytes, *lengths))
        except OSError as exc:  # BrokenPipeError: it died
            self._lost(worker, f"cannot be written to ({exc})")
        return True

    def poll(self) -> list[tuple[Hashable, EncodedStripe]]:
        """The stripes encoded since the last call (non-blocking), each with its tag."""
        out: list[tuple[Hashable, EncodedStripe]] = []
        now = time.monotonic()
        for w in self._workers:
            if not w.alive:
                continue
            try:
                chunk = os.read(w.out_fd, 1 << 16)
            except BlockingIOError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk == b"":
                self._lost(w, f"exited ({w.proc.poll()})")
                continue
            if chunk:
                w.pending += chunk
            while len(w.pending) >= self._rep.size:
                raw, w.pending = w.pending[: self._rep.size], w.pending[self._rep.size :]
                slot, ok, header, *sums = self._rep.unpack(raw)
                if slot == READY_SLOT and ok == READY and w.ready_at is None:
                    w.ready_at = now
                    continue
                if slot not in w.busy:
                    self._lost(w, f"answered for slot {slot}, not one it was given")
                    break
                got = w.busy.pop(slot)
                chunk_bytes, lengths = got.chunk_bytes, got.lengths
                if ok != 1 or header != self.codec.header_bytes(chunk_bytes):
                    log.warning("encode worker %d refused a stripe: encoded inline", w.proc.pid)
                    out.append((got.tag, self._encode_here(slot, got)))
                    continue
                at = slot * self.slot_bytes + self.k * chunk_bytes
                size = chunk_bytes + header
                parity = tuple(
                    bytes(self._view[at + t * size : at + (t + 1) * size]) for t in range(self.m)
                )
                self.encoded += 1
                out.append((got.tag, EncodedStripe(chunk_bytes, lengths, parity, tuple(sums))))
            if not w.alive or not w.busy:
                continue
            if w.ready_at is None:
                if now - w.started > START_S:
                    self._lost(w, f"did not start within {START_S:g} s", kill=True)
            elif now - max(w.ready_at, min(o.since for o in w.busy.values())) > self.stall_s:
                self._lost(w, f"did not answer for {self.stall_s:g} s", kill=True)
        out += self._inline
        self._inline = []
        return out

    def _encode_here(self, slot: int, stripe: _Out) -> EncodedStripe:
        base = slot * self.slot_bytes
        self.fell_back += 1
        data = self._view[base : base + self.k * stripe.chunk_bytes]
        return self.codec.encode_stripe(data, stripe.lengths)

    def _lost(self, w: _Worker, why: str, kill: bool = False) -> None:
        """Stop using ``w``: kill it (our own child, by pid), encode its stripes here."""
        log.warning(
            "encode worker %d %s: its %d stripes are encoded inline, and it is not used again",
            w.proc.pid,
            why,
            len(w.busy),
        )
        w.alive = False
        self._stop(w, kill)
        for slot, stripe in sorted(w.busy.items()):
            self._inline.append((stripe.tag, self._encode_here(slot, stripe)))
        w.busy.clear()

    @staticmethod
    def _stop(w: _Worker, kill: bool = False) -> None:
        if kill and w.proc.poll() is None:
            w.proc.send_signal(signal.SIGKILL)
        for f in (w.proc.stdin, w.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if w.proc.poll() is None:
            try:
                w.proc.wait(timeout=2.0)  # end of input: it exits by itself
            except subprocess.TimeoutExpired:
                w.proc.send_signal(signal.SIGKILL)
                w.proc.wait(timeout=5.0)

    def close(self) -> None:
        """Stop every worker (bounded) and unmap the memory; idempotent. Stripes still out
        are dropped (their step is being given up)."""
        for w in getattr(self, "_workers", []):
            w.alive = False
            self._stop(w)
            w.busy.clear()
        if getattr(self, "_mem", None) is not None:
            self._view.release()
            try:
                self._mem.close()  # type: ignore[union-attr]
            except BufferError:
                pass  # a view is still out (a caller's fill): the mapping goes with it
            self._mem = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


StripeKey = tuple[int, int, int]
"""(epoch, step, stripe index): what a finished stripe is returned with."""


@dataclass(frozen=True, slots=True)
class _Queued:
    key: StripeKey
    stripe: StripePlan
    gather: Callable[[memoryview], None]
    wanted: Callable[[], bool]


class StripeEncoder:
    """Encodes stripes inline or through ``workers`` processes.

    Without workers :meth:`encode` gathers and encodes at once and returns the result. With
    workers it queues the stripe and returns None; :meth:`ready`, called on every turn of the
    protector's loop, hands queued stripes to the pool as slots free up and returns the
    finished ones. A queued stripe whose step was given up meanwhile is skipped; one the pool
    cannot take (its chunk is larger than the slots, or no worker is alive) is encoded in the
    caller's thread. One thread owns an encoder, as it owns its protector.

    Resource handling: :meth:`close` stops the pool's workers (bounded). Error handling: the
    pool's failures are its own (a stripe is never lost); nothing here raises for them.
    """

    def __init__(self, codec: StripeCodec, workers: int, max_chunk_bytes: int) -> None:
        """Encode with ``codec``; start ``workers`` processes (0: encode in the caller's
        thread) for chunks up to ``max_chunk_bytes``."""
        self.codec = codec
        self.pool = EncodePool(codec, workers, max_chunk_bytes) if workers > 0 else None
        """The worker processes (None: inline)."""
        self._queue: deque[_Queued] = deque()
        self._done: list[tuple[StripeKey, EncodedStripe]] = []

    @property
    def busy(self) -> bool:
        """True while a stripe is queued or with the workers (the caller should poll soon)."""
        return bool(self._queue or self._done) or (self.pool is not None and self.pool.busy)

    def encode(
        self,
        key: StripeKey,
        stripe: StripePlan,
        gather: Callable[[memoryview], None],
        wanted: Callable[[], bool],
    ) -> EncodedStripe | None:
        """Encode ``stripe`` now (returned) or queue it for the workers (None: it comes back
        from :meth:`ready` with ``key``). ``gather`` writes the stripe's ``k`` chunks, padding
        included, into the buffer it gets; ``wanted()`` false drops a queued stripe."""
        if self.pool is None:
            return self._here(stripe, gather)
        self._queue.append(_Queued(key, stripe, gather, wanted))
        self._submit()
        return None

    def _here(self, s: StripePlan, gather: Callable[[memoryview], None]) -> EncodedStripe:
        buf = self.codec.stripe_buffer(s.chunk_bytes)  # reused: gather rewrites every chunk
        gather(buf)
        return self.codec.encode_stripe(buf, s.lengths)

    def ready(self) -> list[tuple[StripeKey, EncodedStripe]]:
        """The stripes finished since the last call (non-blocking); queued ones go to the
        workers as slots free up."""
        if self.pool is None:
            return []
        out, self._done = self._done, []
        out += [(cast(StripeKey, key), enc) for key, enc in self.pool.poll()]
        self._submit()
        return out

    def _submit(self) -> None:
        """Hand queued stripes to the workers while they have free slots."""
        assert self.pool is not None
        while self._queue:
            q = self._queue[0]
            if not q.wanted():
                self._queue.popleft()
                continue
            if not self.pool.submit(q.key, q.stripe.chunk_bytes, q.stripe.lengths, q.gather):
                if q.stripe.chunk_bytes <= self.pool.max_chunk_bytes and self.pool.pids:
                    return  # the pool is full: a later call submits it
                self._done.append((q.key, self._here(q.stripe, q.gather)))
            self._queue.popleft()

    def drop_queued(self) -> None:
        """Forget the stripes not yet given to the workers (their steps are given up)."""
        self._queue.clear()

    def close(self) -> None:
        """Stop the workers (bounded); stripes still out are dropped. Idempotent."""
        self._queue.clear()
        self._done.clear()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
