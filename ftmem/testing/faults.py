"""Deterministic fault injection at named points of ftmem's code, driven by FTMEM_FAULT.

``FTMEM_FAULT="in_copy:rank=1:step=12"`` SIGKILLs rank 1 inside the copy of step 12's
snapshot (before its commit). The fault fires at most once per process. Faults are real
signals to real processes; nothing is mocked. Unset, each check costs one comparison.
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


class Fault(enum.Enum):
    """What happens at the point."""

    KILL = "kill"
    STOP = "stop"


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


def maybe_inject(point: Point, rank: int, step: int) -> None:
    """Fire the configured fault if ``point``, ``rank`` and ``step`` match (once)."""
    global _fired
    if _SPEC is None or _fired:
        return
    p, r, s, fault = _SPEC
    if p is point and (r is None or r == rank) and (s is None or s == step):
        _fired = True
        os.kill(os.getpid(), signal.SIGKILL if fault is Fault.KILL else signal.SIGSTOP)
