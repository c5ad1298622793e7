"""Typed messages between a rank (or a tool) and its node's SMP.

Every request is one :class:`Kind` plus a frozen dataclass payload; every reply is a
:class:`Reply` that says ok or carries an error. Payloads travel as JSON (see wire.py);
``from_fields`` checks each field's type so nothing unexpected reaches the SMP's logic.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftmem.errors import ErrorKind, ProtocolError

PROTOCOL_VERSION = 1


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
class Ping:
    """Liveness check; the reply carries the SMP's pid."""


@dataclass(frozen=True, slots=True)
class Hello:
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
class Begin:
    """Ask for a slot to write ``step`` into; reply has ``slot`` or ``skip`` or ``resize``."""

    rank: int
    step: int
    nbytes: int
    final: bool = False
    """The rank's last save, polling until a slot is free: a refusal is not counted as a skip."""


@dataclass(frozen=True, slots=True)
class Prepare:
    """(Re)create ``slot`` of ``rank`` with room for ``nbytes`` (pre-faulted); reply when done.

    ``slot`` -1: grow every slot that is free and smaller (ahead of the first save)."""

    rank: int
    slot: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Commit:
    """The copy of ``step`` into ``slot`` is complete. Its tensors are placed as the rank's
    layout ``layout_id`` says; ``layout`` (the layout's ``tensors`` array, JSON, without
    checksums) registers that id with the SMP and is sent only with the first commit that
    uses it (the SMP keeps a few per rank and refuses with kind UNKNOWN_LAYOUT otherwise). The encoded
    skeleton sits at ``objects_offset`` (``objects_nbytes`` bytes). The SMP hashes the slot
    and the snapshot becomes *verified*.

    ``next_nbytes`` > 0: grant a slot of that many bytes to the rank's next save in the
    reply (a :class:`BeginReply`), so that the save sends no BEGIN of its own."""

    rank: int
    slot: int
    gen: int
    step: int
    layout_id: int
    objects_offset: int
    objects_nbytes: int
    layout: str = ""
    unsharded_nbytes: int = 0
    next_nbytes: int = 0
    stall_s: float = 0.0
    copy_s: float = 0.0
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class Skipped:
    """The rank skipped its snapshot of ``step`` on its own (e.g. its previous copy was still
    running); the SMP counts it per reason. Sent from the copy thread, never waited for."""

    rank: int
    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Give back a slot whose copy failed."""

    rank: int
    slot: int
    gen: int


@dataclass(frozen=True, slots=True)
class Query:
    """List the verified snapshots of ``rank``, newest first, with their layouts (the reply
    waits, bounded, for the SMP to finish hashing committed ones)."""

    rank: int


@dataclass(frozen=True, slots=True)
class DiscardNewer:
    """``rank`` restored ``step``: committed snapshots newer than it belong to an abandoned run."""

    rank: int
    step: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Training made progress (used for hang detection)."""

    rank: int
    step: int


@dataclass(frozen=True, slots=True)
class Status:
    """Ask for the SMP's state (all ranks, all slots)."""


@dataclass(frozen=True, slots=True)
class PeerBind:
    """(Launcher) open the SMP's peer port on ``host`` with the job's CURVE key pair (JSON);
    ``encrypt``: every message over CURVE, no plain data channel (zmq_transport.py);
    ``encode_workers``: processes that encode the SMP's stripes (0: its exchange thread)."""

    keys: str
    host: str
    me: int
    port: int = 0
    encrypt: bool = False
    encode_workers: int = 0


@dataclass(frozen=True, slots=True)
class PeerStart:
    """(Launcher) join generation ``epoch``: every node's peer endpoint, parity ``m``, the
    group-size cap and this node's global ranks; the reply comes after the group's sync (and
    this node's rebuild, if it needs one)."""

    epoch: int
    me: int
    endpoints: dict[str, str]
    m: int
    max_group: int
    ranks: list[int]
    protect_interval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Flush:
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
    says when the slot may be written (:class:`ftmem.shm.GrantBoard`); until then the save
    asks with a BEGIN."""
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

MAX_INT = (1 << 63) - 1
"""Largest magnitude of an integer field (what an int64 holds), in every JSON message."""


@dataclass(frozen=True, slots=True)
class Most:
    """A field's bound, in its annotation (``Annotated[str, Most(64)]``): at most ``n``
    characters of a string, items of a list or entries of an object."""

    n: int


@dataclass(frozen=True, slots=True)
class Range:
    """An integer field's bounds, in its annotation: ``lo <= value <= hi``."""

    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Digits:
    """An integer that travels as a decimal string of at most ``n`` digits (an object's key;
    a 64-bit checksum, which JSON readers that hold numbers as doubles would round)."""

    n: int


@dataclass(frozen=True, slots=True)
class Pattern:
    """A string field matches ``regex`` in full."""

    regex: str


Reader = Callable[[str, Any, bool], Any]
"""Reads one field: (its name, its decoded JSON value, strict) -> its value; ProtocolError."""


def _reader(tp: Any) -> Reader:
    """The reader of annotation ``tp``, made once per annotation (a status document of many
    ranks is read field by field without looking at an annotation again)."""
    read = _READERS.get(tp)
    if read is None:
        read = _READERS[tp] = _make_reader(tp)
    return read


_READERS: dict[Any, Reader] = {}


def _make_reader(tp: Any) -> Reader:
    extras: list[Any] = []
    if typing.get_origin(tp) is typing.Annotated:
        tp, *extras = typing.get_args(tp)
    most = next((e.n for e in extras if isinstance(e, Most)), None)
    lo, hi = next(((e.lo, e.hi) for e in extras if isinstance(e, Range)), (-MAX_INT, MAX_INT))
    digits = next((e.n for e in extras if isinstance(e, Digits)), None)
    pattern = next((re.compile(e.regex) for e in extras if isinstance(e, Pattern)), None)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        nullable = type(None) in args
        alts = [_reader(a) for a in args if a is not type(None)]

        def read_union(name: str, value: Any, strict: bool) -> Any:
            if value is None and nullable:
                return None
            for alt in alts:
                try:
                    return alt(name, value, strict)
                except ProtocolError:
                    continue
            raise ProtocolError(f"field {name!r} has the wrong type")

        return read_union
    if tp is Any:
        return lambda name, value, strict: value
    if tp is type(None):

        def read_null(name: str, value: Any, strict: bool) -> None:
            if value is not None:
                raise ProtocolError(f"field {name!r} must be null")

        return read_null
    if tp is int and digits is not None:

        def read_digits(name: str, value: Any, strict: bool) -> int:
            if type(value) is not str or not 0 < len(value) <= digits or not value.isdigit():
                raise ProtocolError(f"field {name!r} must be a decimal string of {digits} digits")
            if not value.isascii() or not lo <= int(value) <= hi:
                raise ProtocolError(f"field {name!r} is out of range ({lo}..{hi})")
            return int(value)

        return read_digits
    if tp is int:

        def read_int(name: str, value: Any, strict: bool) -> int:
            if type(value) is not int:
                raise ProtocolError(f"field {name!r} must be an integer")
            if not lo <= value <= hi:
                raise ProtocolError(f"field {name!r} is out of range ({lo}..{hi})")
            return value

        return read_int
    if tp is float:

        def read_float(name: str, value: Any, strict: bool) -> float:
            if type(value) not in (int, float) or not math.isfinite(value):
                raise ProtocolError(f"field {name!r} must be a finite number")
            return float(value)

        return read_float
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {e.value: e for e in tp}

        def read_enum(name: str, value: Any, strict: bool) -> Any:
            if type(value) not in (str, int) or value not in members:
                raise ProtocolError(f"field {name!r} must be one of {list(members)}")
            return members[value]

        return read_enum
    if tp in (str, bool):
        bound = f" of at most {most} characters" if most is not None else ""

        def read_plain(name: str, value: Any, strict: bool) -> Any:
            if type(value) is not tp or (most is not None and len(value) > most):
                raise ProtocolError(f"field {name!r} must be {tp.__name__}{bound}")
            if pattern is not None and pattern.fullmatch(value) is None:
                raise ProtocolError(f"field {name!r} must match {pattern.pattern}")
            return value

        return read_plain
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        nested: type[Any] = tp
        return lambda name, value, strict: build(
            nested, value, what=f"field {name!r}", strict=strict
        )
    if origin in (list, tuple, dict, Mapping) or tp in (list, tuple, dict):
        mapping = origin in (dict, Mapping) or tp is dict
        kind = "an object" if mapping else "a list"
        want: type[Any] = dict if mapping else list
        item = (args[1] if mapping else args[0]) if args else Any
        each = None if item is Any else _reader(item)
        key = args[0] if mapping and args and args[0] not in (str, Any) else None
        read_key = None if key is None else _reader(key)  # e.g. Annotated[int, Digits(7)]
        as_tuple = origin is tuple or tp is tuple
        bound = f" of at most {most}" if most is not None else ""

        def read_many(name: str, value: Any, strict: bool) -> Any:
            if type(value) is not want or (most is not None and len(value) > most):
                raise ProtocolError(f"field {name!r} must be {kind}{bound}")
            if read_key is not None:
                return {
                    read_key(name, k, strict): v if each is None else each(name, v, strict)
                    for k, v in value.items()
                }
            if each is None:
                return value
            if mapping:
                return {k: each(name, v, strict) for k, v in value.items()}
            items = [each(name, v, strict) for v in value]
            return tuple(items) if as_tuple else items

        return read_many
    raise TypeError(f"no JSON reader for the annotation {tp!r}")


_FIELDS: dict[type[Any], tuple[frozenset[str], list[tuple[str, bool, Reader]]]] = {}


def _fields(cls: type[Any]) -> tuple[frozenset[str], list[tuple[str, bool, Reader]]]:
    """The field names of dataclass ``cls`` and, per field, (name, has a default, reader):
    made once per class."""
    out = _FIELDS.get(cls)
    if out is None:
        hints = typing.get_type_hints(cls, include_extras=True)
        known = [
            (
                f.name,
                f.default is not dataclasses.MISSING
                or f.default_factory is not dataclasses.MISSING,
                _reader(hints[f.name]),
            )
            for f in dataclasses.fields(cls)
        ]
        out = _FIELDS[cls] = (frozenset(name for name, _, _ in known), known)
    return out


def from_fields(kind: Kind, fields: Any) -> Any:
    """Build the payload dataclass of ``kind`` from decoded JSON, checking every field.

    Raises:
        ProtocolError: unknown or missing fields, or a field of the wrong type.
    """
    return build(PAYLOAD_TYPES[kind], fields, what=kind.name)


def build(cls: type[Any], fields: Any, *, what: str = "", strict: bool = True) -> Any:
    """Build the dataclass ``cls`` from decoded JSON, reading every field as its annotation
    says (bounds: :class:`Most`); nested dataclasses, lists and tuples of them are built item
    by item. This is the one reader of every JSON document ftmem receives.

    ``strict=False`` reads a status report: fields ``cls`` does not know are ignored (a newer
    sender may report more), and a null field that has a default takes the default.

    Raises:
        ProtocolError: not an object, unknown (when strict) or missing fields, or a field of
            the wrong type.
    """
    what = what or cls.__name__
    if type(fields) is not dict:
        raise ProtocolError(f"{what} must be a JSON object")
    names, known = _fields(cls)
    if strict and not names.issuperset(fields):
        unknown = sorted(str(k)[:32] for k in set(fields).difference(names))
        raise ProtocolError(f"unknown fields {unknown[:4]} for {what}")
    out = {}
    for name, has_default, read in known:
        value = fields.get(name, _ABSENT)
        if value is _ABSENT or (value is None and not strict):
            if has_default:
                continue
            if value is _ABSENT:
                raise ProtocolError(f"missing field {name!r} for {what}")
        out[name] = read(name, value, strict)
    return cls(**out)


_ABSENT = object()


def parse_reply(cls: type[Any], data: dict[str, Any]) -> Any:
    """The typed reply ``cls`` (e.g. :class:`BeginReply`) from a Reply's ``data``.

    Raises:
        ProtocolError: the data does not fit ``cls``.
    """
    return build(cls, data, what=f"reply {cls.__name__}")


def to_fields(payload: Any) -> dict[str, Any]:
    """Return the JSON-ready fields of a payload or reply dataclass (nested dataclasses and
    enums as JSON values)."""
    return {f.name: _json_value(getattr(payload, f.name)) for f in dataclasses.fields(payload)}


def _json_value(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if dataclasses.is_dataclass(v):
        return to_fields(v)
    if isinstance(v, list | tuple) and v and dataclasses.is_dataclass(v[0]):
        return [to_fields(x) for x in v]
    return v
