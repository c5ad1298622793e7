"""The SMP's STATUS, typed: its ranks' progress and slots, its protection service's state, and
the reply to PEER_START.

The SMP reports its exchange as a JSON object (``exchange`` in the STATUS document) whose
``state`` is an :class:`ExchangeState` value; :meth:`ExchangeStatus.from_json` turns it into a
frozen dataclass (what the launcher, the SMP's flush scheduler and ``ftmem status`` read), and
:meth:`SyncReply.from_json` does the same for the reply to PEER_START; :meth:`SmpStatus.from_json`
parses the whole STATUS (each rank's entry a :class:`RankProgress`). All refuse a malformed
document with :class:`~ftmem.errors.ProtocolError`; fields they do not know are ignored (an SMP
of a newer version may report more).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftmem._logging import get_logger
from ftmem.errors import IllegalTransition as IllegalTransition  # re-exported
from ftmem.errors import ProtocolError

_log = get_logger(__name__)

_MAX_INT = (1 << 63) - 1
_MAX_LIST = 4096


class ExchangeState(enum.Enum):
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

    def can_become(self, new: ExchangeState) -> bool:
        """True if the state machine (see the class docstring) allows ``self -> new``."""
        if new is ExchangeState.FAILED:
            return self is not ExchangeState.FAILED
        return new in _NEXT[self]

    def to(self, new: ExchangeState) -> ExchangeState:
        """Return ``new`` if ``self -> new`` is allowed; raise IllegalTransition otherwise."""
        if not self.can_become(new):
            raise IllegalTransition(f"exchange state {self.value} -> {new.value} is not allowed")
        return new


_S = ExchangeState
_RESTARTABLE = frozenset({_S.BOUND, _S.SYNCING})
_NEXT: dict[ExchangeState, frozenset[ExchangeState]] = {
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


# -- readers: each raises ProtocolError, and only that ---------------------------------------------


def _opt_int(doc: Mapping[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if type(value) is not int or not -_MAX_INT <= value <= _MAX_INT:
        raise ProtocolError(f"field {name!r} must be an integer or null")
    return value


def _int(doc: Mapping[str, Any], name: str, default: int = 0) -> int:
    value = _opt_int(doc, name)
    return default if value is None else value


def _seconds(doc: Mapping[str, Any], name: str) -> float:
    value = doc.get(name, 0.0)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"field {name!r} must be a finite number")
    return float(value)


def _str(doc: Mapping[str, Any], name: str, most: int = 1 << 16) -> str:
    value = doc.get(name) or ""
    if type(value) is not str or len(value) > most:
        raise ProtocolError(f"field {name!r} must be a string of at most {most} characters")
    return value


def _ints(doc: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = doc.get(name) or []
    if type(value) is not list or len(value) > _MAX_LIST:
        raise ProtocolError(f"field {name!r} must be a list of at most {_MAX_LIST} integers")
    out = []
    for v in value:
        if type(v) is not int or not 0 <= v <= _MAX_INT:
            raise ProtocolError(f"field {name!r} must hold integers")
        out.append(v)
    return tuple(out)


def _object(doc: Any, what: str) -> Mapping[str, Any]:
    if type(doc) is not dict:
        raise ProtocolError(f"{what} must be a JSON object, not {type(doc).__name__}")
    return doc


@dataclass(frozen=True, slots=True)
class RebuildProgress:
    """How far a rebuild of ``step`` is: ``fragments`` of ``of`` fetched."""

    step: int
    fragments: int
    of: int

    @classmethod
    def from_json(cls, doc: Any) -> RebuildProgress | None:
        """Parse ``rebuild_progress`` (None or {} when there is none). Raises ProtocolError."""
        if doc is None or doc == {}:
            return None
        d = _object(doc, "rebuild_progress")
        return cls(_int(d, "step"), _int(d, "fragments"), _int(d, "of"))


@dataclass(frozen=True, slots=True)
class RoundCounters:
    """Protection rounds so far: ``protected``, ``aborted``, ``failed``; rebuilds done."""

    protected: int = 0
    aborted: int = 0
    failed: int = 0
    rebuilt: int = 0

    @classmethod
    def from_json(cls, doc: Any) -> RoundCounters:
        """Parse ``counters`` (None or {}: all zero). Raises ProtocolError."""
        if doc is None:
            return cls()
        d = _object(doc, "counters")
        return cls(_int(d, "protected"), _int(d, "aborted"), _int(d, "failed"), _int(d, "rebuilt"))


@dataclass(frozen=True, slots=True)
class PeerHealth:
    """A peer of the group: its endpoint and how long ago it was last heard from."""

    node: int
    endpoint: str
    last_seen_s: float | None
    """None: never heard from."""

    @classmethod
    def parse_all(cls, doc: Any) -> tuple[PeerHealth, ...]:
        """Parse ``peers`` ({node: {endpoint, last_seen_s}}), by node. Raises ProtocolError."""
        if doc is None:
            return ()
        d = _object(doc, "peers")
        if len(d) > _MAX_LIST:
            raise ProtocolError(f"field 'peers' has more than {_MAX_LIST} nodes")
        out = []
        for node, p in d.items():
            if type(node) is not str or not node.isdigit() or len(node) > 18:
                raise ProtocolError(f"peer {node!r} is not a node index")
            p = _object(p, f"peer {node}")
            seen = None if p.get("last_seen_s") is None else _seconds(p, "last_seen_s")
            out.append(cls(int(node), _str(p, "endpoint", 1024), seen))
        return tuple(sorted(out, key=lambda h: h.node))


@dataclass(frozen=True, slots=True)
class ExchangeStatus:
    """The ``exchange`` part of an SMP's STATUS, typed."""

    enabled: bool
    state: ExchangeState | None
    """None when erasure coding is off on this SMP."""
    epoch: int | None = None
    me: int | None = None
    group: tuple[int, ...] = ()
    m: int | None = None
    error: str = ""
    protected_step: int | None = None
    protecting: int | None = None
    rebuilding: int | None = None
    rebuild_progress: RebuildProgress | None = None
    dropped_messages: int = 0
    forged_messages: int = 0
    """Data-channel messages refused for a wrong tag (also in ``dropped_messages``)."""
    last_protect_s: float = 0.0
    last_rebuild_s: float = 0.0
    endpoint: str = ""
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
    """Stripes the exchange thread encoded after their worker died or hung."""
    counters: RoundCounters = RoundCounters()
    peers: tuple[PeerHealth, ...] = ()

    @classmethod
    def from_json(cls, doc: Any) -> ExchangeStatus:
        """Parse the ``exchange`` object (None or {}: off). Raises ProtocolError."""
        if doc is None or doc == {}:
            return cls(enabled=False, state=None)
        d = _object(doc, "the exchange status")
        enabled = d.get("enabled", False)
        if type(enabled) is not bool:
            raise ProtocolError("field 'enabled' must be true or false")
        if not enabled:
            return cls(enabled=False, state=None)
        raw = d.get("state")
        try:
            state = ExchangeState(raw) if type(raw) is str else None
        except ValueError:
            state = None
        if state is None:
            raise ProtocolError("field 'state' is not an exchange state")
        return cls(
            enabled=True,
            state=state,
            epoch=_opt_int(d, "epoch"),
            me=_opt_int(d, "me"),
            group=_ints(d, "group"),
            m=_opt_int(d, "m"),
            error=_str(d, "error"),
            protected_step=_opt_int(d, "protected_step"),
            protecting=_opt_int(d, "protecting"),
            rebuilding=_opt_int(d, "rebuilding"),
            rebuild_progress=RebuildProgress.from_json(d.get("rebuild_progress")),
            dropped_messages=_int(d, "dropped_messages"),
            forged_messages=_int(d, "forged_messages"),
            last_protect_s=_seconds(d, "last_protect_s"),
            last_rebuild_s=_seconds(d, "last_rebuild_s"),
            endpoint=_str(d, "endpoint", 1024),
            own_bytes=_int(d, "own_bytes"),
            parity_bytes=_int(d, "parity_bytes"),
            sent_bytes=_int(d, "sent_bytes"),
            encode_workers=_int(d, "encode_workers"),
            worker_stripes=_int(d, "worker_stripes"),
            worker_fallbacks=_int(d, "worker_fallbacks"),
            counters=RoundCounters.from_json(d.get("counters")),
            peers=PeerHealth.parse_all(d.get("peers")),
        )


@dataclass(frozen=True, slots=True)
class SyncReply:
    """The SMP's reply to PEER_START: the generation's protected step (None: none yet), the
    nodes that had lost it, and whether this node rebuilt it."""

    step: int | None
    lost: tuple[int, ...]
    rebuilt: bool

    @classmethod
    def from_json(cls, doc: Any) -> SyncReply:
        """Parse the reply's fields. Raises ProtocolError."""
        d = _object(doc, "the sync reply")
        rebuilt = d.get("rebuilt", False)
        if type(rebuilt) is not bool:
            raise ProtocolError("field 'rebuilt' must be true or false")
        return cls(step=_opt_int(d, "step"), lost=_ints(d, "lost"), rebuilt=rebuilt)

    def to_json(self) -> dict[str, Any]:
        """The reply's fields as the SMP sent them (for the agent's event log)."""
        return {"step": self.step, "lost": list(self.lost), "rebuilt": self.rebuilt}


def _opt_seconds(doc: Mapping[str, Any], name: str) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(f"field {name!r} must be a finite number or null")
    return float(value)


def _counts(doc: Mapping[str, Any], name: str) -> dict[str, int]:
    d = _object(doc.get(name) or {}, f"field {name!r}")
    if len(d) > _MAX_LIST:
        raise ProtocolError(f"field {name!r} has more than {_MAX_LIST} entries")
    out = {}
    for k, v in d.items():
        if type(v) is not int or not 0 <= v <= _MAX_INT:
            raise ProtocolError(f"field {name!r} must map names to counts")
        out[str(k)[:200]] = v
    return out


@dataclass(frozen=True, slots=True)
class SlotStatus:
    """One slot of a rank in the SMP's STATUS (see :mod:`ftmem.smp.store` for the states)."""

    slot: int
    state: str
    gen: int = 0
    capacity: int = 0
    step: int | None = None
    pinned: int = 0
    verified: bool = False

    @classmethod
    def from_json(cls, doc: Any) -> SlotStatus:
        """Parse one entry of a rank's ``slots``. Raises ProtocolError."""
        d = _object(doc, "a slot's status")
        return cls(
            slot=_int(d, "slot"),
            state=_str(d, "state", 32),
            gen=_int(d, "gen"),
            capacity=_int(d, "capacity"),
            step=_opt_int(d, "step"),
            pinned=_int(d, "pinned"),
            verified=d.get("verified") is True,
        )


@dataclass(frozen=True, slots=True)
class RankProgress:
    """One rank's entry in the SMP's STATUS: its progress (what the launcher's hang detection
    and recovery timing read), its snapshots and its slots."""

    rank: int
    pid: int | None
    last_progress_time: float | None
    last_progress_step: int | None
    newest_committed: int | None
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
    committed_steps: list[int] = field(default_factory=list)
    """Committed steps, newest first."""
    newest_verified: int | None = None
    verified_steps: list[int] = field(default_factory=list)
    """Committed steps the SMP has checksummed, newest first."""
    commits: int = 0
    skipped: int = 0
    skips: Mapping[str, int] = field(default_factory=dict)
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
    slots: list[SlotStatus] = field(default_factory=list)

    @classmethod
    def from_json(cls, rank: int, doc: Any) -> RankProgress:
        """Parse one entry of the STATUS's ``ranks``. Raises ProtocolError."""
        d = _object(doc, f"rank {rank}'s status")
        slots = d.get("slots") or []
        if type(slots) is not list or len(slots) > _MAX_LIST:
            raise ProtocolError("field 'slots' must be a list")
        return cls(
            rank=rank,
            pid=_opt_int(d, "pid"),
            last_progress_time=_opt_seconds(d, "last_progress_time"),
            last_progress_step=_opt_int(d, "last_progress_step"),
            newest_committed=_opt_int(d, "newest_committed"),
            hello_time=_opt_seconds(d, "hello_time"),
            restored_time=_opt_seconds(d, "restored_time"),
            restored_step=_opt_int(d, "restored_step"),
            first_progress_time=_opt_seconds(d, "first_progress_time"),
            in_process=d.get("in_process") is True,
            committed_steps=list(_ints(d, "committed_steps")),
            newest_verified=_opt_int(d, "newest_verified"),
            verified_steps=list(_ints(d, "verified_steps")),
            commits=_int(d, "commits"),
            skipped=_int(d, "skipped"),
            skips=_counts(d, "skips"),
            last_stall_s=_seconds(d, "last_stall_s"),
            last_copy_s=_seconds(d, "last_copy_s"),
            last_hash_s=_seconds(d, "last_hash_s"),
            bytes_held=_int(d, "bytes_held"),
            snapshot_bytes=_int(d, "snapshot_bytes"),
            unsharded_bytes=_int(d, "unsharded_bytes"),
            slots=[SlotStatus.from_json(s) for s in slots],
        )


def _strs(doc: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = doc.get(name) or []
    if type(value) is not list or len(value) > _MAX_LIST or any(type(v) is not str for v in value):
        raise ProtocolError(f"field {name!r} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class FlushRunning:
    """The flush in progress: its step, stage, the tier being written (an index into the
    tiers), and how far (``done`` of ``total`` ``unit``)."""

    step: int
    stage: str = ""
    tier: int = 0
    done: int | None = None
    total: int | None = None
    unit: str = ""

    @classmethod
    def from_json(cls, doc: Any) -> FlushRunning | None:
        """Parse ``running`` (None: no flush runs). Raises ProtocolError."""
        if doc is None:
            return None
        d = _object(doc, "the running flush")
        return cls(
            step=_int(d, "step"),
            stage=_str(d, "stage", 64),
            tier=_int(d, "tier"),
            done=_opt_int(d, "done"),
            total=_opt_int(d, "total"),
            unit=_str(d, "unit", 32),
        )


@dataclass(frozen=True, slots=True)
class FlushStatus:
    """The ``flush`` part of an SMP's STATUS: the disk tiers' schedule and the last flush."""

    enabled: bool = False
    tiers: tuple[str, ...] = ()
    every: int = 0
    keep: int = 0
    last_step: int | None = None
    last_paths: tuple[str, ...] = ()
    last_seconds: float | None = None
    last_bytes: int = 0
    last_error: str = ""
    flushes: int = 0
    failures: int = 0
    running: FlushRunning | None = None
    assembled_step: int | None = None

    @classmethod
    def from_json(cls, doc: Any) -> FlushStatus:
        """Parse the ``flush`` object (None or not enabled: off). Raises ProtocolError."""
        d = _object(doc or {}, "the flush status")
        if d.get("enabled") is not True:
            return cls()
        return cls(
            enabled=True,
            tiers=_strs(d, "tiers"),
            every=_int(d, "every"),
            keep=_int(d, "keep"),
            last_step=_opt_int(d, "last_step"),
            last_paths=_strs(d, "last_paths"),
            last_seconds=_opt_seconds(d, "last_seconds"),
            last_bytes=_int(d, "last_bytes"),
            last_error=_str(d, "last_error"),
            flushes=_int(d, "flushes"),
            failures=_int(d, "failures"),
            running=FlushRunning.from_json(d.get("running")),
            assembled_step=_opt_int(d, "assembled_step"),
        )


@dataclass(frozen=True, slots=True)
class SmpStatus:
    """The SMP's answer to STATUS, typed: its identity, request counts, every rank's entry
    (by rank), its exchange, and its flush scheduler's progress document."""

    pid: int
    run_id: str = ""
    node: str = ""
    endpoint: str = ""
    uptime_s: float = 0.0
    bad_messages: int = 0
    """Malformed or unauthenticated requests refused."""
    requests: Mapping[str, int] = field(default_factory=dict)
    """Requests served per kind (``BEGIN``, ``COMMIT``, ...)."""
    ranks: Mapping[int, RankProgress] = field(default_factory=dict)
    exchange: ExchangeStatus | None = None
    """None if the SMP's exchange part did not parse (logged; the rest still serves)."""
    flush: FlushStatus = FlushStatus()

    @classmethod
    def from_json(cls, doc: Any) -> SmpStatus:
        """Parse a STATUS reply's data. Raises ProtocolError (a malformed exchange part only
        makes ``exchange`` None)."""
        d = _object(doc, "the SMP status")
        ranks_doc = _object(d.get("ranks") or {}, "field 'ranks'")
        ranks = {}
        for key, entry in ranks_doc.items():
            try:
                rank = int(key)
            except ValueError:
                raise ProtocolError("field 'ranks' must be keyed by rank") from None
            ranks[rank] = RankProgress.from_json(rank, entry)
        try:
            exchange: ExchangeStatus | None = ExchangeStatus.from_json(d.get("exchange"))
        except ProtocolError as exc:
            _log.warning("the SMP's exchange status does not parse: %s", exc)
            exchange = None
        pid = _opt_int(d, "pid")
        if pid is None:
            raise ProtocolError("missing field 'pid' for the SMP status")
        return cls(
            pid=pid,
            run_id=_str(d, "run_id", 256),
            node=_str(d, "node", 256),
            endpoint=_str(d, "endpoint", 1024),
            uptime_s=_seconds(d, "uptime_s"),
            bad_messages=_int(d, "bad_messages"),
            requests=_counts(d, "requests"),
            ranks=ranks,
            exchange=exchange,
            flush=FlushStatus.from_json(d.get("flush")),
        )
