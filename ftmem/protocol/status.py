"""The SMP's STATUS, typed: its ranks' progress and slots, its protection service's state, its
flush, and the reply to PEER_START.

Each part's ``from_json`` reads it with :func:`ftmem.typed_json.build` (not strict: fields a
newer SMP reports are ignored) and refuses a malformed document with
:class:`~ftmem.errors.ProtocolError`; :meth:`SmpStatus.from_json` reads the whole STATUS.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from ftmem._logging import get_logger
from ftmem.errors import IllegalTransition, ProtocolError
from ftmem.typed_json import Digits, Most, build, read, to_fields

_log = get_logger(__name__)

T = TypeVar("T")
_MAX_LIST = 4096
Ints = Annotated[tuple[int, ...], Most(_MAX_LIST)]
Counts = Annotated[Mapping[str, int], Most(_MAX_LIST)]
Strs = Annotated[tuple[str, ...], Most(_MAX_LIST)]
Text = Annotated[str, Most(1 << 16)]
Endpoint = Annotated[str, Most(1024)]
Name = Annotated[str, Most(256)]
_Index = Annotated[int, Digits(18)]
"""A rank or node index as a JSON object's key."""


class ProtectionState(enum.Enum):
    """Where the SMP's protection service is in a generation's life (smp/protection.py).

    Transitions (any state but FAILED may also go to FAILED: the thread stopped on an
    unexpected error; FAILED is final)::

        UNBOUND ------------------------------> BOUND          bind: the peer port is open
        BOUND, SYNCING, READY, SYNC_FAILED,
          UNRECOVERABLE, REBUILD_FAILED ------> BOUND          bind again (a new key pair)
                                         \\---> SYNCING        start a generation, sync
        SYNCING ------------------------------> READY          every node answered; in sync
                                         \\---> REBUILDING     this node lost the kept step
                                         \\---> SYNC_FAILED    a node did not answer in time
                                         \\---> UNRECOVERABLE  more than m nodes lost it
        REBUILDING ---------------------------> READY          rebuilt from the group
                                         \\---> REBUILD_FAILED
        BOUND --------> READY, REBUILDING, SYNC_FAILED, UNRECOVERABLE
                        (a bind while a start was pending: that sync goes on and ends)

    Protection rounds run in READY; the step being protected is reported beside the state
    (``protecting``), not as a state of its own.
    """

    UNBOUND = "unbound"
    BOUND = "bound"
    SYNCING = "syncing"
    REBUILDING = "rebuilding"
    READY = "ready"
    SYNC_FAILED = "sync-failed"
    UNRECOVERABLE = "unrecoverable"
    REBUILD_FAILED = "rebuild-failed"
    FAILED = "failed"

    def can_become(self, new: ProtectionState) -> bool:
        """True if the state machine (see the class docstring) allows ``self -> new``."""
        if new is ProtectionState.FAILED:
            return self is not ProtectionState.FAILED
        return new in _NEXT[self]

    def to(self, new: ProtectionState) -> ProtectionState:
        """Return ``new`` if ``self -> new`` is allowed; raise IllegalTransition otherwise."""
        if not self.can_become(new):
            raise IllegalTransition(f"protection state {self.value} -> {new.value} is not allowed")
        return new


_S = ProtectionState
_RESTARTABLE = frozenset({_S.BOUND, _S.SYNCING})
_NEXT: dict[ProtectionState, frozenset[ProtectionState]] = {
    _S.UNBOUND: frozenset({_S.BOUND}),
    _S.BOUND: _RESTARTABLE | {_S.READY, _S.REBUILDING, _S.SYNC_FAILED, _S.UNRECOVERABLE},
    _S.SYNCING: _RESTARTABLE | {_S.READY, _S.REBUILDING, _S.SYNC_FAILED, _S.UNRECOVERABLE},
    _S.REBUILDING: frozenset({_S.READY, _S.REBUILD_FAILED}),
    _S.READY: _RESTARTABLE,
    _S.SYNC_FAILED: _RESTARTABLE,
    _S.UNRECOVERABLE: _RESTARTABLE,
    _S.REBUILD_FAILED: _RESTARTABLE,
    _S.FAILED: frozenset(),
}


# -- readers: one grammar (typed_json.build), not strict: a newer SMP may report more ----------


def _read(cls: type[T], doc: Any, what: str, **known: Any) -> T:
    """``cls`` from the status document ``doc`` (with the fields ``known`` set), read by the
    one JSON reader. Raises ProtocolError."""
    fields = {**doc, **known} if known and type(doc) is dict else doc
    got: T = build(cls, fields, what=what, strict=False)
    return got


def _keyed(cls: type[T], doc: Any, name: str, key: str) -> dict[int, T]:
    """Field ``name`` of a status document (None: empty): an object of at most ``_MAX_LIST``
    entries keyed by a rank or node index (a decimal string), each read as ``cls`` with that
    index as its field ``key``. Raises ProtocolError."""
    if doc is None:
        return {}
    if type(doc) is not dict or len(doc) > _MAX_LIST:
        raise ProtocolError(f"field {name!r} must be an object of at most {_MAX_LIST} entries")
    out = {}
    for k, entry in doc.items():
        index: int = read(_Index, k, f"a key of {name!r}")
        out[index] = _read(cls, entry, f"{key} {index}", **{key: index})
    return out


@dataclass(frozen=True, slots=True)
class RebuildProgress:
    """How far a rebuild of ``step`` is: ``fragments`` of ``of`` fetched."""

    step: int
    fragments: int
    of: int


@dataclass(frozen=True, slots=True)
class RoundCounters:
    """Protection rounds so far: ``protected``, ``aborted``, ``failed``; rebuilds done."""

    protected: int = 0
    aborted: int = 0
    failed: int = 0
    rebuilt: int = 0


@dataclass(frozen=True, slots=True)
class PeerHealth:
    """A peer of the group: its endpoint and how long ago it was last heard from."""

    node: int
    endpoint: Endpoint
    last_seen_s: float | None = None
    """None: never heard from."""


@dataclass(frozen=True, slots=True)
class ProtectionStatus:
    """The ``protection`` part of an SMP's STATUS, typed."""

    enabled: bool
    state: ProtectionState | None
    """None when erasure coding is off on this SMP."""
    epoch: int | None = None
    me: int | None = None
    group: Ints = ()
    m: int | None = None
    error: Text = ""
    protected_step: int | None = None
    protecting: int | None = None
    rebuilding: int | None = None
    rebuild_progress: RebuildProgress | None = None
    dropped_messages: int = 0
    forged_messages: int = 0
    """Data-channel messages refused for a wrong tag (also in ``dropped_messages``)."""
    last_protect_s: float = 0.0
    last_rebuild_s: float = 0.0
    endpoint: Endpoint = ""
    """This node's peer port (once bound)."""
    own_bytes: int = 0
    """This node's snapshot bytes of the protected step."""
    parity_bytes: int = 0
    """Parity bytes this node holds for the protected step."""
    sent_bytes: int = 0
    encode_workers: int = 0
    """Live encode worker processes (``--ftmem-tune ec-encode-workers``)."""
    worker_stripes: int = 0
    """Stripes the encode workers encoded (since this group's protector started)."""
    worker_fallbacks: int = 0
    """Stripes the protection thread encoded after their worker died or hung."""
    counters: RoundCounters = RoundCounters()
    peers: tuple[PeerHealth, ...] = ()

    @classmethod
    def from_json(cls, doc: Any) -> ProtectionStatus:
        """Parse the ``protection`` object (None or {}: off). Raises ProtocolError."""
        if doc is None or doc == {}:
            return cls(enabled=False, state=None)
        if type(doc) is not dict or type(doc.get("enabled", False)) is not bool:
            raise ProtocolError("the protection status must be an object with a boolean 'enabled'")
        if not doc.get("enabled"):
            return cls(enabled=False, state=None)
        peers = _keyed(PeerHealth, doc.get("peers"), "peers", "node")
        progress = doc.get("rebuild_progress") or None  # {}: none
        status = _read(cls, doc, "the protection status", peers=None, rebuild_progress=progress)
        if status.state is None:
            raise ProtocolError("field 'state' is not an protection state")
        return dataclasses.replace(status, peers=tuple(v for _, v in sorted(peers.items())))

    def to_json(self) -> dict[str, Any]:
        """The ``protection`` object as the SMP reports it (what :meth:`from_json` reads)."""
        doc = to_fields(self)
        doc["peers"] = {  # keyed by node, as from_json reads them
            str(h.node): {"endpoint": h.endpoint, "last_seen_s": h.last_seen_s} for h in self.peers
        }
        return doc


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The SMP's reply to PEER_START: the generation's protected step (None: none yet), the
    nodes that had lost it, and whether this node rebuilt it."""

    step: int | None
    lost: Ints = ()
    rebuilt: bool = False

    @classmethod
    def from_json(cls, doc: Any) -> SyncReply:
        """Parse the reply's fields. Raises ProtocolError."""
        return _read(cls, doc, "the sync reply")

    def to_json(self) -> dict[str, Any]:
        """The reply's fields as the SMP sent them (for the agent's event log)."""
        return to_fields(self)


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """One slot of a rank in the SMP's STATUS (see :mod:`ftmem.smp.store` for the states)."""

    slot: int
    state: Annotated[str, Most(32)]
    gen: int = 0
    capacity: int = 0
    step: int | None = None
    pinned: int = 0
    verified: bool = False


@dataclass(frozen=True, slots=True)
class RankProgress:
    """One rank's entry in the SMP's STATUS: its progress (what the launcher's hang detection
    and recovery timing read), its snapshots and its slots."""

    rank: int
    pid: int | None = None
    last_progress_time: float | None = None
    last_progress_step: int | None = None
    newest_committed: int | None = None
    hello_time: float | None = None
    """When this incarnation of the rank first spoke to the SMP (``ftmem.load``/``save``)."""
    restored_time: float | None = None
    """When its ``ftmem.load`` finished (None: it restored nothing yet)."""
    restored_step: int | None = None
    """The step its ``ftmem.load`` restored."""
    first_progress_time: float | None = None
    """Its first progress report (save or heartbeat) after its hello."""
    in_process: bool = False
    """It runs under ``ftmem.run``: at a restart it can rejoin in process."""
    committed_steps: Annotated[list[int], Most(_MAX_LIST)] = field(default_factory=list)
    """Committed steps, newest first."""
    newest_verified: int | None = None
    verified_steps: Annotated[list[int], Most(_MAX_LIST)] = field(default_factory=list)
    """Committed steps the SMP has checksummed, newest first."""
    commits: int = 0
    skipped: int = 0
    skips: Counts = field(default_factory=dict)
    """Skipped snapshots per reason."""
    last_stall_s: float = 0.0
    last_copy_s: float = 0.0
    last_hash_s: float = 0.0
    bytes_held: int = 0
    """Bytes of the rank's slot files."""
    snapshot_bytes: int = 0
    """Bytes of its newest committed snapshot."""
    unsharded_bytes: int = 0
    """What that snapshot would hold unsharded (equal when not sharded)."""
    slots: Annotated[list[SlotStatus], Most(_MAX_LIST)] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FlushRunning:
    """The flush in progress: its step, stage, the tier being written (an index into the
    tiers), and how far (``done`` of ``total`` ``unit``)."""

    step: int
    stage: Annotated[str, Most(64)] = ""
    tier: int = 0
    done: int | None = None
    total: int | None = None
    unit: Annotated[str, Most(32)] = ""


@dataclass(frozen=True, slots=True)
class FlushStatus:
    """The ``flush`` part of an SMP's STATUS: the disk tiers' schedule and the last flush."""

    enabled: bool = False
    tiers: Strs = ()
    every: int = 0
    keep: int = 0
    last_step: int | None = None
    last_paths: Strs = ()
    last_seconds: float | None = None
    last_bytes: int = 0
    last_error: Text = ""
    flushes: int = 0
    failures: int = 0
    running: FlushRunning | None = None
    assembled_step: int | None = None

    @classmethod
    def from_json(cls, doc: Any) -> FlushStatus:
        """Parse the ``flush`` object (None or not enabled: off). Raises ProtocolError."""
        status: FlushStatus = _read(cls, doc or {}, "the flush status")
        return status if status.enabled else cls()


@dataclass(frozen=True, slots=True)
class SmpStatus:
    """The SMP's answer to STATUS, typed: its identity, request counts, every rank's entry
    (by rank), its exchange, and its flush scheduler's progress document."""

    pid: int
    run_id: Name = ""
    node: Name = ""
    endpoint: Endpoint = ""
    uptime_s: float = 0.0
    bad_messages: int = 0
    """Malformed or unauthenticated requests refused."""
    requests: Counts = field(default_factory=dict)
    """Requests served per kind (``BEGIN``, ``COMMIT``, ...)."""
    ranks: Mapping[int, RankProgress] = field(default_factory=dict)
    protection: ProtectionStatus | None = None
    """None if the SMP's protection part did not parse (logged; the rest still serves)."""
    flush: FlushStatus = FlushStatus()

    @classmethod
    def from_json(cls, doc: Any) -> SmpStatus:
        """Parse a STATUS reply's data. Raises ProtocolError (a malformed protection part only
        makes ``protection`` None)."""
        if type(doc) is not dict:
            raise ProtocolError("the SMP status must be a JSON object")
        ranks = _keyed(RankProgress, doc.get("ranks") or {}, "ranks", "rank")
        try:
            protection: ProtectionStatus | None = ProtectionStatus.from_json(doc.get("protection"))
        except ProtocolError as exc:
            _log.warning("the SMP's protection status does not parse: %s", exc)
            protection = None
        flush = FlushStatus.from_json(doc.get("flush"))
        status = _read(cls, doc, "the SMP status", ranks=None, protection=None, flush=None)
        return dataclasses.replace(status, ranks=ranks, protection=protection, flush=flush)

    def to_json(self) -> dict[str, Any]:
        """The STATUS document as the SMP sends it (what :meth:`from_json` reads)."""
        doc = to_fields(self)
        doc["ranks"] = {str(r): to_fields(p) for r, p in self.ranks.items()}
        p, off = self.protection, {"enabled": False}
        doc["protection"] = p.to_json() if p is not None and p.enabled else off
        if not self.flush.enabled:
            doc["flush"] = off
        return doc
