"""The snapshot management process (SMP): one per node, ``python -m ftmem.smp``.

Modules: store.py (per-rank slot state machine, pure), slot_store.py (SlotStore: every
rank's slots behind one lock, the only way any thread changes them), daemon.py (SmpDaemon:
sockets and the poll loop), handlers.py (request kind -> handler, deferred replies),
allocation.py (slot files and their creation off the loop), records.py (commit records),
hashing.py (the checksum pool), node_lock.py (one SMP per run and node), spawn.py (start one
with a readiness handshake), __main__.py (its CLI). The protection service (erasure coding
across nodes, one thread): protection.py (the service and its rounds), protection_state.py
(what the service owns and hands its parts: the generation, the pinned steps, the status
board; the loop's commands and their results), protection_sync.py (the generation's sync and
a lost node's rebuild). The disk tiers: flush_scheduler.py (when and what to flush),
flush_process.py (the flush worker process). Here: :func:`drain`, how the loop takes what its
threads queued.
"""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def drain(q: queue.Queue[T]) -> list[T]:
    """Every item ``q`` holds now, oldest first (non-blocking). Called on every pass of the
    SMP's loop: an empty queue costs one look, not a raised ``queue.Empty``."""
    out = []
    while not q.empty():
        try:
            out.append(q.get_nowait())
        except queue.Empty:  # taken by another consumer in between
            break
    return out
