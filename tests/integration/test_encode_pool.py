"""EncodePool: real worker processes encode stripes in shared memory, bitwise as the codec does
in-process; a worker killed (SIGKILL) or stopped (SIGSTOP) mid-run loses no stripe."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Hashable

import numpy as np
import pytest

from ftmem.exchange.codec import EncodedStripe, StripeCodec
from ftmem.exchange.encode_pool import EncodePool, StripeEncoder

CHUNK = 64 << 10


def stripes(k: int, count: int, seed: int = 0) -> list[tuple[bytes, tuple[int, ...]]]:
    """``count`` stripes of ``k`` columns, some short (zero-padded), one all padding."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        lengths = tuple(CHUNK if (i + c) % 3 else int(rng.integers(0, CHUNK)) for c in range(k))
        buf = np.zeros(k * CHUNK, dtype=np.uint8)
        for c, n in enumerate(lengths):
            buf[c * CHUNK : c * CHUNK + n] = rng.integers(0, 256, n, dtype=np.uint8)
        out.append((buf.tobytes(), lengths))
    return out


def encode_all(
    pool: EncodePool,
    work: list[tuple[bytes, tuple[int, ...]]],
    during: int = -1,
    act: object = None,
    timeout: float = 60.0,
) -> dict[Hashable, EncodedStripe]:
    """Submit every stripe (as slots free up) and collect them all; ``act()`` runs once
    after stripe ``during`` is submitted."""
    done: dict[Hashable, EncodedStripe] = {}
    i = 0
    deadline = time.monotonic() + timeout
    while len(done) < len(work):
        assert time.monotonic() < deadline, f"{len(done)} of {len(work)} stripes back"
        while i < len(work):
            data, lengths = work[i]

            def fill(view: memoryview, data: bytes = data) -> None:
                view[:] = data

            if not pool.submit(i, CHUNK, lengths, fill):
                break
            if i == during and callable(act):
                act()
            i += 1
        for tag, enc in pool.poll():
            assert tag not in done
            done[tag] = enc
        time.sleep(0.0005)
    return done


@pytest.mark.parametrize(("k", "m", "workers"), [(2, 1, 1), (3, 2, 2)])
def test_workers_encode_like_the_codec(k: int, m: int, workers: int) -> None:
    codec = StripeCodec(k, m)
    work = stripes(k, 24)
    pool = EncodePool(codec, workers, CHUNK)
    try:
        got = encode_all(pool, work)
        assert pool.encoded == len(work) and pool.fell_back == 0
    finally:
        pool.close()
    for i, (data, lengths) in enumerate(work):
        assert got[i] == codec.encode_stripe(data, lengths), i


def test_a_chunk_larger_than_the_slots_is_refused() -> None:
    pool = EncodePool(StripeCodec(2, 1), 1, CHUNK)
    try:
        assert not pool.submit("big", 2 * CHUNK, (1, 1), lambda v: None)
    finally:
        pool.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_a_worker_killed_or_stopped_mid_run_loses_no_stripe(sig: signal.Signals) -> None:
    """Two workers; one is signalled with stripes outstanding. Every stripe comes back
    bitwise (the dead or hung worker's in the caller's thread), the other worker goes on,
    and the signalled one is gone (a stopped one is killed after ``stall_s``)."""
    codec = StripeCodec(2, 1)
    work = stripes(2, 40, seed=1)
    pool = EncodePool(codec, 2, CHUNK, stall_s=1.0)
    victim = pool.pids[0]
    try:
        # Both started (a worker stopped before its READY has START_S, not stall_s).
        deadline = time.monotonic() + 60
        while len(pool.ready) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            assert pool.poll() == []
            time.sleep(0.01)
        got = encode_all(pool, work, during=10, act=lambda: os.kill(victim, sig))
        assert pool.pids and victim not in pool.pids
        assert pool.fell_back >= 1 and pool.encoded + pool.fell_back == len(work)
        with pytest.raises(ChildProcessError):
            os.waitpid(victim, os.WNOHANG)  # reaped: no zombie left behind
    finally:
        pool.close()
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for i, (data, lengths) in enumerate(work):
        assert got[i] == codec.encode_stripe(data, lengths), i


def test_with_every_worker_gone_submit_refuses_and_close_is_idempotent() -> None:
    pool = EncodePool(StripeCodec(2, 1), 1, CHUNK)
    try:
        (pid,) = pool.pids
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pool.pids:
            assert time.monotonic() < deadline
            pool.poll()
            time.sleep(0.01)
        assert not pool.submit(0, CHUNK, (CHUNK, CHUNK), lambda v: None)
    finally:
        pool.close()
        pool.close()


def test_stripe_encoder_drops_unwanted_stripes_and_encodes_oversized_ones_itself() -> None:
    """Queued stripes whose step is gone are skipped; a stripe larger than the pool's slots
    is encoded in the caller's thread and returned by ``ready`` like the others."""
    from ftmem.exchange.placement import StripePlan, plan_group, stripe_map

    codec = StripeCodec(2, 1)
    plan = plan_group([0, 1, 2], 1)
    small = stripe_map(plan, {0: CHUNK, 1: CHUNK, 2: CHUNK}, 2 * CHUNK)[0]
    big = stripe_map(plan, {0: 4 * CHUNK, 1: 4 * CHUNK, 2: 4 * CHUNK}, 8 * CHUNK)[0]
    data = {s.chunk_bytes: os.urandom(2 * s.chunk_bytes) for s in (small, big)}

    def gather(s: StripePlan) -> Callable[[memoryview], None]:
        def fill(buf: memoryview) -> None:
            buf[:] = data[s.chunk_bytes]

        return fill

    enc = StripeEncoder(codec, 1, CHUNK)
    try:
        assert enc.encode((0, 1, 0), small, gather(small), lambda: False) is None
        assert enc.encode((0, 2, 0), big, gather(big), lambda: True) is None
        assert enc.encode((0, 3, 0), small, gather(small), lambda: True) is None
        got: dict[object, EncodedStripe] = {}
        deadline = time.monotonic() + 30
        while enc.busy:
            assert time.monotonic() < deadline
            got.update(enc.ready())
            time.sleep(0.001)
        assert set(got) == {(0, 2, 0), (0, 3, 0)}
        assert enc.pool is not None and enc.pool.encoded == 1
        for key, s in (((0, 2, 0), big), ((0, 3, 0), small)):
            assert got[key] == codec.encode_stripe(data[s.chunk_bytes], s.lengths)
    finally:
        enc.close()


def test_a_workers_start_up_is_not_a_stall() -> None:
    """Stripes given to workers that are still starting (their imports take far longer than
    this pool's ``stall_s``, as a loaded host made them take longer than the 1 s above) wait
    for them: every stripe is encoded by a worker, none counted hung."""
    codec = StripeCodec(2, 1)
    work = stripes(2, 8, seed=2)
    pool = EncodePool(codec, 2, CHUNK, stall_s=0.05)
    try:
        got = encode_all(pool, work)
        assert pool.encoded == len(work) and pool.fell_back == 0
        assert len(pool.pids) == 2
    finally:
        pool.close()
    for i, (data, lengths) in enumerate(work):
        assert got[i] == codec.encode_stripe(data, lengths), i
