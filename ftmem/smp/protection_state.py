"""What the SMP's protection thread holds and what it reports.

The service (protection.py) owns one of each and hands them to its parts (its rounds, and the
sync and rebuild in protection_sync.py), which change nothing else; only the protection thread
changes them:

- :class:`Generation`: the generation this node is in (its index, epoch, ranks, group and the
  group's protector), fixed from one start to the next;
- :class:`PinnedSteps`: the steps whose slots this node keeps pinned and mapped read-only (the
  protected step, and steps kept for the next sync);
- :class:`StatusBoard`: what the service reports: its state and :class:`ProtectionStatus`
  (read by any thread, behind a lock), its event log, and the node name its log lines carry.

It also holds the commands the main loop gives the thread (:class:`BindCommand` for PEER_BIND,
:class:`StartCommand` for PEER_START) and the :class:`Result` each gets back, carrying the
command's ``token`` (the main loop sends the deferred reply).
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.errors import ErrorKind
from ftmem.events import EventLog
from ftmem.exchange.keys import CurveKeyPair
from ftmem.exchange.placement import GroupPlan
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.segments import SegmentedBytes
from ftmem.format.record import ManifestEntry, NodeManifest, encode_manifest
from ftmem.protocol.messages import PeerBind, PeerStart
from ftmem.protocol.status import ProtectionState, ProtectionStatus
from ftmem.smp.slot_store import SlotStore
from ftmem.smp.store import RankPiece

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class BindCommand:
    """Start a new transport as ``request`` says (replacing the previous one), with the job's
    key pair ``keys`` read from it."""

    token: Any
    request: PeerBind
    keys: CurveKeyPair


@dataclass(frozen=True, slots=True)
class StartCommand:
    """Join the mesh of ``request.epoch`` (two per generation: ftmem.launch.peers.mesh_epoch)
    with its peer ``endpoints`` checked and keyed by node index; then sync."""

    token: Any
    request: PeerStart
    endpoints: dict[int, str]


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of a command, for the main loop to reply with (``kind``: which refusal,
    when not ``ok``)."""

    token: Any
    ok: bool
    data: dict[str, Any]
    error: str = ""
    kind: ErrorKind = ErrorKind.REFUSED


@dataclass(slots=True)
class PinnedStep:
    """A node's snapshot of one step: its ranks' pinned slots, mapped read-only."""

    step: int
    pieces: list[RankPiece]
    maps: list[mmap.mmap] = field(default_factory=list)

    def manifest(self) -> bytes:
        """What the node's bytes are, for a rebuilt node (JSON: ranks in order)."""
        return encode_manifest(
            NodeManifest(
                self.step,
                [ManifestEntry(p.rank, p.used, p.capacity, p.layout) for p in self.pieces],
            )
        )

    def open(self) -> SegmentedBytes:
        """Map every piece read-only and return the node's bytes."""
        self.maps = [shm.map_readonly(p.path, max(p.used, 1))[0] for p in self.pieces]
        return SegmentedBytes(
            [memoryview(mm)[: p.used] for mm, p in zip(self.maps, self.pieces, strict=True)]
        )

    def close(self) -> None:
        """Unmap (the protector must have released its views first)."""
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:
                log.warning("step %d: a mapping is still referenced", self.step)
        self.maps = []


@dataclass(frozen=True, slots=True)
class Generation:
    """The generation a node's protection is in, from its start command to the next one."""

    me: int
    epoch: int
    ranks: tuple[int, ...]
    plan: GroupPlan
    endpoints: Mapping[int, str]
    """The group's peer endpoints, by node index."""
    protector: GroupProtector
    """The group's protocol (kept across generations while the group stays the same)."""

    def peers(self) -> list[int]:
        """The other nodes of the group."""
        return [n for n in self.plan.nodes if n != self.me]


class PinnedSteps:
    """The steps whose slots this node keeps pinned (so ranks cannot overwrite them), each
    mapped read-only while the protector may read it, and which of them is protected.

    A step leaves only through :meth:`release` (the protector has forgotten it) or
    :meth:`drop` (this forgets it), which unmap it first and then unpin its slots.
    """

    def __init__(self, local: SlotStore) -> None:
        self.local = local
        self.protected: int | None = None
        """The newest step the group protected (None: none, or given up)."""
        self._held: dict[int, PinnedStep] = {}

    def steps(self) -> list[int]:
        """The steps held pinned."""
        return list(self._held)

    def get(self, step: int) -> PinnedStep | None:
        """The pinned ``step`` (None: not held)."""
        return self._held.get(step)

    def pin(self, ranks: tuple[int, ...], step: int) -> PinnedStep | None:
        """Pin every slot of ``ranks`` that holds ``step`` (None: some rank no longer holds
        it, nothing pinned). The caller keeps or drops the result."""
        pieces = self.local.pin_step(list(ranks), step)
        return None if pieces is None else PinnedStep(step, pieces)

    def keep(self, pinned: PinnedStep) -> None:
        """Hold ``pinned`` until it is released."""
        self._held[pinned.step] = pinned

    def release(self, step: int) -> None:
        """Unmap and unpin a held step (the protector must have forgotten it)."""
        pinned = self._held.pop(step, None)
        if pinned is not None:
            pinned.close()
            self.local.unpin(pinned.pieces)

    def drop(self, pinned: PinnedStep, protector: GroupProtector) -> None:
        """Give up a step (held or not): the protector forgets it; unmap and unpin it."""
        protector.forget(pinned.step)
        self._held.pop(pinned.step, None)
        pinned.close()
        self.local.unpin(pinned.pieces)

    def keep_only(self, step: int | None, protector: GroupProtector | None) -> None:
        """Forget (in ``protector``, if any) and release every held step but ``step``."""
        for old in [s for s in self._held if s != step]:
            if protector is not None:
                protector.forget(old)  # drop its views before unmapping
            self.release(old)


class StatusBoard:
    """What the protection service reports: its :class:`ProtectionStatus`, written by the
    protection thread and read by any thread (:meth:`read`), its event log, and the node
    name of its log lines."""

    def __init__(self, node_name: str, events: EventLog | None = None) -> None:
        self.node_name = node_name
        self.events = events
        """The SMP's event log for ``sync``, ``protected``, ``rebuilt``... (None: no events)."""
        self._lock = threading.Lock()
        self._status = ProtectionStatus(enabled=True, state=ProtectionState.UNBOUND)

    @property
    def state(self) -> ProtectionState:
        """The state machine's state."""
        state = self._status.state
        assert state is not None
        return state

    def move(self, new: ProtectionState, **kw: Any) -> None:
        """Move to ``new`` (IllegalTransition if ProtectionState does not allow it), setting the
        status fields ``kw``."""
        self.update(state=self.state.to(new), **kw)

    def update(self, **kw: Any) -> None:
        """Set fields of the status (names and types of :class:`ProtectionStatus`)."""
        with self._lock:
            self._status = dataclasses.replace(self._status, **kw)

    def count(self, counter: str) -> None:
        """Add one to ``counter`` (a field of :class:`~ftmem.protocol.status.RoundCounters`)."""
        with self._lock:
            c = self._status.counters
            c = dataclasses.replace(c, **{counter: getattr(c, counter) + 1})
            self._status = dataclasses.replace(self._status, counters=c)

    def read(self) -> ProtectionStatus:
        """The status now (frozen: safe to keep)."""
        with self._lock:
            return self._status

    def event(self, event: str, **fields: Any) -> None:
        """Write ``event`` to the SMP's event log (if any)."""
        if self.events is not None:
            self.events.write(event, **fields)
