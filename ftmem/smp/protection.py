"""ProtectionService: the SMP's erasure-coding thread (peer mesh, protection rounds, rebuild).

The SMP's main loop serves ranks; this thread owns the peer transport (ZeroMQ TCP + CURVE) and
the :class:`~ftmem.exchange.protector.GroupProtector` (pyeclib holds the GIL while it encodes a
stripe, so stripes are kept small). Once per rendezvous round the launcher drives a generation:

1. **bind** (keys, host): a new transport with the round's key pair; its endpoint goes back to
   the launcher, which publishes it.
2. **start** (epoch, this node, the endpoints, m, group cap, ranks): connect to the group and
   *sync* (protection_sync.py): all keep the newest step enough nodes hold, and nodes that
   lost it rebuild it before the launcher starts their ranks.
3. **rounds** (:class:`ProtectionRounds`): each node tells the coordinator (the group's first
   node) which steps all its ranks have committed (``avail``); the coordinator orders the
   newest common step newer than the protected one (``protect``). Each node pins that step's
   slots and runs the protector; once protected, the previous protected step is released. A
   node whose slots of the step are gone sends ABORT and everyone gives the step up. Ranks
   never wait for any of this. Idle nodes greet their peers every :data:`HEARTBEAT_S`.

Commands come from the main loop through :meth:`ProtectionService.submit`; results go back
through :meth:`ProtectionService.results`.
"""

from __future__ import annotations

import queue
import threading
import time

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError, ProtocolError, UnrecoverableError
from ftmem.events import EventLog
from ftmem.exchange.encode_pool import MAX_WORKERS
from ftmem.exchange.placement import GroupPlan, group_of, plan_groups
from ftmem.exchange.protector import ExchangeInterrupted, GroupProtector, StepAborted
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.protocol import messages as m
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import Envelope, PeerMessage
from ftmem.protocol.status import PeerHealth, ProtectionState
from ftmem.smp import drain
from ftmem.smp.protection_state import (
    BindCommand,
    Generation,
    PinnedStep,
    PinnedSteps,
    Result,
    StartCommand,
    StatusBoard,
)
from ftmem.smp.protection_sync import GenerationSync, report_progress
from ftmem.smp.slot_store import SlotStore

log = get_logger(__name__)

EARLY_MAX_MESSAGES = 10000
EARLY_MAX_BYTES = 256 << 20
"""Bounds of the messages of a future generation kept for replay (count, buffer bytes)."""

PUBLISH_S = 0.1
"""The status' byte counts and peer health are refreshed this often (a new protected step at
once): the thread's loop turns up to hundreds of times a second while a round runs."""

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

    def tick(self, gen: Generation) -> None:
        """Greet peers, offer new steps, coordinate, and run an ordered round of ``gen``."""
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


class ProtectionService:
    """The protection thread (see the module docstring).

    Resource handling: :meth:`close` stops the thread (bounded), closes the transport and
    unmaps every pinned step. Error handling: a failed protection round is logged and given
    up (the previous protected step stays); a failed sync or rebuild is reported in the start
    result and the thread goes on serving; only an unexpected error stops it (FAILED).
    """

    def __init__(
        self,
        node_name: str,
        local: SlotStore,
        stripe_bytes: int = 1 << 20,
        timeout_s: float = 600.0,
        sync_timeout_s: float = 120.0,
        events: EventLog | None = None,
    ) -> None:
        self.node_name = node_name
        self.stripe_bytes = stripe_bytes
        self.timeout_s = timeout_s
        # Owned by the thread (other threads read only the board, through status()):
        self.board = StatusBoard(node_name, events)
        self.pins = PinnedSteps(local)
        self.gen: Generation | None = None
        """The generation started last (None: none yet)."""
        self.protector: GroupProtector | None = None
        self.sync = GenerationSync(self.pins, self.board, sync_timeout_s)
        self.rounds = ProtectionRounds(self.pins, self.board)
        self._cmds: queue.Queue[BindCommand | StartCommand | None] = queue.Queue()
        self._results: queue.Queue[Result] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ftmem-smp-protection", daemon=True)
        self.transport: ZmqPeerTransport | None = None
        self.encode_workers = 0
        """Encode processes of the next protector (the last PEER_BIND's)."""
        self._early: list[Envelope] = []
        self._early_bytes = 0
        self._last_seen: dict[int, float] = {}
        self._dropped = 0
        self._stop = threading.Event()
        self._failure: str | None = None
        self._next_publish = 0.0

    # -- main-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(self, cmd: BindCommand | StartCommand) -> None:
        """Queue a command; its :class:`Result` comes from :meth:`results`."""
        self._cmds.put(cmd)

    def results(self) -> list[Result]:
        """Results ready now (non-blocking).

        Once the thread has stopped (FAILED), every command still queued is answered here with
        an error naming the failure, so no request waits for a thread that is gone.
        """
        out = drain(self._results)
        if self.failed:
            why = self._failed_reply()
            out += [Result(cmd.token, False, {}, why) for cmd in drain(self._cmds) if cmd]
        return out

    @property
    def failed(self) -> bool:
        """True once the thread has stopped on an unexpected error (state FAILED); the SMP
        then replaces the service at the next PEER_BIND (:meth:`close` it first)."""
        return self._failure is not None and not self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """The unexpected error that stopped the thread (None while it serves)."""
        return self._failure

    def _failed_reply(self) -> str:
        return f"the SMP's protection thread stopped: {self._failure}"

    def protected_step(self) -> int | None:
        """The newest step the group protected (None: nothing yet)."""
        return self.board.read().protected_step

    def close(self) -> None:
        """Stop the thread and release sockets and mappings (idempotent, bounded)."""
        self._stop.set()
        self._cmds.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # -- thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._step()
        except Exception as exc:
            log.exception("[%s/protection] stopped by an unexpected error", self.node_name)
            self._failure = f"{type(exc).__name__}: {exc}"
            self.board.move(ProtectionState.FAILED, error=self._failure)
            self.board.event("protection_failed", error=self._failure)
            pending, self.sync.pending = self.sync.pending, None
            if pending is not None:  # a start waiting for its sync: answer it now
                self._results.put(Result(pending.token, False, {}, self._failed_reply()))
        finally:
            self.pins.keep_only(None, self.protector)
            if self.protector is not None:
                self.protector.close()  # its encode workers
            if self.transport is not None:
                self.transport.close()

    def _step(self) -> None:
        try:
            cmd = (
                self._cmds.get_nowait()
                if self.transport is not None
                else self._cmds.get(timeout=0.2)
            )
        except queue.Empty:
            cmd = None
        if cmd is not None:
            if isinstance(cmd, BindCommand):
                self._bind(cmd)
            else:
                self._start(cmd)
        if self.transport is None:
            return
        idle = True
        protector = self.protector
        if protector is not None and protector.transport is self.transport:
            idle = protector.flush()
        msg = self.transport.recv(0.05 if idle else 0.002)
        if msg is not None:
            self._route(msg)
        if self.sync.pending is not None:
            result = self.sync.poll()
            if result is not None:
                self._results.put(result)
        elif self.sync.synced and self.gen is not None:
            self.rounds.tick(self.gen)
        self._publish()

    def _publish(self) -> None:
        """Refresh the status: bytes held, peer health, messages dropped (by the service and
        its transport; ``forged``: those refused for a wrong tag on the data channel)."""
        assert self.transport is not None
        now, p, protected = time.monotonic(), self.protector, self.pins.protected
        if now < self._next_publish and protected == self.board.read().protected_step:
            return
        self._next_publish = now + PUBLISH_S
        pool = p.encode_pool if p is not None else None
        own = parity = 0
        if p is not None and protected is not None:
            st = p.steps.get(protected)
            own = st.data.nbytes if st is not None and st.data is not None else 0
            parity = p.parity_bytes(protected)
        gen, seen = self.gen, self._last_seen
        peers = (
            tuple(
                PeerHealth(n, ep, round(now - seen[n], 1) if n in seen else None)
                for n, ep in sorted(gen.endpoints.items())
                if n != gen.me
            )
            if gen is not None
            else ()
        )
        self.board.update(
            protected_step=protected,
            own_bytes=own,
            parity_bytes=parity,
            peers=peers,
            dropped_messages=(p.dropped if p is not None else 0)
            + self.transport.dropped
            + self._dropped,
            forged_messages=self.transport.forged,
            sent_bytes=p.sent_bytes if p is not None else 0,
            encode_workers=len(pool.pids) if pool is not None else 0,
            worker_stripes=pool.encoded if pool is not None else 0,
            worker_fallbacks=pool.fell_back if pool is not None else 0,
        )

    def _interrupted(self) -> bool:
        """A new command (a new generation) cuts short any wait of the protector."""
        return not self._cmds.empty() or self._stop.is_set()

    def _route(self, msg: PeerMessage) -> None:
        try:
            env = Envelope.parse(msg)
        except ProtocolError as exc:
            # A malformed message is dropped (and counted); it never stops the exchange.
            self._dropped += 1
            log.warning(
                "[%s/protection] dropped a message from %r: %s", self.node_name, msg.sender, exc
            )
            return
        self._last_seen[env.sender] = time.monotonic()
        protector = self.protector
        if protector is None or env.epoch > protector.epoch:
            self._keep_early(env)
            return
        protector.handle(env)

    def _keep_early(self, env: Envelope) -> None:
        """A message of a generation this node has not started yet: replay it after start.
        Kept up to EARLY_MAX_MESSAGES messages and EARLY_MAX_BYTES of buffers; beyond that it
        is dropped (counted): the peer resends what a round needs."""
        size = sum(b.nbytes for b in env.buffers)
        if len(self._early) >= EARLY_MAX_MESSAGES or self._early_bytes + size > EARLY_MAX_BYTES:
            self._dropped += 1
            return
        self._early.append(env)
        self._early_bytes += size

    def _on_service(self, env: Envelope) -> None:
        """The service's own messages (the protector hands them over, validated)."""
        gen = self.gen
        if gen is None or env.epoch > gen.epoch:
            self._keep_early(env)
            return
        if env.sender not in gen.plan.nodes:
            self._dropped += 1
            log.warning(
                "[%s/protection] dropped %r from node %d: not a node of this group",
                self.node_name,
                env.kind.value,
                env.sender,
            )
            return
        match env.body:
            case pm.HeldSteps(held=held):
                self.sync.on_held(env.sender, list(held[:64]))
            case pm.Avail(steps=steps):
                self.rounds.on_avail(env.sender, list(steps[:16]))
            case pm.ProtectOrder(step=step):
                if self.sync.synced:
                    self.rounds.on_order(step)
            case pm.Heartbeat():
                pass
            case _:  # a protocol kind: the protector handles those itself
                self._dropped += 1
                log.warning(
                    "[%s/protection] dropped an unexpected %r", self.node_name, env.kind.value
                )

    # -- commands ----------------------------------------------------------------------------
    def _bind(self, cmd: BindCommand) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.sync.synced = False
        self._early.clear()
        self._early_bytes = 0
        r = cmd.request
        try:
            t = ZmqPeerTransport(
                str(r.me), cmd.keys, host=r.host, port=r.port, encrypt_data=r.encrypt
            )
            endpoint = t.start()
        except Exception as exc:  # zmq.ZMQError, OSError: a bad host or a port in use
            self._results.put(Result(cmd.token, False, {}, f"cannot bind the peer port: {exc}"))
            return
        self.transport = t
        self.encode_workers = max(0, min(r.encode_workers, MAX_WORKERS))
        self.board.move(ProtectionState.BOUND, endpoint=endpoint)
        log.info(
            "[%s/protection] peer port %s (%s)",
            self.node_name,
            endpoint,
            "CURVE for every message" if r.encrypt else "CURVE; snapshot bytes with keyed tags",
        )
        self._results.put(Result(cmd.token, True, m.to_fields(m.PeerBound(endpoint))))

    def _start(self, cmd: StartCommand) -> None:
        if self.transport is None:
            self._results.put(Result(cmd.token, False, {}, "start before bind"))
            return
        r = cmd.request
        if self.transport.node != str(r.me):
            self._results.put(Result(cmd.token, False, {}, "start as another node than bound"))
            return
        named = sorted(cmd.endpoints)
        try:
            count = r.nodes or len(named)
            if not r.nodes and named != list(range(count)):
                raise ValueError(f"node indices must be 0..N-1, got {named}")
            plan = group_of(plan_groups(count, r.m, r.max_group), r.me)
            missing = [n for n in plan.nodes if n not in cmd.endpoints]
            if missing:
                raise ValueError(f"no endpoint for the group's nodes {missing}")
        except (ValueError, KeyError, UnrecoverableError) as exc:
            self._results.put(Result(cmd.token, False, {}, f"no erasure-coding group: {exc}"))
            return
        protector = self._protector_for(plan, r.epoch, r.me)
        for step in self.pins.steps():
            if step not in protector.steps:
                self.pins.release(step)
        endpoints = {n: cmd.endpoints[n] for n in plan.nodes}
        gen = Generation(r.me, r.epoch, tuple(r.ranks), plan, endpoints, protector)
        self.gen = gen
        try:
            self.transport.connect({str(n): ep for n, ep in endpoints.items()})
        except Exception as exc:  # zmq.ZMQError: an endpoint zmq cannot connect to
            self._results.put(Result(cmd.token, False, {}, f"cannot connect to a peer: {exc}"))
            return
        self.rounds.reset(r.protect_interval_s)
        held = protector.held_steps()
        self.sync.begin(cmd, gen, held)
        self.board.move(
            ProtectionState.SYNCING, epoch=r.epoch, me=r.me, group=tuple(plan.nodes), m=plan.m
        )
        for n in gen.peers():
            gen.protector.send(n, pm.HeldSteps(tuple(held)))
        early, self._early, self._early_bytes = self._early, [], 0
        for env in early:
            protector.handle(env)

    def _protector_for(self, plan: GroupPlan, epoch: int, me: int) -> GroupProtector:
        """The protector of the generation: the last one on the new transport and epoch, or a
        new one if the group changed (its held steps are dropped)."""
        assert self.transport is not None
        if self.protector is not None and self.protector.plan != plan:
            log.warning("[%s/protection] the group changed: dropping held steps", self.node_name)
            self.pins.keep_only(None, None)
            self.protector.close()
            self.protector = None
            self.pins.protected = None
        if self.protector is None:
            board = self.board
            self.protector = GroupProtector(
                me,
                plan,
                self.transport,
                self.stripe_bytes,
                timeout_s=self.timeout_s,
                epoch=epoch,
                on_other=self._on_service,
                interrupted=self._interrupted,
                on_progress=lambda step, done, total: report_progress(board, step, done, total),
                encode_workers=self.encode_workers,
            )
        else:
            self.protector.reconfigure(self.transport, epoch)
        return self.protector
