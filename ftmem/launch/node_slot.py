"""This node's place in the job across rounds: its slot, and its fencing.

A slot is a block of ``local_world_size`` global ranks. Each round, this node offers the slot
it held in the last one, and the round's offers are agreed
(:class:`~ftmem.launch.rendezvous.SlotClaims`): a node keeps its ranks, a replacement or a
spare takes a lost node's slot. A node that was dropped from the job and comes back (it was
cut off, or stalled past the keep-alive bound) finds its slot taken: it is *fenced*, its
snapshots (of an identity it no longer has) dropped with a fresh SMP, so it can only come back
as a new node.
"""

from __future__ import annotations

import logging
from typing import Any

from ftmem.events import EventLog
from ftmem.launch.monitor import StatusPoller
from ftmem.launch.rendezvous import SlotAgreement, SlotClaims, SlotOffer
from ftmem.launch.smp_runner import SmpRunner

log = logging.getLogger(__name__)


class NodeSlot:
    """This node's slot across rounds (see the module docstring); ``smp`` is restarted empty
    when the node is fenced."""

    def __init__(
        self, claims: SlotClaims, smp: SmpRunner, poller: StatusPoller, events: EventLog
    ) -> None:
        self._claims = claims
        self._smp = smp
        self._node = smp.node
        self._poller = poller
        self._events = events
        self.slot: int | None = None
        """This node's block of global ranks (stable across rounds), None: elastic's."""
        self.claimed: int | None = None
        """The slot this node held in the last round (what it offered in this one)."""
        self.nodes: int | None = None
        """The node count of the last round this node ran ranks in (None: none yet)."""
        self._ranks: list[int] | None = None

    def agree(
        self,
        store: Any,
        group_rank: int,
        group_world_size: int,
        local_world_size: int,
        generation: int,
        round_: int | None,
    ) -> int | None:
        """Agree this round's slots, offering the one this node held; a node whose slot went
        to a node that took it over more recently is fenced. Return this node's slot (None:
        the nodes differ in size, elastic assigns the ranks)."""
        claimed = self.claimed = self.slot
        nodes = self.nodes if claimed is not None else None
        offer = SlotOffer(claimed, local_world_size, generation, nodes)
        self.slot = self._claims.agree(store, group_rank, group_world_size, offer, round_)
        if claimed is not None and self._claims.fenced_by(claimed, group_rank):
            self.fence(f"slot {claimed} is held by a node that took it over more recently")
        if self.slot is None:
            log.warning("[%s] nodes differ in size: elastic assigns the ranks", self._node)
        return self.slot

    def unassigned(self) -> None:
        """elastic assigns this round's ranks (stable ranks do not apply)."""
        self.slot = None
        self._claims.agreed = None

    def agreement(self) -> SlotAgreement | None:
        """This round's slot agreement (None: stable ranks do not apply)."""
        return self._claims.agreed

    def index(self, group_rank: int | None) -> int | None:
        """This node's index in the round's ring and mesh: its slot, else its group rank."""
        return self.slot if self.slot is not None else group_rank

    def offers(self) -> list[SlotOffer]:
        """The round's agreed offers (none without a slot)."""
        return self._claims.offers() if self.slot is not None else []

    def joined(self, ranks: list[int]) -> None:
        """This round's global ranks of this node; a change (elastic's numbering) is logged."""
        if self._ranks is not None and ranks != self._ranks:
            log.warning(
                "[%s] global ranks changed %s -> %s (elastic's numbering): this node's "
                "ranks now find other ranks' snapshots in its SMP",
                self._node,
                self._ranks,
                ranks,
            )
        self._ranks = ranks

    def to_spare(self) -> None:
        """This node waits as a hot spare (logged); the slot it held went on without it
        (fenced)."""
        log.warning(
            "[%s] SPARE: the job has all its nodes; waiting as a hot spare (an SMP and "
            "a warm start) to take the place of a lost node",
            self._node,
        )
        if self.slot is not None:
            self.fence(f"slot {self.slot} went on without this node")
            self.slot = None

    def fence(self, why: str) -> None:
        """This node was dropped from the job and its place taken: drop its snapshots (a
        fresh SMP) and its ranks' history; the caller gives it a new slot (or none: a
        spare)."""
        log.warning(
            "[%s] FENCED: %s (this node was dropped from the job); dropping this node's "
            "snapshots and its slot",
            self._node,
            why,
        )
        self._events.write("fenced", slot=self.slot, why=why)
        self._ranks = None
        self._smp.stop()
        self._smp.ensure_running()
        self._poller.forget()
