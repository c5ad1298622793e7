"""Typed JSON lines between the SMP's flush service and its worker process.

The SMP (``smp/flush_scheduler.py``, through ``smp/flush_process.py``) writes one job per line
to the worker's stdin; the worker (``python -m ftmem.tiers.flush_worker``) answers with one
reply per line on its stdout::

    SMP -> worker   {"op": "flush", "id": 3, "step": 40, "sources": [{rank, step, path,
                     capacity, layout}...], "tiers": ["/local/ckpt", "/shared/ckpt"], "keep": 2,
                     "writers": 2, "direct": true, "world_size": 8, "shared": true,
                     "assemble_timeout": 300.0}                                      FlushJob
                    {"op": "assemble", "id": 4, "tier": "/shared/ckpt", "world_size": 8,
                     "keep": 2}                                                   AssembleJob
    worker -> SMP   {"event": "ready", "pid": 123}                                WorkerReady
                    {"event": "progress", "id": 3, "stage": "writing", "tier": 0, "done": B,
                     "total": T, "unit": "bytes"}                                    Progress
                    {"event": "tier", "id": 3, "tier": 0, "path": "...", "bytes": N}
                                                                                 TierWritten
                    {"event": "done", "id": 3, "ok": true, "paths": [...], "bytes": N,
                     "seconds": S, "assembled": [40], "error": ""}                    JobDone

:func:`encode` writes any of them; :func:`parse_job` and :func:`parse_reply` read a line back,
checking every field's type (the rank protocol's rules, :func:`ftmem.typed_json.build`):
anything else raises :class:`~ftmem.errors.ProtocolError`. Nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

from ftmem.errors import ProtocolError
from ftmem.typed_json import build

__all__ = [
    "AssembleJob",
    "FlushJob",
    "Job",
    "JobDone",
    "Progress",
    "Reply",
    "SlotSource",
    "TierWritten",
    "WorkerReady",
    "encode",
    "parse_job",
    "parse_reply",
]

MAX_LINE = 16 << 20
"""Longest line either side reads (a job lists one source per local rank)."""


@dataclass(frozen=True, slots=True)
class SlotSource:
    """One rank's committed slot of the step: the file and its layout (format/layout.py)."""

    rank: int
    step: int
    path: str
    capacity: int
    layout: str


@dataclass(frozen=True, slots=True)
class FlushJob:
    """Write ``step`` from the slots to the tiers (first from the slots, then copies)."""

    id: int
    step: int
    sources: list[SlotSource]
    tiers: list[str]
    keep: int = 2
    """Complete checkpoints kept per tier."""
    writers: int = 2
    direct: bool = True
    world_size: int = 0
    """The job's world size (0: unknown); fewer ranks here than that: this node's part."""
    shared: bool = False
    """The last tier is shared: the node of rank 0 assembles the parts there."""
    assemble_timeout: float = 0.0
    """Seconds to wait for the other nodes' parts (0: one look)."""


@dataclass(frozen=True, slots=True)
class AssembleJob:
    """(The node of rank 0) assemble the newest complete set of parts in ``tier``."""

    id: int
    tier: str
    world_size: int
    keep: int = 2


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The worker has imported torch and DCP: flushes can start without a cold start."""

    pid: int


@dataclass(frozen=True, slots=True)
class Progress:
    """How far the job's current stage is (``unit``: bytes, or ranks while waiting for parts)."""

    id: int
    stage: str
    tier: int
    done: int
    total: int
    unit: str = "bytes"


@dataclass(frozen=True, slots=True)
class TierWritten:
    """Tier ``tier`` holds the checkpoint (or this node's part) at ``path``, durable."""

    id: int
    tier: int
    path: str
    bytes: int


@dataclass(frozen=True, slots=True)
class JobDone:
    """The job's end: ok, or why not (``id`` -1: a line that was not a job)."""

    id: int
    ok: bool
    paths: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    assembled: list[int] = field(default_factory=list)
    """Steps assembled into a global checkpoint by this job."""
    error: str = ""


Job: TypeAlias = FlushJob | AssembleJob
Reply: TypeAlias = WorkerReady | Progress | TierWritten | JobDone

_OPS: dict[str, type[Any]] = {"flush": FlushJob, "assemble": AssembleJob}
_EVENTS: dict[str, type[Any]] = {
    "ready": WorkerReady,
    "progress": Progress,
    "tier": TierWritten,
    "done": JobDone,
}
_TAGS = {cls: ("op", name) for name, cls in _OPS.items()}
_TAGS |= {cls: ("event", name) for name, cls in _EVENTS.items()}


def encode(msg: Job | Reply) -> str:
    """``msg`` as one JSON line (newline included)."""
    key, name = _TAGS[type(msg)]
    return json.dumps({key: name, **asdict(msg)}) + "\n"


def _read(
    line: str | bytes, key: str, table: dict[str, type[Any]]
) -> tuple[type[Any], dict[str, Any]]:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"a line of {len(line)} bytes")
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProtocolError("not a JSON object")
    name = doc.pop(key, None)
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"no {key!r} of {sorted(table)}")
    return cls, doc


def parse_job(line: str | bytes) -> Job:
    """A job line read back, every field checked.

    Raises:
        ProtocolError: not a job, or a field missing, unknown or of the wrong type.
    """
    cls, doc = _read(line, "op", _OPS)
    return build(cls, doc)  # type: ignore[no-any-return]


def parse_reply(line: str | bytes) -> Reply:
    """A reply line read back, every field checked.

    Raises:
        ProtocolError: not a reply, or a field missing, unknown or of the wrong type.
    """
    cls, doc = _read(line, "event", _EVENTS)
    return build(cls, doc)  # type: ignore[no-any-return]
