"""ProtectionService: the SMP's erasure-coding thread (peer mesh, protection rounds, rebuild).

The SMP's main loop serves ranks; this thread owns the peer transport (ZeroMQ TCP + CURVE) and
the :class:`~ftmem.exchange.protector.GroupProtector`. pyeclib holds the GIL for about 0.1 ms
per MiB, so with 1 MiB stripes the main loop is never held up for long.

Life of a generation (the launcher drives it, once per rendezvous round):

1. **bind** (keys, host): a new transport with the round's key pair; the endpoint goes back to
   the launcher, which publishes it in the rendezvous store.
2. **start** (epoch, this node, every node's endpoint, m, group cap, this node's ranks):
   connect to the group and *sync*: every node tells the group which steps it holds (own data
   plus owed parity). The newest step held by at least ``n - m`` nodes is the group's protected
   step; nodes that do not hold it (a replacement, a restarted SMP) rebuild their data and
   parity from the others before the launcher starts their ranks; every node keeps only that
   step. No such step while some node holds data: more than m nodes were lost (unrecoverable).
3. **rounds**: each node tells the group's coordinator (its first node) which steps all its
   ranks have committed (``avail``); once the coordinator has every node's list, it orders the
   newest common step newer than the protected one (``protect``). Each node pins that step's
   slots (so ranks cannot overwrite them) and runs the protector. When the step is protected,
   the previous protected step is forgotten and its slots unpinned. A node whose slots of the
   step are already gone sends ABORT and everyone gives that step up; ranks never wait for any
   of this (a rank whose slots are all held skips its snapshot).

Commands come from the main loop through :meth:`submit`; results go back through
:meth:`results` (the main loop sends the deferred replies).
"""

from __future__ import annotations

import json
import mmap
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftmem import faults, shm
from ftmem._logging import get_logger
from ftmem.errors import FtmemError, ProtocolError, UnrecoverableError
from ftmem.events import EventLog
from ftmem.exchange import messages as pm
from ftmem.exchange.keys import CurveKeyPair
from ftmem.exchange.messages import Envelope
from ftmem.exchange.placement import GroupPlan, group_of, plan_groups
from ftmem.exchange.protector import ExchangeInterrupted, GroupProtector, StepAborted
from ftmem.exchange.segments import SegmentedBytes
from ftmem.exchange.status import ExchangeState
from ftmem.exchange.transport import PeerMessage
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.smp.slot_store import SlotStore
from ftmem.smp.store import RankPiece

log = get_logger(__name__)

HEARTBEAT_S = 2.0
"""Nodes greet their peers this often when idle (peer health in ``ftmem status``)."""


@dataclass(slots=True)
class PinnedStep:
    """A node's snapshot of one step: its ranks' pinned slots, mapped read-only."""

    step: int
    pieces: list[RankPiece]
    maps: list[mmap.mmap] = field(default_factory=list)

    def manifest(self) -> bytes:
        """What the node's bytes are, for a rebuilt node (JSON: ranks in order)."""
        return json.dumps(
            {
                "step": self.step,
                "ranks": [
                    {"rank": p.rank, "nbytes": p.used, "capacity": p.capacity, "layout": p.layout}
                    for p in self.pieces
                ],
            }
        ).encode()

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


@dataclass(frozen=True, slots=True)
class BindCommand:
    """Start a new transport with ``keys`` on ``host`` (replaces the previous one)."""

    token: Any
    keys: CurveKeyPair
    host: str
    me: int
    """This node's index in the job (peers know it by this name)."""
    port: int = 0


@dataclass(frozen=True, slots=True)
class StartCommand:
    """Join generation ``epoch``: peers, erasure code, this node's ranks; then sync."""

    token: Any
    epoch: int
    me: int
    endpoints: dict[int, str]
    m: int
    max_group: int
    ranks: list[int]
    protect_interval_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of a command, for the main loop to reply with."""

    token: Any
    ok: bool
    data: dict[str, Any]
    error: str = ""


class ProtectionService:
    """The exchange thread (see the module docstring).

    Resource handling: :meth:`close` stops the thread (bounded), closes the transport and
    unmaps every pinned step. Error handling: a failed protection round is logged and given
    up (the previous protected step stays); a failed sync is reported in the start result.
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
        self.events = events
        """The SMP's event log for ``sync``, ``protected``, ``rebuilt``... (None: no events)."""
        self.local = local
        self.stripe_bytes = stripe_bytes
        self.timeout_s = timeout_s
        self.sync_timeout_s = sync_timeout_s
        self._cmds: queue.Queue[BindCommand | StartCommand | None] = queue.Queue()
        self._results: queue.Queue[Result] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ftmem-smp-exchange", daemon=True)
        self._status_lock = threading.Lock()
        self._state = ExchangeState.UNBOUND
        self._status: dict[str, Any] = {"enabled": True, "state": self._state.value}
        # Owned by the thread:
        self.transport: ZmqPeerTransport | None = None
        self.protector: GroupProtector | None = None
        self.plan: GroupPlan | None = None
        self.me = -1
        self.epoch = -1
        self.ranks: list[int] = []
        self.endpoints: dict[int, str] = {}
        self.pinned: dict[int, PinnedStep] = {}
        self.protected: int | None = None
        self.protect_interval_s = 0.0
        self._pending_start: StartCommand | None = None
        self._early: list[Envelope] = []
        self._states: dict[int, list[int]] = {}
        self._sync_deadline = 0.0
        self._synced = False
        self._avail: dict[int, list[int]] = {}
        self._sent_avail: list[int] | None = None
        self._last_round = 0.0
        self._last_seen: dict[int, float] = {}
        self._last_hb = 0.0
        self._order: int | None = None
        self._dropped = 0
        self.counters = {"protected": 0, "aborted": 0, "failed": 0, "rebuilt": 0}
        self.last_protect_s = 0.0
        self.last_rebuild_s = 0.0
        self._stop = threading.Event()

    # -- main-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(self, cmd: BindCommand | StartCommand) -> None:
        """Queue a command; its :class:`Result` comes from :meth:`results`."""
        self._cmds.put(cmd)

    def results(self) -> list[Result]:
        """Results ready now (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def status(self) -> dict[str, Any]:
        """A JSON-ready copy of the exchange's state for ``ftmem status``."""
        with self._status_lock:
            copy: dict[str, Any] = json.loads(json.dumps(self._status))
            return copy

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
        except Exception:
            log.exception("[%s/exchange] stopped by an unexpected error", self.node_name)
            self._set_state(ExchangeState.FAILED)
        finally:
            for step in list(self.pinned):
                if self.protector is not None:
                    self.protector.forget(step)  # drop its views before unmapping
                self._release(step)
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
        if self.protector is not None and self.protector.transport is self.transport:
            idle = self.protector.flush()
        msg = self.transport.recv(0.05 if idle else 0.002)
        if msg is not None:
            self._route(msg)
        if self._pending_start is not None:
            self._check_sync()
        elif self._synced:
            self._heartbeat()
            self._offer()
            self._coordinate()
            if self._order is not None:
                step, self._order = self._order, None
                self._protect(step)
        self._publish()

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
                "[%s/exchange] dropped a message from %r: %s", self.node_name, msg.sender, exc
            )
            return
        self._last_seen[env.sender] = time.monotonic()
        if self.protector is None or env.epoch > self.protector.epoch:
            self._keep_early(env)
            return
        self.protector.handle(env)

    def _keep_early(self, env: Envelope) -> None:
        """A message of a generation this node has not started yet: replay it after start."""
        if len(self._early) < 10000:
            self._early.append(env)

    # -- commands ----------------------------------------------------------------------------
    def _bind(self, cmd: BindCommand) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._synced = False
        self._early.clear()
        try:
            t = ZmqPeerTransport(str(cmd.me), cmd.keys, host=cmd.host, port=cmd.port)
            endpoint = t.start()
        except Exception as exc:  # zmq.ZMQError, OSError: a bad host or a port in use
            self._results.put(Result(cmd.token, False, {}, f"cannot bind the peer port: {exc}"))
            return
        self.transport = t
        self._set_state(ExchangeState.BOUND, endpoint=endpoint)
        log.info("[%s/exchange] peer port %s (CURVE)", self.node_name, endpoint)
        self._results.put(Result(cmd.token, True, {"endpoint": endpoint}))

    def _start(self, cmd: StartCommand) -> None:
        if self.transport is None:
            self._results.put(Result(cmd.token, False, {}, "start before bind"))
            return
        if self.transport.node != str(cmd.me):
            self._results.put(Result(cmd.token, False, {}, "start as another node than bound"))
            return
        nodes = sorted(cmd.endpoints)
        try:
            if nodes != list(range(len(nodes))):
                raise ValueError(f"node indices must be 0..N-1, got {nodes}")
            plan = group_of(plan_groups(len(nodes), cmd.m, cmd.max_group), cmd.me)
        except (ValueError, KeyError, UnrecoverableError) as exc:
            self._results.put(Result(cmd.token, False, {}, f"no erasure-coding group: {exc}"))
            return
        self.me, self.epoch, self.ranks = cmd.me, cmd.epoch, list(cmd.ranks)
        self.protect_interval_s = cmd.protect_interval_s
        if self.protector is not None and self.protector.plan != plan:
            log.warning("[%s/exchange] the group changed: dropping held steps", self.node_name)
            for step in list(self.pinned):
                self._release(step)
            self.protector = None
            self.protected = None
        if self.protector is None:
            self.protector = GroupProtector(
                cmd.me,
                plan,
                self.transport,
                self.stripe_bytes,
                timeout_s=self.timeout_s,
                epoch=cmd.epoch,
                on_other=self._on_service,
                interrupted=self._interrupted,
                on_progress=self._rebuild_progress,
            )
        else:
            self.protector.reconfigure(self.transport, cmd.epoch)
        for step in list(self.pinned):
            if step not in self.protector.steps:
                self._release(step)
        self.plan = plan
        self.endpoints = {n: cmd.endpoints[n] for n in plan.nodes}
        self.transport.connect({str(n): ep for n, ep in self.endpoints.items()})
        self._pending_start = cmd
        self._synced = False
        self._avail.clear()
        self._sent_avail = None
        self._order = None
        held = self.protector.held_steps()
        self._states = {self.me: held}
        self._sync_deadline = time.monotonic() + self.sync_timeout_s
        self._set_state(
            ExchangeState.SYNCING, epoch=cmd.epoch, me=cmd.me, group=list(plan.nodes), m=plan.m
        )
        for n in self._peers():
            self._send(n, pm.HeldSteps(tuple(held)))
        early, self._early = self._early, []
        for env in early:
            self.protector.handle(env)

    def _peers(self) -> list[int]:
        assert self.plan is not None
        return [n for n in self.plan.nodes if n != self.me]

    def _send(self, node: int, body: pm.PeerBody) -> None:
        assert self.protector is not None
        self.protector.send(node, body)

    def _on_service(self, env: Envelope) -> None:
        """The service's own messages (the protector hands them over, validated)."""
        if env.epoch > self.epoch:
            self._keep_early(env)
            return
        if self.plan is not None and env.sender not in self.plan.nodes:
            self._dropped += 1
            log.warning(
                "[%s/exchange] dropped %r from node %d: not a node of this group",
                self.node_name,
                env.kind.value,
                env.sender,
            )
            return
        match env.body:
            case pm.HeldSteps(held=held):
                self._states[env.sender] = list(held[:64])
            case pm.Avail(steps=steps):
                self._avail[env.sender] = list(steps[:16])
            case pm.ProtectOrder(step=step):
                if self._synced:
                    self._order = step
            case pm.Heartbeat():
                pass
            case _:  # a protocol kind: the protector handles those itself
                self._dropped += 1
                log.warning(
                    "[%s/exchange] dropped an unexpected %r", self.node_name, env.kind.value
                )

    # -- sync and rebuild ---------------------------------------------------------------------
    def _check_sync(self) -> None:
        cmd = self._pending_start
        assert cmd is not None and self.plan is not None and self.protector is not None
        if set(self._states) < set(self.plan.nodes):
            if time.monotonic() > self._sync_deadline:
                missing = sorted(set(self.plan.nodes) - set(self._states))
                self._pending_start = None
                self._set_state(ExchangeState.SYNC_FAILED)
                self._event("sync", generation=self.epoch, ok=False, missing=missing)
                self._results.put(
                    Result(
                        cmd.token,
                        False,
                        {},
                        f"nodes {missing} did not answer the sync in {self.sync_timeout_s:.0f} s",
                    )
                )
            return
        self._pending_start = None
        verdict = decide(self.plan, self._states)
        self._event(
            "sync",
            generation=self.epoch,
            ok=not verdict.error,
            step=verdict.step,
            holders=sorted(verdict.holders),
            lost=sorted(verdict.lost),
            error=verdict.error,
        )
        data: dict[str, Any] = {
            "step": verdict.step,
            "lost": sorted(verdict.lost),
            "rebuilt": False,
        }
        keep = verdict.step
        for step in self.protector.held_steps():
            if step != keep:
                self.protector.forget(step)
                self._release(step)
        self.protected = keep
        if verdict.error:
            self._set_state(ExchangeState.UNRECOVERABLE, error=verdict.error)
            self._results.put(Result(cmd.token, False, data, verdict.error))
            return
        if keep is not None and self.me in verdict.lost:
            try:
                self._rebuild(keep, verdict.lost, min(verdict.holders))
            except (FtmemError, TimeoutError, OSError, ValueError) as exc:
                self.protected = None
                msg = f"rebuild of step {keep} failed: {exc}"
                log.error("[%s/exchange] %s", self.node_name, msg)
                self._event("rebuild_failed", step=keep, error=str(exc))
                self._set_state(ExchangeState.REBUILD_FAILED, error=msg)
                self._results.put(Result(cmd.token, False, data, msg))
                return
            data["rebuilt"] = True
        self._synced = True
        self._set_state(ExchangeState.READY, error="")
        log.info(
            "[%s/exchange] generation %d: protected step %s (lost nodes %s)",
            self.node_name,
            self.epoch,
            keep,
            sorted(verdict.lost),
        )
        self._results.put(Result(cmd.token, True, data))

    def _rebuild_progress(self, step: int, done: int, total: int) -> None:
        pct = 100.0 * done / total if total else 100.0
        self._set_status(rebuild_progress={"step": step, "fragments": done, "of": total})
        log.info(
            "[%s/exchange] rebuilding step %d: %.0f%% (%d/%d fragments)",
            self.node_name,
            step,
            pct,
            done,
            total,
        )

    def _rebuild(self, step: int, lost: frozenset[int], source: int) -> None:
        assert self.protector is not None
        t0 = time.monotonic()
        self._set_state(ExchangeState.REBUILDING, rebuilding=step)
        log.info(
            "[%s/exchange] rebuilding step %d from node %d's group (lost %s)",
            self.node_name,
            step,
            source,
            sorted(lost),
        )
        data = self.protector.rebuild(step, lost, source)
        try:
            manifest = json.loads(self.protector.manifest(step, self.me) or b"null")
            if not isinstance(manifest, dict) or manifest.get("step") != step:
                raise ValueError("the rebuilt node's manifest is missing or for another step")
            pieces = self.local.install_rebuilt(step, manifest, data)
        except BaseException:
            self.protector.forget(step)
            raise
        # Serve the rebuilt data from the slot files from now on, not from the heap copy.
        pinned = PinnedStep(step, pieces)
        self.protector.steps[step].data = pinned.open()
        self.pinned[step] = pinned
        self.counters["rebuilt"] += 1
        self.last_rebuild_s = time.monotonic() - t0
        self._event(
            "rebuilt",
            step=step,
            seconds=round(self.last_rebuild_s, 3),
            bytes=data.nbytes,
            parity_bytes=self.protector.parity_bytes(step),
        )
        log.info(
            "[%s/exchange] rebuilt step %d: %.1f MiB own data and %.1f MiB parity in %.2f s",
            self.node_name,
            step,
            data.nbytes / 2**20,
            self.protector.parity_bytes(step) / 2**20,
            self.last_rebuild_s,
        )

    # -- protection rounds ------------------------------------------------------------------
    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_hb >= HEARTBEAT_S:
            self._last_hb = now
            for n in self._peers():
                self._send(n, pm.Heartbeat())

    def _offer(self) -> None:
        assert self.plan is not None
        newer = [
            s
            for s in self.local.complete_steps(self.ranks)
            if self.protected is None or s > self.protected
        ][:8]
        if newer == self._sent_avail or not newer:
            return
        self._sent_avail = newer
        coordinator = self.plan.nodes[0]
        if coordinator == self.me:
            self._avail[self.me] = newer
        else:
            self._send(coordinator, pm.Avail(tuple(newer)))

    def _coordinate(self) -> None:
        assert self.plan is not None
        if self.plan.nodes[0] != self.me or set(self._avail) < set(self.plan.nodes):
            return
        if time.monotonic() - self._last_round < self.protect_interval_s:
            return
        common = set.intersection(*(set(v) for v in self._avail.values()))
        common = {s for s in common if self.protected is None or s > self.protected}
        if not common:
            return
        step = max(common)
        self._avail.clear()
        self._last_round = time.monotonic()
        for n in self._peers():
            self._send(n, pm.ProtectOrder(step))
        self._order = step

    def _protect(self, step: int) -> None:
        assert self.protector is not None
        self._sent_avail = None  # offer again after this round, whatever happens
        if self.protected is not None and step <= self.protected:
            return
        pieces = self.local.pin_step(self.ranks, step)
        if pieces is None:
            log.info(
                "[%s/exchange] step %d is no longer held here: giving it up", self.node_name, step
            )
            self.protector.abort(step)
            self.counters["aborted"] += 1
            self._event("protect_aborted", step=step, reason="no longer held here")
            return
        pinned = PinnedStep(step, pieces)
        t0 = time.monotonic()
        self._set_status(protecting=step)
        faults.maybe_inject(faults.Point.IN_PROTECT, self.me, step)
        try:
            data = pinned.open()
            self.protector.protect(step, data, pinned.manifest())
        except StepAborted as exc:
            self.counters["aborted"] += 1
            log.info("[%s/exchange] %s", self.node_name, exc)
            self._event("protect_aborted", step=step, reason=str(exc))
            self._drop(step, pinned)
            return
        except (FtmemError, TimeoutError, OSError, ValueError) as exc:
            if not isinstance(exc, ExchangeInterrupted):
                self.counters["failed"] += 1
                log.warning(
                    "[%s/exchange] protecting step %d failed: %s", self.node_name, step, exc
                )
                self._event("protect_failed", step=step, error=str(exc))
                self.protector.abort(step)
            self._drop(step, pinned)
            return
        finally:
            self._set_status(protecting=None)
        self.pinned[step] = pinned
        old, self.protected = self.protected, step
        if old is not None:
            self.protector.forget(old)
            self._release(old)
        self.counters["protected"] += 1
        self.last_protect_s = time.monotonic() - t0
        self._event("protected", step=step, seconds=round(self.last_protect_s, 3))
        if faults.maybe_inject(faults.Point.PARITY_HELD, self.me, step):
            self._flip_parity(step)
        log.debug(
            "[%s/exchange] step %d protected in %.3f s", self.node_name, step, self.last_protect_s
        )

    def _flip_parity(self, step: int) -> None:
        """(Fault injection) flip one byte of the first parity fragment held for ``step``."""
        assert self.protector is not None
        parity = self.protector.steps[step].parity
        if not parity:
            return
        key = min(parity)
        frag = bytearray(parity[key])
        frag[len(frag) // 2] ^= 0xFF
        parity[key] = bytes(frag)
        log.warning(
            "[%s/exchange] FAULT: flipped a byte of parity %s of step %d", self.node_name, key, step
        )

    def _drop(self, step: int, pinned: PinnedStep) -> None:
        assert self.protector is not None
        self.protector.forget(step)
        pinned.close()
        self.local.unpin(pinned.pieces)

    def _release(self, step: int) -> None:
        pinned = self.pinned.pop(step, None)
        if pinned is not None:
            pinned.close()
            self.local.unpin(pinned.pieces)

    # -- status ------------------------------------------------------------------------------
    def _event(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.write(event, **fields)

    def _set_state(self, new: ExchangeState, **kw: Any) -> None:
        """Move to ``new`` (IllegalTransition if ExchangeState does not allow it) and publish it
        in the status (as its ``.value``) with ``kw``."""
        self._state = self._state.to(new)
        self._set_status(state=new.value, **kw)

    def _set_status(self, **kw: Any) -> None:
        with self._status_lock:
            self._status.update(kw)

    def _publish(self) -> None:
        now = time.monotonic()
        p = self.protector
        own = 0
        if p is not None and self.protected is not None and self.protected in p.steps:
            st = p.steps[self.protected]
            own = st.data.nbytes if st.data is not None else 0
        peers = {
            str(n): {
                "endpoint": ep,
                "last_seen_s": round(now - self._last_seen[n], 1) if n in self._last_seen else None,
            }
            for n, ep in self.endpoints.items()
            if n != self.me
        }
        self._set_status(
            protected_step=self.protected,
            own_bytes=own,
            parity_bytes=p.parity_bytes(self.protected)
            if p is not None and self.protected is not None
            else 0,
            peers=peers,
            counters=dict(self.counters),
            last_protect_s=round(self.last_protect_s, 3),
            last_rebuild_s=round(self.last_rebuild_s, 3),
            dropped_messages=(p.dropped if p is not None else 0)
            + (self.transport.dropped if self.transport else 0)
            + self._dropped,
            sent_bytes=p.sent_bytes if p is not None else 0,
        )


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
