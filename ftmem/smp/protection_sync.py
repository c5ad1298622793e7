"""The sync that starts each generation: which step the group keeps, and who rebuilds it.

Every node tells the group which steps it holds (own data plus owed parity); once every list
is in, each node runs :func:`decide` on the same inputs, so all agree: the newest step held by
at least ``n - m`` nodes is kept, the nodes that lack it rebuild it, every node keeps only
that step. Until then a node holds its peers' META and FETCH requests; then it serves the kept
step to the nodes that rebuild it and refuses everyone else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ftmem._logging import get_logger
from ftmem.errors import ErrorKind
from ftmem.exchange.placement import GroupPlan
from ftmem.protocol.status import ProtectionState, SyncReply
from ftmem.smp.protection_rebuild import REBUILD_ERRORS, rebuild_failed, rebuild_step
from ftmem.smp.protection_state import Generation, PinnedSteps, Result, StartCommand, StatusBoard

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class SyncVerdict:
    """What the group's sync decided: the step kept, who holds it, who must rebuild it."""

    step: int | None
    holders: frozenset[int]
    lost: frozenset[int]
    error: str = ""


def decide(plan: GroupPlan, held: dict[int, list[int]]) -> SyncVerdict:
    """The newest step held by at least ``n - m`` nodes, and who must rebuild it.

    Every node runs this on the same inputs (every node's held steps), so all agree.
    """
    n, m = len(plan.nodes), plan.m
    steps = {s for v in held.values() for s in v}
    holders = {s: frozenset(node for node, v in held.items() if s in v) for s in steps}
    ok = [s for s in steps if len(holders[s]) >= n - m]
    if not ok:
        if not steps:
            return SyncVerdict(None, frozenset(), frozenset())
        newest = max(steps)
        lost = frozenset(plan.nodes) - holders[newest]
        return SyncVerdict(
            None,
            frozenset(),
            lost,
            error=(
                f"cannot rebuild from memory: step {newest} is held by nodes "
                f"{sorted(holders[newest])} only; {len(lost)} nodes {sorted(lost)} of the group "
                f"{list(plan.nodes)} lost their snapshots, more than m={m}"
            ),
        )
    step = max(ok)
    return SyncVerdict(step, holders[step], frozenset(plan.nodes) - holders[step])


class GenerationSync:
    """One generation's sync, from :meth:`begin` until :meth:`poll` returns its result. It
    changes only the steps pinned here (``pins``) and reports on ``board``.

    Error handling: a node that does not answer within ``timeout_s`` fails the sync
    (SYNC_FAILED); more than m lost nodes fail it as UNRECOVERABLE; a failed rebuild fails it
    as REBUILD_FAILED. Each is the start command's failed :class:`Result`; none raises.
    """

    def __init__(self, pins: PinnedSteps, board: StatusBoard, timeout_s: float) -> None:
        self.pins = pins
        self.board = board
        self.timeout_s = timeout_s
        self.pending: StartCommand | None = None
        """The start command whose sync is under way (None: none)."""
        self.gen: Generation | None = None
        """The generation being synced (or last synced)."""
        self.synced = False
        """The generation is in sync: protection rounds may run."""
        self._states: dict[int, list[int]] = {}
        self._deadline = 0.0

    def begin(self, cmd: StartCommand, gen: Generation, held: list[int]) -> None:
        """Start the sync of ``cmd``'s generation ``gen``; this node holds ``held``."""
        self.pending, self.gen = cmd, gen
        self.synced = False
        self._states = {gen.me: held}
        self._deadline = time.monotonic() + self.timeout_s
        gen.protector.rebuilder.hold()

    def on_held(self, sender: int, held: list[int]) -> None:
        """Node ``sender``'s held steps."""
        self._states[sender] = held

    def poll(self) -> Result | None:
        """The start command's result once every node answered (or the deadline passed)."""
        cmd, gen = self.pending, self.gen
        assert cmd is not None and gen is not None
        if set(self._states) < set(gen.plan.nodes):
            if time.monotonic() <= self._deadline:
                return None
            missing = sorted(set(gen.plan.nodes) - set(self._states))
            self.pending = None
            gen.protector.rebuilder.serve_only(None, frozenset())
            self.board.move(ProtectionState.SYNC_FAILED)
            self.board.event("sync", epoch=gen.epoch, ok=False, missing=missing)
            why = f"nodes {missing} did not answer the sync in {self.timeout_s:.0f} s"
            return Result(cmd.token, False, {}, why)
        self.pending = None
        return self._finish(cmd, gen, decide(gen.plan, self._states))

    def _finish(self, cmd: StartCommand, gen: Generation, verdict: SyncVerdict) -> Result:
        protector, board = gen.protector, self.board
        # Snapshot bytes go to the nodes that rebuild the kept step, and to no one else.
        protector.rebuilder.serve_only(None if verdict.error else verdict.step, verdict.lost)
        board.event(
            "sync",
            epoch=gen.epoch,
            ok=not verdict.error,
            step=verdict.step,
            holders=sorted(verdict.holders),
            lost=sorted(verdict.lost),
            error=verdict.error,
        )
        reply = SyncReply(verdict.step, tuple(sorted(verdict.lost)))
        keep = verdict.step
        for step in protector.held_steps():
            if step != keep:
                protector.forget(step)
                self.pins.release(step)
        self.pins.protected = keep
        if verdict.error:
            board.move(ProtectionState.UNRECOVERABLE, error=verdict.error)
            return Result(cmd.token, False, reply.to_json(), verdict.error, ErrorKind.UNRECOVERABLE)
        if keep is not None and gen.me in verdict.lost:
            try:
                rebuild_step(gen, self.pins, board, keep, verdict.lost, min(verdict.holders))
            except REBUILD_ERRORS as exc:
                why = rebuild_failed(self.pins, board, keep, exc)
                return Result(cmd.token, False, reply.to_json(), why)
            reply = SyncReply(keep, reply.lost, rebuilt=True)
        self.synced = True
        board.move(ProtectionState.READY, error="")
        log.info(
            "[%s/protection] mesh epoch %d: protected step %s (lost nodes %s)",
            board.node_name,
            gen.epoch,
            keep,
            sorted(verdict.lost),
        )
        return Result(cmd.token, True, reply.to_json())
