"""The agent's recovery lifecycle: one state machine, owned by :class:`RecoveryLifecycle`.

States and transitions (checked at run time: any other raises
:class:`~ftmem.errors.IllegalTransition`)::

    INIT ---------------> JOINING     the first rendezvous
    JOINING ------------> SPARE       the round has all its nodes: wait as a hot spare (a node
                                      dropped from the job is FENCED on its way here)
    SPARE --------------> JOINING     a node was lost: take its place
    JOINING ------------> SYNCING     the round is complete, the slots agreed: the peer mesh
                                      syncs; a node that lost its memory REBUILDS it from peers
    SYNCING ------------> STARTED     the generation's ranks started (warm, kept, or cold)
    SYNCING ------------> JOINING     a node left the round before the ranks started: the next
    STARTED ------------> RUNNING     every rank stepped (after a failure: RESUMED)
    STARTED, RUNNING ---> DETECTED    a failure of a kind in :class:`FailureKind`
    STARTED, RUNNING,
      DETECTED ---------> RESTARTING  elastic restarts the ranks (a membership change or a lost
                                      machine is DETECTED on the way)
    RESTARTING ---------> STOPPED     the survivors stopped, or detached to rejoin in process
    STOPPED ------------> JOINING     the restart's rendezvous
    any ----------------> DONE        the job finished, ran out of restarts, or the agent stops

A recovery (:class:`~ftmem.launch.report.Recovery`: when and what was detected, the newest
committed step) is opened at DETECTED and closed at RUNNING. Every transition is written to
the event log (``state``) so a timeline shows the phases. Nothing here touches elastic: the
agent tells the lifecycle what happened and asks it what to do.
"""

from __future__ import annotations

import enum
import logging
import time

from ftmem.errors import IllegalTransition
from ftmem.events import EventLog
from ftmem.launch.monitor import NoProgressGuard
from ftmem.launch.report import Recovery

log = logging.getLogger(__name__)


class AgentState(enum.Enum):
    """Where the agent is in its ranks' life (see the module docstring)."""

    INIT = "init"
    JOINING = "joining"
    SPARE = "spare"
    SYNCING = "syncing"
    STARTED = "started"
    RUNNING = "running"
    DETECTED = "detected"
    RESTARTING = "restarting"
    STOPPED = "stopped"
    DONE = "done"


class FailureKind(enum.Enum):
    """What made the agent restart its ranks."""

    RANK = "rank"
    """A rank exited with an error or a signal."""
    HANG = "hang"
    """A rank made no progress for the hang timeout (killed by the agent)."""
    SMP = "smp"
    """The node's SMP died (it is restarted and rebuilds from peers)."""
    PROTECTION = "protection"
    """The SMP's erasure-coding thread stopped (a new peer mesh is made)."""
    MACHINE_LOST = "machine_lost"
    """Another machine was dropped from the job; a spare or replacement joins."""
    MEMBERSHIP = "membership"
    """Another node (re-)joined the rendezvous (its own failure, usually)."""

    @property
    def node_side(self) -> bool:
        """The failure is this node's SMP side: every rank restarts cold."""
        return self in (FailureKind.SMP, FailureKind.PROTECTION)


_S = AgentState
_NEXT: dict[AgentState, frozenset[AgentState]] = {
    _S.INIT: frozenset({_S.JOINING}),
    _S.JOINING: frozenset({_S.SPARE, _S.SYNCING}),
    _S.SPARE: frozenset({_S.JOINING}),
    _S.SYNCING: frozenset({_S.STARTED, _S.JOINING}),
    _S.STARTED: frozenset({_S.RUNNING, _S.DETECTED}),
    _S.RUNNING: frozenset({_S.DETECTED}),
    _S.DETECTED: frozenset({_S.RESTARTING}),
    _S.RESTARTING: frozenset({_S.STOPPED}),
    _S.STOPPED: frozenset({_S.JOINING}),
    _S.DONE: frozenset(),
}


class RecoveryLifecycle:
    """The agent's state (see the module docstring), its current recovery and its account of
    failures: the no-progress guard, the last failure and why the agent gave up.
    """

    def __init__(self, node: str, events: EventLog, guard: NoProgressGuard) -> None:
        self.node = node
        self.events = events
        self.guard = guard
        self.state = AgentState.INIT
        self.kind: FailureKind | None = None
        """The kind of the failure being recovered from (None: none, or a first start)."""
        self.recovery: Recovery | None = None
        """The recovery in progress: opened at DETECTED, closed at RUNNING."""
        self.first_seen: float | None = None
        """When a rank was first seen dead, before elastic's verdict (a detection time)."""
        self.joined_at: float | None = None
        """When the newest rendezvous round completed."""
        self.started_at = 0.0
        """When the newest generation's ranks were started."""
        self.stop_reason: str | None = None
        """Why the agent gave up early (the no-progress guard), for the final report."""
        self.last_failure: tuple[int | None, str, list[str]] | None = None
        """(rank, what, the rank's last lines of stderr) of the newest rank failure."""

    # -- transitions --------------------------------------------------------------------------

    def to(self, new: AgentState, **fields: object) -> None:
        """Move to ``new`` (DONE from any state) and write the ``state`` event.

        Raises:
            IllegalTransition: the state machine does not allow it.
        """
        old = self.state
        if new is not AgentState.DONE and new not in _NEXT[old]:
            raise IllegalTransition(f"agent state {old.value} -> {new.value} is not allowed")
        self.state = new
        now = time.time()
        if new is AgentState.SYNCING:
            self.joined_at = now
        elif new is AgentState.STARTED:
            self.started_at = now
        self.events.write("state", state=new.value, previous=old.value, **fields)

    @property
    def watching(self) -> bool:
        """Ranks of this generation run and a failure can be detected."""
        return self.state in (AgentState.STARTED, AgentState.RUNNING)

    def detected(
        self,
        kind: FailureKind,
        what: str,
        committed: int | None,
        *,
        stopped: float | None = None,
    ) -> Recovery:
        """A failure of ``kind``: move to DETECTED and open its recovery (detected at the
        first sight of a dead rank if there was one, else now)."""
        detected = self.first_seen if self.first_seen is not None else time.time()
        self.first_seen = None
        self.kind = kind
        self.recovery = Recovery(detected=detected, what=what, committed=committed, stopped=stopped)
        self.to(AgentState.DETECTED, kind=kind.value, what=what, committed=committed)
        return self.recovery

    def resumed(self) -> Recovery | None:
        """Every rank stepped: move to RUNNING; return the recovery that ends (None at a
        first start), with its rendezvous and start times filled in."""
        rec, self.recovery = self.recovery, None
        self.kind = None
        self.to(AgentState.RUNNING)
        if rec is not None:
            rec.rendezvous = self.joined_at
            rec.started = self.started_at
        return rec

    # -- accounting ---------------------------------------------------------------------------

    def check_guard(self, committed: int | None, restarts_left: int) -> bool:
        """Count a failure with the no-progress guard; True if the agent must stop
        restarting now (logged, with :attr:`stop_reason` set)."""
        if not (self.guard.on_failure(committed) and restarts_left > 0):
            return False
        self.stop_reason = (
            f"{self.guard.streak} restart(s) in a row without a newer committed step "
            f"(newest committed: {self.guard.best}); stopping "
            f"(--ftmem-tune no-progress-restarts={self.guard.limit})"
        )
        log.error("[%s] NO PROGRESS: %s", self.node, self.stop_reason)
        self.events.write("no_progress_stop", reason=self.stop_reason)
        return True

    def failed(
        self,
        kind: FailureKind,
        what: str,
        committed: int | None,
        generation: int,
        restarts: tuple[int, int],
        *,
        rank: int | None = None,
        stopped_ranks: list[int] | None = None,
        smp_died: bool = False,
        stopped: float | None = None,
    ) -> bool:
        """A failure of ``kind`` on this node, reported once: DETECTED (its recovery opened,
        :meth:`detected`), counted by the no-progress guard, and the line ``[node/rank]
        FAILED: <what> (generation g); newest committed step ...; <outcome>`` (with
        ``smp_died`` the step is the last one seen before the SMP died: the restarted SMP
        adopts what it finds); ``restarts`` is (left, max). True: the agent must stop
        restarting (the guard's verdict, which the line already tells)."""
        self.detected(kind, what, committed, stopped=stopped)
        left, most = restarts
        stop = self.check_guard(committed, left)
        if left > 0 and not stop:
            outcome = f"restarting ({most - left + 1}/{most})"
        elif self.stop_reason:
            outcome = "not restarting (no-progress guard)"
        else:
            outcome = f"no restarts left (max {most})"
        log.error(
            "[%s/%s] FAILED: %s (generation %d); newest committed step on this node: %s%s; %s%s",
            self.node,
            "-" if rank is None else rank,
            what,
            generation,
            committed,
            " as last seen before the SMP died (RESUMED names the step restored)"
            if smp_died
            else "",
            outcome,
            f"; ranks {stopped_ranks} stopped by the agent" if stopped_ranks else "",
        )
        return stop

    def report_last_failure(self) -> None:
        """Before torchrun's summary: why the agent gave up (the no-progress guard) and the
        failing rank's last lines of stderr."""
        if self.stop_reason:
            log.error("[%s] stopped: %s", self.node, self.stop_reason)
        if self.last_failure is not None and self.last_failure[2]:
            rank, what, tail = self.last_failure
            log.error(
                "[%s/%s] last failure: %s; the rank's last %d lines of stderr:\n%s",
                self.node,
                "-" if rank is None else rank,
                what,
                len(tail),
                "\n".join(f"    {line}" for line in tail),
            )
