"""StripeEncoder: where a protector's stripes are encoded, in its thread or by an EncodePool.

Without workers :meth:`StripeEncoder.encode` gathers and encodes at once and returns the
result. With workers it queues the stripe and returns None; :meth:`StripeEncoder.ready`, called
on every turn of the protector's loop, hands queued stripes to the pool as slots free up and
returns the finished ones. A queued stripe whose step was given up meanwhile is skipped; one
the pool cannot take (its chunk is larger than the slots, or no worker is alive) is encoded in
the caller's thread. One thread owns an encoder, as it owns its protector.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from ftmem.exchange.codec import EncodedStripe, StripeCodec
from ftmem.exchange.encode_pool import EncodePool
from ftmem.exchange.placement import StripePlan

__all__ = ["StripeEncoder", "StripeKey"]

StripeKey = tuple[int, int, int]
"""(epoch, step, stripe index): what a finished stripe is returned with."""


@dataclass(frozen=True, slots=True)
class _Queued:
    key: StripeKey
    stripe: StripePlan
    gather: Callable[[memoryview], None]
    wanted: Callable[[], bool]


class StripeEncoder:
    """Encodes stripes inline or through ``workers`` processes (see the module docstring).

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
