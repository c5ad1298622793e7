"""The agent's use of its failure detector (:mod:`ftmem.launch.detector`), round by round.

At each round of several nodes, before the ranks start, :meth:`NodeWatch.watch_round`:

1. starts the detector at the first such round, with a key derived from the job's; without
   a key file, across hosts, it stays off (its heartbeats could not be authenticated) and a
   lost machine is found by the rendezvous keep-alive alone;
2. publishes this node's heartbeat address in the store (``ftmem/watch/<slot>``,
   authenticated) and reads its ring neighbours' (at most ``2 * RADIUS`` reads);
3. has the detector watch them for this generation.

A machine declared lost is recorded (``declared_lost``) and handed to ``declare``
(:meth:`MembershipWatch.declare <ftmem.launch.membership.MembershipWatch.declare>`: every
agent restarts at once). Nothing here touches elastic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ftmem.errors import FtmemError
from ftmem.events import EventLog
from ftmem.exchange.keys import KeyFileError
from ftmem.launch.config import is_loopback
from ftmem.launch.detector import FailureDetector, neighbours, read_watch_entry, watch_entry
from ftmem.launch.peers import PeerMesh, read_entries

log = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class NodeWatch:
    """The failure detector of one agent, told each round's ring neighbours.

    ``mesh`` lends the detector its settings and job key; ``suspect`` is
    ``--ftmem-tune detect-timeout`` (0: off); ``publish`` marks a node lost in the rendezvous;
    ``declare`` is called (on the detector's thread) with a node declared lost and why.
    """

    node: str
    run_id: str
    mesh: PeerMesh
    suspect: timedelta
    insecure: bool
    publish: Callable[[str], bool]
    events: EventLog
    declare: Callable[[str, str], None] | None
    _generation: int = field(default=-1, init=False)
    _key: bytes = field(default=b"", init=False)
    detector: FailureDetector | None = field(default=None, init=False)
    """The failure detector, started at the first round of several nodes."""
    _off: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self._off = self.suspect.total_seconds() <= 0

    def watch_round(
        self,
        store: Any,
        *,
        nodes: int | None,
        slot: int | None,
        group_rank: int | None,
        me: str | None,
        generation: int,
    ) -> None:
        """Watch this round's ring neighbours (steps 1-3 of the module docstring): this node
        holds ``slot`` of ``nodes`` and is ``me`` in the rendezvous. A failure to publish or
        read the entries is logged: the round goes unwatched, the job goes on.

        Raises:
            RoundAbandoned: a node left the round while its entry was awaited (``store``
                a :class:`~ftmem.launch.elastic_compat.RoundStore`)."""
        self._generation = generation
        if self._off or store is None or nodes is None or nodes < 2 or me is None:
            return
        if slot is None or group_rank is None or not 0 <= slot < nodes:
            return
        slots = [f"slot {i}" for i in range(nodes)]  # the ring, by slot; names filled in below
        near = [slots.index(x) for x in neighbours(slots, slots[slot])]
        try:
            detector = self.detector or self._start(store, group_rank)
            if detector is None:
                return
            store.set(
                f"ftmem/watch/{slot}",
                watch_entry(self._key, generation, slot, me, detector.address),
            )
            entries = read_entries(
                store,
                [f"ftmem/watch/{i}" for i in near],
                lambda j, raw: read_watch_entry(self._key, raw, generation, near[j]),
            )
        except (FtmemError, KeyFileError, OSError, RuntimeError, ValueError) as exc:
            log.warning(
                "[%s] the failure detector does not watch generation %d (%s): a lost machine "
                "is found by the rendezvous keep-alive alone",
                self.node,
                generation,
                exc,
            )
            return
        slots[slot] = me
        for e in entries:
            slots[e.slot] = e.node
        detector.watch(generation, me, {e.node: e.addr for e in entries}, slots)

    def _start(self, store: Any, group_rank: int) -> FailureDetector | None:
        """Start the failure detector with a key derived from the job's (None: no key)."""
        from ftmem.exchange import keys

        ps = self.mesh.settings
        if ps.key_file is None and not self.insecure and not is_loopback(ps.host):
            log.warning(
                "[%s] no --ftmem-key-file: the failure detector's heartbeats cannot be "
                "authenticated across hosts, so it is off; a lost machine is found by the "
                "rendezvous keep-alive alone",
                self.node,
            )
            self._off = True
            return None
        job = keys.CurveKeyPair.from_json(self.mesh.job_keys(store, group_rank))
        self._key = job.derived_key("heartbeat")
        detector = FailureDetector(
            node=self.node,
            run_id=self.run_id,
            key=self._key,
            host=ps.host,
            suspect=self.suspect,
            publish=self.publish,
            on_lost=self._declared_lost,
        )
        detector.start()
        self.detector = detector
        return detector

    def _declared_lost(self, node: str, why: str) -> None:
        """The detector published ``node`` lost (its thread): restart at once."""
        self.events.write("declared_lost", peer=node, why=why, generation=self._generation)
        if self.declare is not None:
            self.declare(node, why)

    def why_gone(self, node: str) -> str | None:
        """Why the detector holds ``node`` lost (:meth:`FailureDetector.why_gone`); None while
        it hears ``node``, or when no detector runs."""
        return self.detector.why_gone(node) if self.detector is not None else None

    def pause(self) -> None:
        """The ranks are stopped: declare nothing until the next round is watched."""
        if self.detector is not None:
            self.detector.pause()

    def close(self) -> None:
        """Stop the detector (its peers hear that this agent leaves)."""
        if self.detector is not None:
            self.detector.close()
