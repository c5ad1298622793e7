"""Restoring a verified snapshot into CUDA tensors through page-locked staging buffers.

A restarted process's slot mappings are not page-locked (locking one costs as much as a
pageable copy), and a pageable host-to-device copy is slow: :func:`to_device` checks a run of
pieces on a thread, copies it into a free page-locked staging buffer and queues that buffer's
copy on a side stream, so checks and host copies overlap the transfers.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ftmem.client.flatten import StoredTensor
from ftmem.format.layout import HASH_PIECE, hash_bytes, pieces
from ftmem.shm import MappedSegment

_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the threads


def restore_pool(threads: int) -> ThreadPoolExecutor:
    """The process's restore pool of ``threads`` threads, made once (starting threads costs
    much of a small state's restore); they idle between restores."""
    with _lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="ftmem-restore")
        return pool


def run_all(fn: Callable[[Any], None], jobs: Sequence[Any], threads: int) -> None:
    """``fn`` on every job: on :func:`restore_pool` with ``threads > 1``, else in order here."""
    if threads > 1 and len(jobs) > 1:
        for _ in restore_pool(threads).map(fn, jobs):
            pass
    else:
        for job in jobs:
            fn(job)


STAGING_BYTES = 16 << 20
"""Bytes of one page-locked staging buffer of :func:`to_device` (a multiple of HASH_PIECE)."""


def device_threads() -> int:
    """Threads that check and stage a restore into CUDA tensors: up to 12 (the training loop
    is not running)."""
    return max(1, min(12, len(os.sched_getaffinity(0))))


class _Staging:
    """Page-locked host buffers for host-to-device copies, each with the event of its last
    copy; made once per process and device (``threads + 2`` buffers of ``STAGING_BYTES``)."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.free: queue.SimpleQueue[tuple[torch.Tensor, Any]] = queue.SimpleQueue()
        self.count = count
        for _ in range(count):
            buf = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            self.free.put((buf, None))


_staging: dict[torch.device, _Staging] = {}
os.register_at_fork(after_in_child=_staging.clear)  # a forked child's CUDA state is not ours


def _staging_for(device: torch.device, count: int) -> _Staging:
    with _lock:
        st = _staging.get(device)
        if st is None or st.count < count:
            st = _staging[device] = _Staging(device, count)
        return st


def to_device(
    items: list[tuple[StoredTensor, torch.Tensor, list[str]]], seg: MappedSegment, threads: int
) -> set[str]:
    """Check and copy contiguous CUDA targets (``(stored, target's bytes, piece hashes)``) out
    of the slot ``seg``; return the names whose pieces failed. Each thread hashes a run of
    pieces (at most ``STAGING_BYTES``), copies it into a free staging buffer and queues the
    buffer's copy to the device on a side stream; a run whose pieces do not all match is not
    copied. Returns when every copy has reached the device."""
    dev = items[0][1].device
    view, src = seg.view, seg.tensor.numpy()
    staging = _staging_for(dev, threads + 2)
    staging.stream.wait_stream(torch.cuda.current_stream(dev))
    runs: list[tuple[StoredTensor, torch.Tensor, int, int, list[str]]] = []
    per = STAGING_BYTES // HASH_PIECE
    for st, dst, expect in items:
        bounds = pieces(st.nbytes)
        for i in range(0, len(bounds), per):
            a, b = bounds[i][0], bounds[min(len(bounds), i + per) - 1][1]
            runs.append((st, dst, i, b - a, expect[i : i + per]))
    failed: set[str] = set()
    lock = threading.Lock()

    def run(job: tuple[StoredTensor, torch.Tensor, int, int, list[str]]) -> None:
        st, dst, first, n, hashes = job
        a = first * HASH_PIECE
        at = st.offset + a
        for k, h in enumerate(hashes):
            lo = at + k * HASH_PIECE
            if hash_bytes(view[lo : min(at + n, lo + HASH_PIECE)]) != h:
                with lock:
                    failed.add(repr(st.name))
                return
        buf, event = staging.free.get()
        try:
            if event is not None:
                event.synchronize()  # its previous copy to the device is done
            np.copyto(buf[:n].numpy(), src[at : at + n])
            with torch.cuda.stream(staging.stream):
                dst[a : a + n].copy_(buf[:n], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(staging.stream)
        finally:
            staging.free.put((buf, event))

    try:
        run_all(run, runs, threads)
    finally:
        staging.stream.synchronize()
    return failed
