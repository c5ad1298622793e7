"""Deterministic fault injection at named points of ftmem's code, driven by FTMEM_FAULT.

``FTMEM_FAULT="in_copy:rank=1:step=12"`` SIGKILLs rank 1 inside the copy of step 12's
snapshot (before its commit). The fault fires at most once per process. Faults are real
signals to real processes, or real damage to real memory; nothing is mocked. Unset, each check
costs one comparison. In an SMP, ``rank`` matches the node index of the peer mesh:
``FTMEM_FAULT="parity_held:rank=2:fault=flip"`` flips a byte of node 2's parity once it has
protected a step; ``in_protect:rank=1:step=5`` SIGKILLs node 1's SMP as it starts protecting
step 5.
"""

from __future__ import annotations

import enum
import os
import signal

from ftmem.config import ENV_FAULT


class Point(enum.Enum):
    """Where a fault can be injected."""

    IN_COPY = "in_copy"
    """Inside the background copy of a snapshot, before its commit."""
    BEFORE_COMMIT = "before_commit"
    """After the copy, before the COMMIT is sent."""
    IN_PROTECT = "in_protect"
    """(SMP) A protection round has pinned the step and is about to exchange it."""
    PARITY_HELD = "parity_held"
    """(SMP) A step was just protected: its parity is held in memory."""
    IN_FLUSH = "in_flush"
    """(Flusher) Every file of a checkpoint is written, before the rename that completes it."""


class Fault(enum.Enum):
    """What happens at the point."""

    KILL = "kill"
    STOP = "stop"
    FLIP = "flip"
    """Corrupt data at the point (the caller does it when :func:`maybe_inject` says so)."""
    ENOSPC = "enospc"
    """Fail the write at the point as if the disk were full (the caller raises)."""


def _parse(spec: str) -> tuple[Point, int | None, int | None, Fault] | None:
    if not spec:
        return None
    parts = spec.split(":")
    point = Point(parts[0])
    rank = step = None
    fault = Fault.KILL
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k == "rank":
            rank = int(v)
        elif k == "step":
            step = int(v)
        elif k == "fault":
            fault = Fault(v)
        else:
            raise ValueError(f"{ENV_FAULT}: unknown field {k!r}")
    return point, rank, step, fault


_SPEC = _parse(os.environ.get(ENV_FAULT, ""))
_fired = False


def maybe_inject(point: Point, rank: int, step: int) -> bool:
    """Fire the configured fault if ``point``, ``rank`` and ``step`` match (once).

    Returns True when the fault is FLIP or ENOSPC: the caller corrupts its data or fails
    its write there.
    """
    global _fired
    if _SPEC is None or _fired:
        return False
    p, r, s, fault = _SPEC
    if p is point and (r is None or r == rank) and (s is None or s == step):
        _fired = True
        if fault in (Fault.FLIP, Fault.ENOSPC):
            return True
        os.kill(os.getpid(), signal.SIGKILL if fault is Fault.KILL else signal.SIGSTOP)
    return False
