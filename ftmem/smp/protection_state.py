"""What the SMP's protection thread holds and what it reports.

:class:`ProtectionContext` is the state the thread's parts share (the service in protection.py,
the sync in protection_sync.py, the rounds in protection_rounds.py, the rebuild in
protection_rebuild.py): the generation's group and protector, the pinned steps, the protected
step and the counters. Only the protection thread touches it.

:class:`StatusBoard` is the one thing other threads read: the state machine's state and a
JSON-ready status document, behind a lock (``ftmem status``, the flush scheduler).
"""

from __future__ import annotations

import json
import mmap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.events import EventLog
from ftmem.exchange.placement import GroupPlan
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.segments import SegmentedBytes
from ftmem.format.record import ManifestEntry, NodeManifest, encode_manifest
from ftmem.protocol import peer as pm
from ftmem.protocol.status import ProtectionState
from ftmem.smp.slot_store import SlotStore
from ftmem.smp.store import RankPiece

log = get_logger(__name__)


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
        self.maps = [shm.map_readonly(Path(p.path), max(p.used, 1)) for p in self.pieces]
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


class StatusBoard:
    """The protection service's state (:class:`ProtectionState`) and status document, shared by threads.

    The protection thread writes (:meth:`move`, :meth:`update`); any thread reads a copy
    (:meth:`snapshot`, or typed: :meth:`typed`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = ProtectionState.UNBOUND
        self._doc: dict[str, Any] = {"enabled": True, "state": self.state.value}

    def move(self, new: ProtectionState, **kw: Any) -> None:
        """Move to ``new`` (IllegalTransition if ProtectionState does not allow it) and publish it
        in the status (as its ``.value``) with ``kw``."""
        self.state = self.state.to(new)
        self.update(state=new.value, **kw)

    def update(self, **kw: Any) -> None:
        """Set fields of the status document."""
        with self._lock:
            self._doc.update(kw)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready deep copy of the status document."""
        with self._lock:
            copy: dict[str, Any] = json.loads(json.dumps(self._doc))
            return copy

    def get(self, name: str) -> Any:
        """One field of the status document (None: not set)."""
        with self._lock:
            return self._doc.get(name)


@dataclass(eq=False)
class ProtectionContext:
    """The protection thread's state, shared by its parts (see the module docstring)."""

    node_name: str
    local: SlotStore
    events: EventLog | None
    """The SMP's event log for ``sync``, ``protected``, ``rebuilt``... (None: no events)."""
    board: StatusBoard = field(default_factory=StatusBoard)
    protector: GroupProtector | None = None
    plan: GroupPlan | None = None
    me: int = -1
    epoch: int = -1
    ranks: list[int] = field(default_factory=list)
    endpoints: dict[int, str] = field(default_factory=dict)
    pinned: dict[int, PinnedStep] = field(default_factory=dict)
    protected: int | None = None
    counters: dict[str, int] = field(
        default_factory=lambda: {"protected": 0, "aborted": 0, "failed": 0, "rebuilt": 0}
    )
    last_protect_s: float = 0.0
    last_rebuild_s: float = 0.0

    def event(self, event: str, **fields: Any) -> None:
        """Write ``event`` to the SMP's event log (if any)."""
        if self.events is not None:
            self.events.write(event, **fields)

    def peers(self) -> list[int]:
        """The other nodes of the group."""
        assert self.plan is not None
        return [n for n in self.plan.nodes if n != self.me]

    def send(self, node: int, body: pm.PeerBody) -> None:
        """Queue one of the service's own messages (ordered with the protocol's)."""
        assert self.protector is not None
        self.protector.send(node, body)

    def release(self, step: int) -> None:
        """Unmap and unpin a held step (the protector must have forgotten it)."""
        pinned = self.pinned.pop(step, None)
        if pinned is not None:
            pinned.close()
            self.local.unpin(pinned.pieces)

    def drop(self, step: int, pinned: PinnedStep) -> None:
        """Give up a step that was being protected: forget it, unmap and unpin it."""
        assert self.protector is not None
        self.protector.forget(step)
        pinned.close()
        self.local.unpin(pinned.pieces)

    def publish(self, last_seen: dict[int, float], dropped: int, forged: int = 0) -> None:
        """Refresh the status document: bytes held, peer health, counters (``dropped``: the
        messages the service and its transport dropped; ``forged``: those of them refused
        for a wrong tag on the data channel)."""
        now = time.monotonic()
        p = self.protector
        pool = p.encode_pool if p is not None else None
        own = 0
        if p is not None and self.protected is not None and self.protected in p.steps:
            st = p.steps[self.protected]
            own = st.data.nbytes if st.data is not None else 0
        peers = {
            str(n): {
                "endpoint": ep,
                "last_seen_s": round(now - last_seen[n], 1) if n in last_seen else None,
            }
            for n, ep in self.endpoints.items()
            if n != self.me
        }
        self.board.update(
            protected_step=self.protected,
            own_bytes=own,
            parity_bytes=p.parity_bytes(self.protected)
            if p is not None and self.protected is not None
            else 0,
            peers=peers,
            counters=dict(self.counters),
            last_protect_s=round(self.last_protect_s, 3),
            last_rebuild_s=round(self.last_rebuild_s, 3),
            dropped_messages=(p.dropped if p is not None else 0) + dropped,
            forged_messages=forged,
            sent_bytes=p.sent_bytes if p is not None else 0,
            encode_workers=len(pool.pids) if pool is not None else 0,
            worker_stripes=pool.encoded if pool is not None else 0,
            worker_fallbacks=pool.fell_back if pool is not None else 0,
        )
