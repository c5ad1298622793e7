"""Typed messages between a rank (or a tool) and its node's SMP.

Every request is one :class:`Kind` plus a frozen dataclass payload that names its answer's
type (``Begin(Request[BeginReply])``); every reply is a :class:`Reply` that carries that
answer's fields, or an error and its :class:`~ftmem.errors.ErrorKind`. Payloads travel as
JSON (wire.py); :func:`from_fields` checks every field against its annotation.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Generic, TypeVar

from ftmem.config import MAX_SLOT_BYTES
from ftmem.errors import ErrorKind
from ftmem.protocol.status import SmpStatus, SyncReply
from ftmem.typed_json import MAX_INT, Most, Range, build, parse
from ftmem.typed_json import to_fields as to_fields  # the writer beside from_fields

PROTOCOL_VERSION = 1
Step = Annotated[int, Range(0, (1 << 62) - 1)]
"""A training step in a request (the SMP refuses any other)."""
SlotBytes = Annotated[int, Range(1, MAX_SLOT_BYTES)]
"""The size of a snapshot or slot in a request."""
Size = Annotated[int, Range(0, 1 << 62)]
"""An offset or size within a slot."""


class Kind(enum.IntEnum):
    """Message kinds. Values are part of the wire format: never renumber."""

    REPLY = 1
    PING = 2
    HELLO = 3
    BEGIN = 4
    PREPARE = 5
    COMMIT = 6
    ABORT = 7
    QUERY = 8
    DISCARD_NEWER = 9
    HEARTBEAT = 10
    STATUS = 11
    PEER_BIND = 12
    PEER_START = 13
    FLUSH = 14
    SKIPPED = 15
    PEER = 20


@dataclass(frozen=True, slots=True)
class SmpReady:
    """What a ready SMP says of itself: on its readiness pipe (``READY {json}``) and in its
    run directory's ready file, which its clients and a second SMP of the run read."""

    pid: Annotated[int, Range(1, (1 << 31) - 1)]
    endpoint: Annotated[str, Most(4096)]
    node: Annotated[str, Most(256)]
    run_id: Annotated[str, Most(256)]

    def to_json(self) -> str:
        """The document (one line of JSON)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> SmpReady:
        """Read the document.

        Raises:
            ProtocolError: not JSON, or not a ready SMP's document.
        """
        return parse(cls, text, what="SMP ready document")


class Decision(str, enum.Enum):
    """What the SMP decided about a slot for a save (the ``action`` of a BeginReply)."""

    WRITE = "write"
    """Write into the granted slot."""
    RESIZE = "resize"
    """No slot is big enough: grow them (PREPARE) first."""
    SKIP = "skip"
    """No slot may be written now (``reason`` says why); the save is skipped."""
    NONE = "none"
    """No slot was asked for (a COMMIT without ``next_nbytes``)."""


@dataclass(frozen=True, slots=True)
class BeginReply:
    """The answer to BEGIN, and to COMMIT for the rank's next save: a slot granted for
    writing (``slot``, its generation ``gen``, its file ``path`` of ``capacity`` bytes), or
    why not."""

    action: Decision
    slot: int = -1
    gen: int = 0
    path: str = ""
    capacity: int = 0
    reason: str = ""
    board: str = ""
    """Set for a conditional grant (COMMIT only): the SMP's grant board, whose byte ``cell``
    says when the slot may be written (:class:`ftmem.shm.GrantBoard`)."""
    cell: int = -1


@dataclass(frozen=True, slots=True)
class SlotFile:
    """One slot file the SMP made."""

    slot: int
    path: str
    capacity: int


@dataclass(frozen=True, slots=True)
class Prepared:
    """The answer to PREPARE: the slot files made (none: nothing could be grown)."""

    slots: list[SlotFile] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class HelloReply:
    """The answer to HELLO: the SMP's pid and identity, the slots per rank, and the directory
    its slot files live in (the rank maps only files directly in it)."""

    pid: int
    node: str
    run_id: str
    slots: int
    shm_dir: str


@dataclass(frozen=True, slots=True)
class PingReply:
    """The answer to PING: the SMP's pid."""

    pid: int


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """One verified snapshot of a rank the SMP holds: its step, slot (generation ``gen``),
    file ``path`` of ``capacity`` bytes, and its layout document (with every checksum)."""

    step: int
    slot: int
    gen: int
    path: str
    capacity: int
    layout: str


@dataclass(frozen=True, slots=True)
class QueryReply:
    """The answer to QUERY: the rank's verified snapshots, newest step first."""

    snapshots: list[SnapshotInfo]


@dataclass(frozen=True, slots=True)
class FlushReply:
    """The answer to FLUSH: the step made durable, the paths written (one per tier) and how
    long it took."""

    step: int
    paths: list[str]
    seconds: float


@dataclass(frozen=True, slots=True)
class PeerBound:
    """The answer to PEER_BIND: the endpoint this node's peer port is bound to (the reply to
    PEER_START is :class:`ftmem.protocol.status.SyncReply`)."""

    endpoint: str


R = TypeVar("R")


class Request(Generic[R]):
    """A request whose answer is an ``R`` (None: the answer carries nothing):
    :meth:`~ftmem.protocol.smp_client.SmpClient.call` returns that type."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Ping(Request[PingReply]):
    """Liveness check; the reply carries the SMP's pid."""


@dataclass(frozen=True, slots=True)
class Hello(Request[HelloReply]):
    """A rank (re)started: forget any slot it was writing (a torn copy is never kept)."""

    rank: int
    pid: int
    local_rank: int = 0
    world_size: int = 0
    """The job's world size (0: unknown); the flush needs it to tell a node's part from the whole."""
    in_process: bool = False
    """The rank runs under :func:`ftmem.run`: at a restart it can rejoin in process."""
    rejoined: bool = False
    """The same process rejoined a new generation in process (its restart phases start now)."""


@dataclass(frozen=True, slots=True)
class Begin(Request[BeginReply]):
    """Ask for a slot to write ``step`` into; reply has ``slot`` or ``skip`` or ``resize``."""

    rank: int
    step: Step
    nbytes: SlotBytes
    final: bool = False
    """The rank's last save, polling until a slot is free: a refusal is not counted as a skip."""


@dataclass(frozen=True, slots=True)
class Prepare(Request[Prepared]):
    """(Re)create ``slot`` of ``rank`` with room for ``nbytes``; reply when done. ``slot`` -1:
    grow every slot that is free and smaller (ahead of the first save)."""

    rank: int
    slot: int
    nbytes: SlotBytes


@dataclass(frozen=True, slots=True)
class Commit(Request[BeginReply]):
    """The copy of ``step`` into ``slot`` is complete, its tensors placed as the rank's layout
    ``layout_id`` says and its encoded skeleton at ``objects_offset``. ``layout`` (the
    ``tensors`` array, JSON, without checksums) registers that id and comes only with its
    first commit (otherwise a refusal of kind UNKNOWN_LAYOUT). ``next_nbytes`` > 0: the reply
    grants a slot of that many bytes to the rank's next save, which then sends no BEGIN."""

    rank: int
    slot: int
    gen: int
    step: Step
    layout_id: int
    objects_offset: Size
    objects_nbytes: Size
    layout: str = ""
    unsharded_nbytes: Size = 0
    next_nbytes: Annotated[int, Range(-MAX_INT, MAX_SLOT_BYTES)] = 0
    stall_s: float = 0.0
    copy_s: float = 0.0
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class Skipped(Request[None]):
    """The rank skipped its snapshot of ``step`` on its own (e.g. its previous copy was still
    running); the SMP counts it per reason. Sent from the copy thread, never waited for."""

    rank: int
    step: Step
    reason: str


@dataclass(frozen=True, slots=True)
class Abort(Request[None]):
    """Give back a slot whose copy failed."""

    rank: int
    slot: int
    gen: int


@dataclass(frozen=True, slots=True)
class Query(Request[QueryReply]):
    """List the verified snapshots of ``rank``, newest first, with their layouts (the reply
    waits, bounded, for the SMP to finish hashing committed ones)."""

    rank: int


@dataclass(frozen=True, slots=True)
class DiscardNewer(Request[None]):
    """``rank`` restored ``step``: committed snapshots newer than it belong to an abandoned run."""

    rank: int
    step: Step


@dataclass(frozen=True, slots=True)
class Heartbeat(Request[None]):
    """Training made progress (used for hang detection)."""

    rank: int
    step: Step


@dataclass(frozen=True, slots=True)
class Status(Request[SmpStatus]):
    """Ask for the SMP's state (all ranks, all slots)."""


@dataclass(frozen=True, slots=True)
class PeerBind(Request[PeerBound]):
    """(Launcher) open the SMP's peer port on ``host`` with the job's CURVE key pair (JSON);
    ``encrypt``: every message over CURVE, no plain data channel (zmq_transport.py);
    ``encode_workers``: processes that encode the SMP's stripes (0: its protection thread)."""

    keys: str
    host: str
    me: int
    port: int = 0
    encrypt: bool = False
    encode_workers: int = 0


@dataclass(frozen=True, slots=True)
class PeerStart(Request[SyncReply]):
    """(Launcher) join generation ``epoch`` of a job of ``nodes`` nodes: the peer endpoints
    of (at least) this node's group, parity ``m``, the group-size cap and this node's global
    ranks; the reply comes after the group's sync (and this node's rebuild, if it needs one).
    ``nodes`` 0: ``endpoints`` names every node of the job."""

    epoch: int
    me: int
    endpoints: dict[str, str]
    m: int
    max_group: int
    ranks: list[int]
    protect_interval_s: float = 0.0
    nodes: int = 0


@dataclass(frozen=True, slots=True)
class Flush(Request[FlushReply]):
    """Flush ``step`` (-1: the newest complete or protected one) to the disk tiers now; ``tier``
    "local" writes only the first tier, "" or "persistent" all of them. Replied when durable."""

    step: int = -1
    tier: str = ""


@dataclass(frozen=True, slots=True)
class Peer:
    """An SMP-to-SMP message: a JSON header plus raw buffer frames of the given sizes/checksums."""

    header: dict[str, Any]
    sizes: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to every request: ``ok`` plus fields, or ``ok=False``, ``error`` (what a
    person reads) and ``kind`` (what a caller tests)."""

    ok: bool
    error: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    kind: ErrorKind | None = None
    """Set when ``ok`` is false (None there reads as :attr:`ErrorKind.REFUSED`)."""


def refusal(error: str, kind: ErrorKind = ErrorKind.REFUSED) -> Reply:
    """The reply that refuses a request: ``error`` says why, ``kind`` which refusal it is."""
    return Reply(ok=False, error=error, kind=kind)


PAYLOAD_TYPES: dict[Kind, type[Any]] = {
    Kind.REPLY: Reply,
    Kind.PING: Ping,
    Kind.HELLO: Hello,
    Kind.BEGIN: Begin,
    Kind.PREPARE: Prepare,
    Kind.COMMIT: Commit,
    Kind.ABORT: Abort,
    Kind.QUERY: Query,
    Kind.DISCARD_NEWER: DiscardNewer,
    Kind.HEARTBEAT: Heartbeat,
    Kind.STATUS: Status,
    Kind.PEER_BIND: PeerBind,
    Kind.PEER_START: PeerStart,
    Kind.FLUSH: Flush,
    Kind.SKIPPED: Skipped,
    Kind.PEER: Peer,
}
KIND_OF: dict[type[Any], Kind] = {v: k for k, v in PAYLOAD_TYPES.items()}


def from_fields(kind: Kind, fields: Any) -> Any:
    """Build the payload dataclass of ``kind`` from decoded JSON, checking every field.

    Raises:
        ProtocolError: unknown or missing fields, or a field of the wrong type.
    """
    return build(PAYLOAD_TYPES[kind], fields, what=kind.name)


def _reply_of(cls: type[Any]) -> type[Any] | None:
    (answer,) = typing.get_args(cls.__orig_bases__[0])  # Request[R]
    return None if answer is type(None) else answer


REPLY_OF: dict[type[Any], type[Any] | None] = {
    cls: _reply_of(cls) for cls in PAYLOAD_TYPES.values() if issubclass(cls, Request)
}
"""Each request's reply type (None: its reply carries nothing), from its ``Request[R]``."""


def parse_reply(cls: type[Any], data: dict[str, Any]) -> Any:
    """The typed reply ``cls`` from a Reply's ``data`` (a status report by its ``from_json``).

    Raises:
        ProtocolError: the data does not fit ``cls``.
    """
    if cls is SmpStatus or cls is SyncReply:
        return cls.from_json(data)
    return build(cls, data, what=f"reply {cls.__name__}")
