"""Which machines are in the job, and riding out a rendezvous store that does not answer.

elastic's agent asks its rendezvous handler, at every monitor interval while the ranks are
healthy, whether nodes wait to join (``num_nodes_waiting``: a read of the store). When the
store's host is unreachable (a partition, a flapping link) that read blocks until the store's
timeout (60 s) and then raises, and elastic's agent exits on the error, stopping its ranks and
its SMP. :class:`MembershipWatch` wraps the handler so that:

- the read runs on a thread of its own and the agent waits for it at most ``patience``: the
  agent's loop (rank exits, hang detection, the SMP) keeps running during an outage, which is
  logged once when it starts and once when it ends;
- a failed read is retried with a doubling backoff (:data:`BACKOFF_S`) and counts as "nobody
  waits", so a store error never ends the agent;
- a failed join (``next_rendezvous``) is retried with the same backoff until the join timeout;
- after each read it compares the rendezvous members with those of the round the ranks run in:
  a node whose keep-alive is late is logged (``STALL``), one that elastic dropped for good
  (its keep-alive expired, or ftmem's failure detector marked it expired, even if another
  node's read dropped it first: this node's detector no longer hears it) is logged as
  ``MACHINE LOST``; each is written to the event log;
- a loss that this node's failure detector declared (:mod:`ftmem.launch.detector`, through
  :meth:`MembershipWatch.declare`) is a ``MACHINE LOST`` at once, and the next check answers
  that a node waits: elastic's agent then restarts its ranks (a membership change, not
  charged as a restart), whether or not a spare waits to take the lost node's place.

Everything else is the wrapped handler's (attribute access is forwarded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousTimeoutError,
)

from ftmem.launch.elastic_compat import (
    keep_alive_bound_s,
    rendezvous_join_timeout_s,
    rendezvous_members,
)

log = logging.getLogger(__name__)

STALL_SHARE = 0.7
"""A keep-alive older than this share of the bound is logged as a stall (a heartbeat is
sent about every interval and the state read may be one interval old: up to ~2 intervals
is normal)."""
BACKOFF_S = (0.5, 8.0)
"""First and longest wait before a failed store read or join is tried again."""
SPARES_LINGER_S = 3.0
"""How long an agent that closed the rendezvous keeps running while spares wait (they read
the state about once a second)."""


class MembershipWatch(RendezvousHandler):
    """elastic's rendezvous handler (``inner``) with the behaviour of the module docstring.

    Args:
        inner: the c10d (or etcd) rendezvous handler elastic made.
        node: this node's name, for the logs.
        patience: how long the agent's loop waits for one read of the store.
        on_event: called with an event name and fields (the agent's event log).

    Resource handling: a read that outlives ``patience`` goes on in a daemon thread that
    ends with the read (the store's own timeout bounds it); no second read starts meanwhile.
    """

    def __init__(
        self,
        inner: Any,
        node: str,
        patience: timedelta = timedelta(seconds=1),
        on_event: Callable[..., None] | None = None,
    ) -> None:
        self._inner = inner
        self._node = node
        self._patience = patience.total_seconds()
        self.on_event: Callable[..., None] = on_event or (lambda name, **fields: None)
        """Called with an event name and its fields (the agent sets its event log's write)."""
        self.why_gone: Callable[[str], str | None] = lambda node: None
        """Why this node's failure detector holds a node lost, None while it hears it (the
        agent sets :meth:`ftmem.launch.node_watch.NodeWatch.why_gone`)."""
        self._reader: threading.Thread | None = None
        self._answer: list[int | BaseException] = []
        self._not_before = 0.0
        self._backoff = BACKOFF_S[0]
        self._outage_since: float | None = None
        self._round_members: frozenset[str] = frozenset()
        self._stalled: set[str] = set()
        self.lost: list[str] = []
        """Nodes of the current round that elastic dropped (no keep-alive), in order."""
        self._declared: list[tuple[str, str]] = []
        self._declared_lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the wrapped handler's settings
        # and internals (read through ftmem.launch.elastic_compat).
        return getattr(self._inner, name)

    @property
    def use_agent_store(self) -> bool:
        """The wrapped handler's."""
        return bool(self._inner.use_agent_store)

    def get_backend(self) -> str:
        """The wrapped handler's."""
        return str(self._inner.get_backend())

    def get_run_id(self) -> str:
        """The wrapped handler's."""
        return str(self._inner.get_run_id())

    def is_closed(self) -> bool:
        """The wrapped handler's."""
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        """The wrapped handler's."""
        self._inner.set_closed()

    def shutdown(self) -> bool:
        """Close the rendezvous for every node (the wrapped handler's). If spares wait, the
        store stays up :data:`SPARES_LINGER_S` longer, so that they read that the job is
        over and leave cleanly (with a store on this node, they would lose it first)."""
        closed = bool(self._inner.shutdown())
        members = rendezvous_members(self._inner)
        if closed and members is not None and members.waiting:
            log.info(
                "[%s] %d spare(s) wait: keeping the store up %.0f s for them to leave",
                self._node,
                members.waiting,
                SPARES_LINGER_S,
            )
            time.sleep(SPARES_LINGER_S)
        return closed

    # -- joining ------------------------------------------------------------------------------

    def next_rendezvous(self) -> RendezvousInfo:
        """elastic's join, retried with backoff while the store cannot be reached (until the
        join timeout); then the members of the new round are remembered."""
        budget = rendezvous_join_timeout_s(self._inner) or 600.0
        t0 = time.monotonic()
        deadline = t0 + budget
        delay = BACKOFF_S[0]
        while True:
            try:
                info: RendezvousInfo = self._inner.next_rendezvous()
                break
            except RendezvousTimeoutError:
                self._not_enough(budget)
                raise
            except RendezvousConnectionError as exc:
                if time.monotonic() + delay > deadline:
                    log.error(
                        "[%s] STORE LOST: the rendezvous store did not answer until the join "
                        "timeout (%.0f s): stopping this agent",
                        self._node,
                        budget,
                    )
                    self.on_event("store_lost", waited_s=budget)
                    raise
                log.warning(
                    "[%s] the rendezvous store cannot be reached while joining (%s): "
                    "trying again in %.1f s",
                    self._node,
                    exc.__cause__ or exc,
                    delay,
                )
                time.sleep(delay)
                delay = min(2 * delay, BACKOFF_S[1])
        members = rendezvous_members(self._inner)
        self._round_members = members.participants if members is not None else frozenset()
        log.info(
            "[%s] rendezvous round %s formed: %d nodes, joined in %.2f s",
            self._node,
            members.round if members is not None else "?",
            len(self._round_members),
            time.monotonic() - t0,
        )
        self._stalled.clear()
        self.lost = []
        with self._declared_lock:
            self._declared = []
        return info

    def declare(self, node: str, why: str) -> None:
        """The failure detector declared ``node`` lost (and published it): the next
        :meth:`num_nodes_waiting` reports it and makes the agent restart. Thread-safe."""
        with self._declared_lock:
            self._declared.append((node, why))

    def machine_lost(self) -> bool:
        """Whether a node of the round was declared lost (the declarations not yet reported
        are logged first). A re-join asks: after a machine loss the first survivor to restart
        breaks the others' collectives, so their own failure is a rank's, not the loss."""
        return self._take_declared()

    def _take_declared(self) -> bool:
        """Log the declared losses not yet reported; True if any node of the round is lost."""
        with self._declared_lock:
            declared, self._declared = self._declared, []
        for node, why in declared:
            if node in self.lost or node not in self._round_members:
                continue
            self.lost.append(node)
            log.error(
                "[%s] MACHINE LOST: %s declared lost by the failure detector (%s)",
                self._node,
                node,
                why,
            )
            self.on_event("machine_lost", peer=node, detector=True, why=why)
        return bool(self.lost)

    def _not_enough(self, waited_s: float) -> None:
        """Say why the join timed out: too few machines (lost ones, no spare left)."""
        need = getattr(getattr(self._inner, "settings", None), "min_nodes", "?")
        members = rendezvous_members(self._inner)
        have = len(members.participants) if members is not None else "?"
        log.error(
            "[%s] NOT ENOUGH MACHINES: the job needs %s nodes and only %s joined within the "
            "join timeout (%.0f s)%s; no spare was left to take a lost node's place. "
            "Stopping this agent (its SMP's snapshots go with it; flushed checkpoints stay)",
            self._node,
            need,
            have,
            waited_s,
            f" after losing {', '.join(self.lost)}" if self.lost else "",
        )
        self.on_event("not_enough_machines", need=need, have=have, lost=self.lost)

    # -- the healthy loop's read --------------------------------------------------------------

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, as elastic's handler says; 0 while the store does not answer
        (see the module docstring); at least 1 once a node of the round was declared lost."""
        if self._take_declared():
            return max(1, len(self.lost))
        now = time.monotonic()
        if self._reader is None:
            if now < self._not_before:
                return 0
            self._answer = []
            self._reader = threading.Thread(target=self._read, name="ftmem-rdzv-read", daemon=True)
            self._reader.start()
        self._reader.join(self._patience)
        if self._reader.is_alive():
            self._outage(now, "no answer yet")
            return 0
        self._reader = None
        answer = self._answer[0] if self._answer else RuntimeError("no answer")
        if isinstance(answer, BaseException):
            self._outage(now, f"{type(answer).__name__}: {answer.__cause__ or answer}")
            self._not_before = time.monotonic() + self._backoff
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])
            return 0
        if self._outage_since is not None:
            lasted = now - self._outage_since
            log.warning("[%s] the rendezvous store answers again after %.1f s", self._node, lasted)
            self.on_event("store_reachable", after_s=round(lasted, 3))
            self._outage_since = None
        self._backoff = BACKOFF_S[0]
        self._check_members()
        if self._take_declared():
            return max(1, answer)
        return answer

    def _read(self) -> None:
        try:
            self._answer.append(int(self._inner.num_nodes_waiting()))
        except BaseException as exc:  # handed to num_nodes_waiting
            self._answer.append(exc)

    def _outage(self, now: float, why: str) -> None:
        if self._outage_since is None:
            self._outage_since = now
            log.warning(
                "[%s] STORE UNREACHABLE: the rendezvous store does not answer (%s); the ranks "
                "go on, and so does this agent's watch over them; retrying",
                self._node,
                why,
            )
            self.on_event("store_unreachable", why=why)

    def _check_members(self) -> None:
        """Log the members of this round whose keep-alive is late, or that were dropped."""
        members = rendezvous_members(self._inner)
        if members is None or not self._round_members:
            return
        bound = keep_alive_bound_s(self._inner)
        for node in sorted(self._round_members - members.participants - set(self.lost)):
            # A node that leaves to re-join (a restart) had a fresh keep-alive and still sends
            # heartbeats; one elastic dropped was seen stalled first (the stall share of the
            # bound is below it), or was found dead by this read (a failure detector marked
            # its keep-alive expired), or another node's read dropped it first: then this
            # node's detector no longer hears it either.
            gone = None if node == members.me else self.why_gone(node)
            known = node in self._stalled or node in members.dead or gone is not None
            if not known and node != members.me:
                continue
            self.lost.append(node)
            declared = node not in self._stalled and (node in members.dead or gone is not None)
            if node == members.me:
                log.error(
                    "[%s] DROPPED: this node was dropped from the job (the other nodes' "
                    "failure detectors declared it lost, or its rendezvous keep-alive did not "
                    "reach the store for %.0f s); it re-joins (a spare may have its place)",
                    self._node,
                    bound,
                )
                self.on_event("dropped", peer=node, bound_s=bound, declared=declared)
                continue
            log.error(
                "[%s] MACHINE LOST: %s %s and was dropped from the job%s",
                self._node,
                node,
                "was declared lost by the failure detectors"
                if declared
                else f"sent no rendezvous keep-alive for {bound:.0f} s",
                f" (here: {gone})" if gone else "",
            )
            self.on_event(
                "machine_lost", peer=node, bound_s=bound, declared=declared, why=gone or ""
            )
        for node in sorted(self._round_members & members.participants - {members.me}):
            age = members.heartbeat_age_s.get(node)
            late = age is not None and age > STALL_SHARE * bound
            if late and node not in self._stalled:
                self._stalled.add(node)
                log.warning(
                    "[%s] STALL: no rendezvous keep-alive from %s for %.1f s (dropped after "
                    "%.0f s)",
                    self._node,
                    node,
                    age,
                    bound,
                )
                self.on_event("stall", peer=node, age_s=round(age or 0.0, 3))
            elif not late and node in self._stalled:
                self._stalled.discard(node)
                log.info("[%s] %s sends its keep-alive again", self._node, node)
