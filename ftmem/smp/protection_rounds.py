"""Protection rounds: the group agrees on a step, and every node protects it with the others.

Each node tells the group's coordinator (its first node) which steps all its ranks have
committed (``avail``); once the coordinator has every node's list, it orders the newest common
step newer than the protected one (``protect``). Each node pins that step's slots (so ranks
cannot overwrite them) and runs the protector. When the step is protected, the previous
protected step is forgotten and its slots unpinned. A node whose slots of the step are already
gone sends ABORT and everyone gives that step up; ranks never wait for any of this (a rank
whose slots are all held skips its snapshot). Idle nodes greet their peers every
:data:`HEARTBEAT_S` (peer health in ``ftmem status``).
"""

from __future__ import annotations

import time

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.exchange.protector import ExchangeInterrupted, StepAborted
from ftmem.protocol import peer as pm
from ftmem.smp.protection_state import PinnedStep, ProtectionContext

log = get_logger(__name__)

HEARTBEAT_S = 2.0
"""Nodes greet their peers this often when idle (peer health in ``ftmem status``)."""


class ProtectionRounds:
    """The rounds of one node, in sync (see the module docstring); the protection thread calls
    :meth:`tick` on every turn of its loop.

    Error handling: a failed round is logged, counted and given up (the previous protected
    step stays); nothing raises.
    """

    def __init__(self, ctx: ProtectionContext) -> None:
        self.ctx = ctx
        self.interval_s = 0.0
        """Least seconds between two rounds (the coordinator waits)."""
        self._avail: dict[int, list[int]] = {}
        self._sent_avail: list[int] | None = None
        self._last_round = 0.0
        self._last_hb = 0.0
        self._order: int | None = None

    def reset(self, interval_s: float) -> None:
        """A new generation: forget offers and orders of the last one."""
        self.interval_s = interval_s
        self._avail.clear()
        self._sent_avail = None
        self._order = None

    def on_avail(self, sender: int, steps: list[int]) -> None:
        """(Coordinator) node ``sender`` has ``steps`` committed."""
        self._avail[sender] = steps

    def on_order(self, step: int) -> None:
        """The coordinator orders a round of ``step``."""
        self._order = step

    def tick(self) -> None:
        """Greet peers, offer new steps, coordinate, and run an ordered round."""
        self._heartbeat()
        self._offer()
        self._coordinate()
        if self._order is not None:
            step, self._order = self._order, None
            self.protect(step)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= HEARTBEAT_S:
            self._last_hb = now
            for n in self.ctx.peers():
                self.ctx.send(n, pm.Heartbeat())

    def _offer(self) -> None:
        ctx = self.ctx
        assert ctx.plan is not None
        newer = [
            s
            for s in ctx.local.complete_steps(ctx.ranks)
            if ctx.protected is None or s > ctx.protected
        ][:8]
        if newer == self._sent_avail or not newer:
            return
        self._sent_avail = newer
        coordinator = ctx.plan.nodes[0]
        if coordinator == ctx.me:
            self._avail[ctx.me] = newer
        else:
            ctx.send(coordinator, pm.Avail(tuple(newer)))

    def _coordinate(self) -> None:
        ctx = self.ctx
        assert ctx.plan is not None
        if ctx.plan.nodes[0] != ctx.me or set(self._avail) < set(ctx.plan.nodes):
            return
        if time.monotonic() - self._last_round < self.interval_s:
            return
        common = set.intersection(*(set(v) for v in self._avail.values()))
        common = {s for s in common if ctx.protected is None or s > ctx.protected}
        if not common:
            return
        step = max(common)
        self._avail.clear()
        self._last_round = time.monotonic()
        for n in ctx.peers():
            ctx.send(n, pm.ProtectOrder(step))
        self._order = step

    def protect(self, step: int) -> None:
        """Run a round of ``step``: pin its slots, protect them with the group, keep it."""
        ctx = self.ctx
        assert ctx.protector is not None
        self._sent_avail = None  # offer again after this round, whatever happens
        if ctx.protected is not None and step <= ctx.protected:
            return
        pieces = ctx.local.pin_step(ctx.ranks, step)
        if pieces is None:
            log.info(
                "[%s/protection] step %d is no longer held here: giving it up", ctx.node_name, step
            )
            ctx.protector.abort(step)
            ctx.counters["aborted"] += 1
            ctx.event("protect_aborted", step=step, reason="no longer held here")
            return
        pinned = PinnedStep(step, pieces)
        t0 = time.monotonic()
        if self._exchange(step, pinned):
            self._keep(step, pinned, t0)

    def _exchange(self, step: int, pinned: PinnedStep) -> bool:
        """Protect the pinned step with the group; False (and the step dropped) if not."""
        ctx = self.ctx
        assert ctx.protector is not None
        ctx.board.update(protecting=step)
        try:
            faults.maybe_inject(faults.Point.IN_PROTECT, ctx.me, step)
            data = pinned.open()
            ctx.protector.protect(step, data, pinned.manifest())
        except StepAborted as exc:
            ctx.counters["aborted"] += 1
            log.info("[%s/protection] %s", ctx.node_name, exc)
            ctx.event("protect_aborted", step=step, reason=str(exc))
            self._give_up(step, pinned)
            return False
        except (FtmemError, TimeoutError, OSError, ValueError) as exc:
            if not isinstance(exc, ExchangeInterrupted):
                ctx.counters["failed"] += 1
                log.warning(
                    "[%s/protection] protecting step %d failed: %s", ctx.node_name, step, exc
                )
                ctx.event("protect_failed", step=step, error=str(exc))
                if not self._held_here(step):
                    ctx.protector.abort(step)
            self._give_up(step, pinned)
            return False
        except BaseException:  # an unexpected error stops the thread: leave no pin behind
            ctx.drop(step, pinned)
            raise
        finally:
            ctx.board.update(protecting=None)
        return True

    def _held_here(self, step: int) -> bool:
        """This node told the group HELD for ``step``: it holds its data and owed parity."""
        assert self.ctx.protector is not None
        return step in self.ctx.protector.held_steps()

    def _give_up(self, step: int, pinned: PinnedStep) -> None:
        """A round that did not complete here. A step this node told the group HELD stays
        pinned as a candidate: another node may have completed the round and released its
        older step, and the next generation's sync keeps the newest step that enough nodes
        hold (it releases the others; so does the next protected step). Any other is
        dropped."""
        if self._held_here(step):
            self.ctx.pinned[step] = pinned
            self.ctx.event("protect_unconfirmed", step=step)
            log.info(
                "[%s/protection] step %d: this node holds it but the round did not complete; "
                "kept for the next sync",
                self.ctx.node_name,
                step,
            )
        else:
            self.ctx.drop(step, pinned)

    def _keep(self, step: int, pinned: PinnedStep, t0: float) -> None:
        """``step`` is protected: it replaces the previous protected step (and any step kept
        from a round that did not complete)."""
        ctx = self.ctx
        assert ctx.protector is not None
        ctx.pinned[step] = pinned
        ctx.protected = step
        for old in [s for s in ctx.pinned if s != step]:
            ctx.protector.forget(old)
            ctx.release(old)
        ctx.counters["protected"] += 1
        ctx.last_protect_s = time.monotonic() - t0
        ctx.event("protected", step=step, seconds=round(ctx.last_protect_s, 3))
        if faults.maybe_inject(faults.Point.PARITY_HELD, ctx.me, step):
            self._flip_parity(step)
        log.debug(
            "[%s/protection] step %d protected in %.3f s", ctx.node_name, step, ctx.last_protect_s
        )

    def _flip_parity(self, step: int) -> None:
        """(Fault injection) flip one byte of the first parity fragment held for ``step``."""
        ctx = self.ctx
        assert ctx.protector is not None
        parity = ctx.protector.steps[step].parity
        if not parity:
            return
        key = min(parity)
        frag = bytearray(parity[key])
        frag[len(frag) // 2] ^= 0xFF
        parity[key] = bytes(frag)
        log.warning(
            "[%s/protection] FAULT: flipped a byte of parity %s of step %d",
            ctx.node_name,
            key,
            step,
        )
