"""Protection rounds: the group agrees on a step, and every node protects it with the others.

Each node tells the coordinator (the group's first node) which steps all its ranks have
committed (``avail``); the coordinator orders the newest common step newer than the protected
one (``protect``). Each node pins that step's slots and runs the protector; once protected,
the previous protected step is released. A node whose slots of the step are gone sends ABORT
and everyone gives the step up. Ranks never wait for any of this. Idle nodes greet their
peers every :data:`HEARTBEAT_S` (peer health in ``ftmem status``).
"""

from __future__ import annotations

import time

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.exchange.protector import ExchangeInterrupted, StepAborted
from ftmem.protocol import peer as pm
from ftmem.smp.protection_state import Generation, PinnedStep, PinnedSteps, StatusBoard

log = get_logger(__name__)

HEARTBEAT_S = 2.0
"""Nodes greet their peers this often when idle (peer health in ``ftmem status``)."""


class ProtectionRounds:
    """The rounds of one node, in sync (see the module docstring); the protection thread calls
    :meth:`tick` on every turn of its loop. They change only the steps pinned here (``pins``)
    and report on ``board``.

    Error handling: a failed round is logged, counted and given up (the previous protected
    step stays); nothing raises.
    """

    def __init__(self, pins: PinnedSteps, board: StatusBoard) -> None:
        self.pins = pins
        self.board = board
        self.gen: Generation | None = None
        self.interval_s = 0.0
        """Least seconds between two rounds (the coordinator waits)."""
        self._avail: dict[int, list[int]] = {}
        self._sent_avail: list[int] | None = None
        self._last_round = 0.0
        self._last_hb = 0.0
        self._order: int | None = None

    def reset(self, gen: Generation, interval_s: float) -> None:
        """A new generation: forget offers and orders of the last one."""
        self.gen = gen
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
        gen = self.gen
        assert gen is not None
        self._heartbeat(gen)
        self._offer(gen)
        self._coordinate(gen)
        if self._order is not None:
            step, self._order = self._order, None
            self.protect(gen, step)

    def _heartbeat(self, gen: Generation) -> None:
        now = time.monotonic()
        if now - self._last_hb >= HEARTBEAT_S:
            self._last_hb = now
            for n in gen.peers():
                gen.protector.send(n, pm.Heartbeat())

    def _offer(self, gen: Generation) -> None:
        protected = self.pins.protected
        newer = [
            s
            for s in self.pins.local.complete_steps(list(gen.ranks))
            if protected is None or s > protected
        ][:8]
        if newer == self._sent_avail or not newer:
            return
        self._sent_avail = newer
        coordinator = gen.plan.nodes[0]
        if coordinator == gen.me:
            self._avail[gen.me] = newer
        else:
            gen.protector.send(coordinator, pm.Avail(tuple(newer)))

    def _coordinate(self, gen: Generation) -> None:
        if gen.plan.nodes[0] != gen.me or set(self._avail) < set(gen.plan.nodes):
            return
        if time.monotonic() - self._last_round < self.interval_s:
            return
        protected = self.pins.protected
        common = set.intersection(*(set(v) for v in self._avail.values()))
        common = {s for s in common if protected is None or s > protected}
        if not common:
            return
        step = max(common)
        self._avail.clear()
        self._last_round = time.monotonic()
        for n in gen.peers():
            gen.protector.send(n, pm.ProtectOrder(step))
        self._order = step

    def protect(self, gen: Generation, step: int) -> None:
        """Run a round of ``step``: pin its slots, protect them with the group, keep it."""
        self._sent_avail = None  # offer again after this round, whatever happens
        if self.pins.protected is not None and step <= self.pins.protected:
            return
        pinned = self.pins.pin(gen.ranks, step)
        if pinned is None:
            log.info(
                "[%s/protection] step %d is no longer held here: giving it up",
                self.board.node_name,
                step,
            )
            gen.protector.abort(step)
            self.board.count("aborted")
            self.board.event("protect_aborted", step=step, reason="no longer held here")
            return
        t0 = time.monotonic()
        if self._exchange(gen, pinned):
            self._keep(gen, pinned, t0)

    def _exchange(self, gen: Generation, pinned: PinnedStep) -> bool:
        """Protect the pinned step with the group; False (and the step dropped) if not."""
        step, board, protector = pinned.step, self.board, gen.protector
        board.update(protecting=step)
        try:
            faults.maybe_inject(faults.Point.IN_PROTECT, gen.me, step)
            data = pinned.open()
            protector.protect(step, data, pinned.manifest())
        except StepAborted as exc:
            board.count("aborted")
            log.info("[%s/protection] %s", board.node_name, exc)
            board.event("protect_aborted", step=step, reason=str(exc))
            self._give_up(gen, pinned)
            return False
        except (FtmemError, TimeoutError, OSError, ValueError) as exc:
            if not isinstance(exc, ExchangeInterrupted):
                board.count("failed")
                log.warning(
                    "[%s/protection] protecting step %d failed: %s", board.node_name, step, exc
                )
                board.event("protect_failed", step=step, error=str(exc))
                if step not in protector.held_steps():
                    protector.abort(step)
            self._give_up(gen, pinned)
            return False
        except BaseException:  # an unexpected error stops the thread: leave no pin behind
            self.pins.drop(pinned, protector)
            raise
        finally:
            board.update(protecting=None)
        return True

    def _give_up(self, gen: Generation, pinned: PinnedStep) -> None:
        """A round that did not complete here. A step this node told the group HELD stays
        pinned as a candidate (another node may have completed the round and released its
        older step; the next sync keeps the newest step enough nodes hold); any other is
        dropped."""
        if pinned.step in gen.protector.held_steps():
            self.pins.keep(pinned)
            self.board.event("protect_unconfirmed", step=pinned.step)
            log.info(
                "[%s/protection] step %d: this node holds it but the round did not complete; "
                "kept for the next sync",
                self.board.node_name,
                pinned.step,
            )
        else:
            self.pins.drop(pinned, gen.protector)

    def _keep(self, gen: Generation, pinned: PinnedStep, t0: float) -> None:
        """The step is protected: it replaces the previous protected step (and any step kept
        from a round that did not complete)."""
        step = pinned.step
        self.pins.keep(pinned)
        self.pins.protected = step
        self.pins.keep_only(step, gen.protector)
        seconds = time.monotonic() - t0
        self.board.count("protected")
        self.board.update(last_protect_s=round(seconds, 3))
        self.board.event("protected", step=step, seconds=round(seconds, 3))
        if faults.maybe_inject(faults.Point.PARITY_HELD, gen.me, step):
            self._flip_parity(gen, step)
        log.debug(
            "[%s/protection] step %d protected in %.3f s", self.board.node_name, step, seconds
        )

    def _flip_parity(self, gen: Generation, step: int) -> None:
        """(Fault injection) flip one byte of the first parity fragment held for ``step``."""
        parity = gen.protector.steps[step].parity
        if not parity:
            return
        key = min(parity)
        frag = bytearray(parity[key])
        frag[len(frag) // 2] ^= 0xFF
        parity[key] = bytes(frag)
        log.warning(
            "[%s/protection] FAULT: flipped a byte of parity %s of step %d",
            self.board.node_name,
            key,
            step,
        )
