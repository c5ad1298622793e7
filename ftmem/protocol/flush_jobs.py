"""Typed JSON lines between the SMP's flush service and its worker process.

The SMP (smp/flush_process.py) writes one job per line to the worker's stdin
(``python -m ftmem.tiers.flush_worker``), tagged by ``op``: ``flush`` (:class:`FlushJob`) or
``assemble`` (:class:`AssembleJob`). The worker answers one reply per line on its stdout,
tagged by ``event``: ``ready`` (:class:`WorkerReady`), ``progress`` (:class:`Progress`),
``tier`` (:class:`TierWritten`) and ``done`` (:class:`JobDone`); the other fields are the
dataclass's, e.g. ``{"event": "ready", "pid": 123}``.

:func:`encode` writes any of them; :func:`parse_job` and :func:`parse_reply` read a line back,
every field checked (:func:`ftmem.typed_json.build`): anything else raises
:class:`~ftmem.errors.ProtocolError`. Nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

from ftmem.errors import ProtocolError
from ftmem.typed_json import build, loads

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


def _read(line: str | bytes, key: str, table: dict[str, type[Any]]) -> Any:
    """The message of ``table`` that the line's ``key`` names, every field checked.

    Raises:
        ProtocolError: not a JSON object naming one, or a field missing, unknown or of the
            wrong type.
    """
    doc = loads(line, "a flush line", MAX_LINE)
    if not isinstance(doc, dict):
        raise ProtocolError("not a JSON object")
    name = doc.pop(key, None)
    cls = table.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"no {key!r} of {sorted(table)}")
    return build(cls, doc)


def parse_job(line: str | bytes) -> Job:
    """A job line read back (:func:`_read`). Raises ProtocolError."""
    job: Job = _read(line, "op", _OPS)
    return job


def parse_reply(line: str | bytes) -> Reply:
    """A reply line read back (:func:`_read`). Raises ProtocolError."""
    reply: Reply = _read(line, "event", _EVENTS)
    return reply
