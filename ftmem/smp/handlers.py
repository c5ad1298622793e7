"""RequestHandlers: what the SMP does with each request, and the replies it defers.

:attr:`RequestHandlers.table` maps each request kind to its handler, which returns the reply,
or None when the reply comes later: a PREPARE once its slot files exist, a QUERY once the
rank's commits are verified, a FLUSH once the checkpoint is durable, a PEER_BIND / PEER_START
once the protection thread has done it. :meth:`RequestHandlers.poll` (the loop thread, after
each burst of requests) takes those results in and sends the deferred replies. Everything
here runs on the loop thread; slots change only through the SlotStore.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.config import SmpConfig
from ftmem.errors import ProtocolError
from ftmem.events import EventLog
from ftmem.exchange.keys import CurveKeyPair, KeyFileError
from ftmem.protocol import messages as m
from ftmem.protocol import peer as pm
from ftmem.protocol.status import SmpStatus
from ftmem.smp import drain
from ftmem.smp.allocation import Allocator, AllocJob
from ftmem.smp.flush_scheduler import FlushRequest, FlushService
from ftmem.smp.hashing import HashService
from ftmem.smp.protection import ProtectionService
from ftmem.smp.protection_state import BindCommand, StartCommand
from ftmem.smp.slot_store import SlotStore

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    """Who asked: the ROUTER identity and the request id its reply must carry."""

    ident: bytes
    req_id: int


Send = Callable[[bytes, int, m.Reply], None]
"""Sends a reply (identity, request id, reply) on the loop thread's socket."""
Handler = Callable[[Request, Any], m.Reply | None]
"""A request's handler: its reply, or None when the reply is sent later."""


class RequestHandlers:
    """The SMP's request handlers and deferred replies (see the module docstring); ``send``
    sends a reply on the loop thread's socket, ``status`` makes the SMP's STATUS.

    Resource handling: the protection service is made at the first PEER_BIND or PEER_START;
    :meth:`close` stops it. The flush service belongs to the daemon (``flush``, set when it
    starts one). Error handling: a handler raises ``ValueError``, ``ProtocolError`` or
    ``StoreError`` for a request it refuses; the daemon answers with the error.
    """

    def __init__(
        self,
        config: SmpConfig,
        store: SlotStore,
        hasher: HashService,
        allocator: Allocator,
        events: EventLog,
        send: Send,
        status: Callable[[], SmpStatus],
    ) -> None:
        self.config = config
        self.store = store
        self.hasher = hasher
        self.allocator = allocator
        self.events = events
        self._space_warned: set[tuple[int, int]] = set()
        """(rank, slot size) of the shared-memory shortfalls already logged (each once)."""
        self._send = send
        self._status = status
        self.flush: FlushService | None = None
        """The disk tiers' flush service, when the daemon has one."""
        self.protection: ProtectionService | None = None
        """The erasure-coding service, made at the first peer request."""
        self._pending_protection = 0
        self._queries: list[tuple[Request, int]] = []
        """QUERY requests waiting for that rank's hashes."""
        self._flush_replies: queue.Queue[tuple[Any, bool, dict[str, Any], str]] = queue.Queue()
        self.requests: dict[str, int] = {}
        """Requests served, per kind (STATUS shows them: a steady-state save is one COMMIT)."""
        self.table: dict[m.Kind, Handler] = {
            m.Kind.PING: self._ping,
            m.Kind.HELLO: self._hello,
            m.Kind.HEARTBEAT: self._heartbeat,
            m.Kind.BEGIN: self._begin,
            m.Kind.PREPARE: self._prepare,
            m.Kind.COMMIT: self._commit,
            m.Kind.ABORT: self._abort,
            m.Kind.SKIPPED: self._skipped,
            m.Kind.QUERY: self._query,
            m.Kind.DISCARD_NEWER: self._discard_newer,
            m.Kind.STATUS: self._status_request,
            m.Kind.FLUSH: self._flush,
            m.Kind.PEER_BIND: self._peer_bind,
            m.Kind.PEER_START: self._peer_start,
        }
        """Request kind -> handler."""

    # -- dispatch and deferred replies -------------------------------------------------------
    def handle(self, req: Request, kind: m.Kind, payload: Any) -> m.Reply | None:
        """Run the handler of ``kind``; its reply, or None if it is sent later.

        Raises:
            ProtocolError: ``kind`` is not a request this SMP serves.
        """
        handler = self.table.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected request {type(payload).__name__}")
        self.requests[kind.name] = self.requests.get(kind.name, 0) + 1
        return handler(req, payload)

    def busy(self) -> bool:
        """Results are expected soon (the loop polls faster meanwhile)."""
        return bool(
            self.allocator.pending
            or self._pending_protection
            or self.hasher.pending
            or self._queries
        )

    def poll(self) -> None:
        """Take in finished allocations, hashes, exchange commands and flushes, and send the
        replies that waited for them."""
        self._finish_allocations()
        self.finish_hashes()
        self._finish_protection()
        self._finish_flushes()

    def flush_reply(self, token: Any, ok: bool, data: dict[str, Any], err: str) -> None:
        """(Flush thread) a FLUSH is answered; the loop thread sends the reply."""
        self._flush_replies.put((token, ok, data, err))

    def protected_step(self) -> int | None:
        """The newest step the group protected (None: no exchange, or nothing yet)."""
        if self.protection is None:
            return None
        return self.protection.protected_step()

    def close(self) -> None:
        """Stop the protection service (bounded)."""
        if self.protection is not None:
            self.protection.close()

    def finish_hashes(self) -> None:
        """Take the hasher's results (verified slots get their checksummed layout and record;
        a slot that could not be hashed is dropped), then answer the QUERYs they held up."""
        results = self.hasher.results()
        for r in results:
            job = r.job
            keep = self.flush is not None and not r.error and self.flush.wants(job.step)
            verified = self.store.verify(r, keep)
            if verified is None:
                continue
            if verified.kept is not None and self.flush is not None:
                # Kept for the scheduled flush of this step; older reservations are let go.
                self.store.unpin(self.flush.reserve(job.rank, job.step, verified.kept))
            self.events.write(
                "verified",
                rank=job.rank,
                step=job.step,
                hash_s=round(r.seconds, 6),
                bytes=r.nbytes,
                slot=job.slot,
            )
        if results or self._queries:
            waiting, self._queries = self._queries, []
            for req, rank in waiting:
                snaps = self.store.snapshots(rank)
                if snaps is None:
                    self._queries.append((req, rank))
                else:
                    self._send(req.ident, req.req_id, _reply(m.QueryReply(snaps)))

    def _finish_allocations(self) -> None:
        for job in self.allocator.finished():
            for index, path, capacity in job.slots:
                ok = not job.error and path.exists()
                if not ok:
                    shm.remove_segment(path)
                self.store.finish_resize(job.rank, index, str(path), capacity, ok)
            if job.ident is None:
                continue  # the rest of a PREPARE, answered when its first slot was made
            if job.error:
                self._send(job.ident, job.req_id, m.refusal(job.error))
            else:
                made = m.Prepared([m.SlotFile(i, str(p), c) for i, p, c in job.slots])
                self._send(job.ident, job.req_id, m.Reply(ok=True, data=m.to_fields(made)))

    def _finish_protection(self) -> None:
        if self.protection is None:
            return
        for r in self.protection.results():
            self._pending_protection -= 1
            ident, req_id = r.token
            kind = None if r.ok else r.kind
            self._send(ident, req_id, m.Reply(ok=r.ok, error=r.error, data=r.data, kind=kind))

    def _finish_flushes(self) -> None:
        for token, ok, data, err in drain(self._flush_replies):
            if token is not None:  # None: the final flush on SIGTERM, nobody waits for it
                ident, req_id = token
                self._send(ident, req_id, m.Reply(ok=ok, error=err, data=data))

    # -- a rank's life -----------------------------------------------------------------------
    def _ping(self, req: Request, p: m.Ping) -> m.Reply:
        return _reply(m.PingReply(os.getpid()))

    def _hello(self, req: Request, p: m.Hello) -> m.Reply:
        torn = self.store.hello(
            p.rank, p.pid, p.world_size, in_process=p.in_process, rejoined=p.rejoined
        )
        if torn:
            log.info(
                "[%s/%d] rank restarted; dropped torn slots %s", self.config.node, p.rank, torn
            )
        self.events.write(
            "hello", rank=p.rank, pid=p.pid, torn=torn, in_process=p.in_process, rejoined=p.rejoined
        )
        cfg = self.config
        return _reply(m.HelloReply(os.getpid(), cfg.node, cfg.run_id, cfg.slots, str(cfg.shm_dir)))

    def _heartbeat(self, req: Request, p: m.Heartbeat) -> m.Reply:
        self.store.progress(p.rank, p.step)
        return m.Reply(ok=True)

    def _skipped(self, req: Request, p: m.Skipped) -> m.Reply:
        self._count_skip(p.rank, p.step, p.reason[:200])
        return m.Reply(ok=True)

    def _count_skip(self, rank: int, step: int, reason: str) -> None:
        self.store.count_skip(rank, reason)
        self.events.write("skipped", rank=rank, step=step, reason=reason)

    def _status_request(self, req: Request, p: m.Status) -> m.Reply:
        return m.Reply(ok=True, data=self._status().to_json())

    # -- saving ------------------------------------------------------------------------------
    def _begin(self, req: Request, p: m.Begin) -> m.Reply:
        self.store.progress(p.rank, p.step)
        g = self.store.begin(p.rank, p.step, p.nbytes)
        if g.action is m.Decision.SKIP and self.flush is not None:
            # A slot pinned for a scheduled flush that may never be complete must not keep the
            # rank from saving (its final save would wait for it in vain).
            released = self.flush.release_incomplete(p.rank)
            if released:
                self.store.unpin(released)
                g = self.store.begin(p.rank, p.step, p.nbytes)
        if g.action is m.Decision.SKIP and not p.final:  # a final save polling is not a skip (yet)
            self._count_skip(p.rank, p.step, g.reason)
        return _reply(g)

    def _prepare(self, req: Request, p: m.Prepare) -> m.Reply | None:
        capacity = shm.round_capacity(p.nbytes)
        targets = self.store.start_resize(p.rank, p.slot, capacity)
        if not targets:
            # Every slot is the newest committed, pinned, being written, or big enough: a
            # resize now cannot make progress. Say so rather than let the rank ask forever.
            raise ValueError(
                f"no slot of rank {p.rank} can grow to {capacity} bytes now: "
                f"{self.store.describe_slots(p.rank)}"
            )
        job = AllocJob(req.ident, req.req_id, p.rank, [])
        for index, old, gen in targets:
            job.slots.append((index, self.store.files.path(p.rank, index, gen), capacity))
            if old:
                self.store.files.discard(old)
        # A full tmpfs is found here, before the allocation: pre-faulting past its end would
        # raise SIGBUS in the SMP rather than a clean error.
        short = shm.space_shortfall(
            self.config.shm_dir,
            capacity * len(targets),
            node_total=capacity * self.config.slots * max(1, len(self.store.all_ranks())),
            what=f"rank {p.rank}'s {len(targets)} new snapshot slot(s) of {capacity} bytes",
        )
        if short is not None:
            for index, path, _ in job.slots:
                self.store.finish_resize(p.rank, index, str(path), capacity, False)
            if (p.rank, capacity) not in self._space_warned:
                self._space_warned.add((p.rank, capacity))
                log.error("[%s/%d] NOT ENOUGH SHARED MEMORY: %s", self.config.node, p.rank, short)
            return m.refusal(f"not enough shared memory: {short}")
        # Answered as soon as the first slot exists (the rank's first snapshot needs only one);
        # the rest follow on the same thread.
        first, rest = job.slots[:1], job.slots[1:]
        self.allocator.submit(AllocJob(req.ident, req.req_id, p.rank, first))
        if rest:
            self.allocator.submit(AllocJob(None, 0, p.rank, rest))
        log.info(
            "[%s/%d] allocating %d slot(s) of %.1f MiB",
            self.config.node,
            p.rank,
            len(targets),
            capacity / 2**20,
        )
        return None  # the reply is sent when the allocation finishes

    def _commit(self, req: Request, p: m.Commit) -> m.Reply:
        if p.layout:
            self.store.register(p.rank, p.layout_id, p.layout)
        snap = self.store.commit(p)
        log.debug("[%s/%d %d] committed slot %d", self.config.node, p.rank, p.step, p.slot)
        self.events.write(
            "committed",
            rank=p.rank,
            step=p.step,
            stall_s=round(p.stall_s, 6),
            copy_s=round(p.copy_s, 6),
            bytes=snap.used_bytes,
            slot=p.slot,
            skipped=p.skipped,
        )
        if p.next_nbytes <= 0:
            return _reply(m.BeginReply(m.Decision.NONE))
        return _reply(self.store.grant(p.rank, p.next_nbytes))

    def _abort(self, req: Request, p: m.Abort) -> m.Reply:
        self.store.abort(p.rank, p.slot, p.gen)
        return m.Reply(ok=True)

    # -- restoring ---------------------------------------------------------------------------
    def _query(self, req: Request, p: m.Query) -> m.Reply | None:
        snaps = self.store.snapshots(p.rank)
        if snaps is None:
            self._queries.append((req, p.rank))
            return None  # answered by finish_hashes once the rank's slots are verified
        return _reply(m.QueryReply(snaps))

    def _discard_newer(self, req: Request, p: m.DiscardNewer) -> m.Reply:
        if self.flush is not None:
            self.store.unpin(self.flush.cancel_newer(p.step))
        dropped = self.store.discard_newer(p.rank, p.step)
        self.events.write("discard_newer", rank=p.rank, step=p.step, dropped=dropped)
        if dropped:
            log.info(
                "[%s/%d %d] dropped newer steps %s of an abandoned run",
                self.config.node,
                p.rank,
                p.step,
                dropped,
            )
        return m.Reply(ok=True, data={"dropped": dropped})

    # -- disk tiers and peers ----------------------------------------------------------------
    def _flush(self, req: Request, p: m.Flush) -> None:
        if self.flush is None:
            raise ValueError("this SMP has no disk tiers (start it with --flush-dir)")
        if p.tier not in ("", "local", "persistent"):
            raise ValueError(f"tier must be local or persistent, not {p.tier!r}")
        tiers = 1 if p.tier == "local" else len(self.config.flush_tiers)
        step = None if p.step < 0 else p.step
        self.flush.request(FlushRequest((req.ident, req.req_id), step, tiers))
        return None

    def _service(self) -> ProtectionService:
        """The protection thread's service; a failed one (its thread stopped on an unexpected
        error) is replaced by a fresh one, which the launcher then binds and starts again."""
        old = self.protection
        if old is not None and old.failed:
            self._finish_protection()  # answer what the old one still owes
            log.warning(
                "[%s] replacing the protection thread that stopped (%s)",
                self.config.node,
                old.failure,
            )
            old.close()
            self.protection = None
            self.events.write("protection_replaced", error=old.failure)
        if self.protection is None:
            self.protection = ProtectionService(self.config.node, self.store, events=self.events)
            self.protection.start()
        return self.protection

    def _peer_bind(self, req: Request, p: m.PeerBind) -> None:
        try:
            keys = CurveKeyPair.from_json(p.keys)
        except KeyFileError as exc:
            raise ValueError(str(exc)) from exc
        self._service().submit(BindCommand((req.ident, req.req_id), p, keys))
        self._pending_protection += 1
        return None

    def _peer_start(self, req: Request, p: m.PeerStart) -> None:
        try:
            endpoints = {
                pm.parse_node_index(k): pm.parse_endpoint(v) for k, v in p.endpoints.items()
            }
        except ProtocolError as exc:
            raise ValueError(f"bad peer endpoints: {exc}") from exc
        self._service().submit(StartCommand((req.ident, req.req_id), p, endpoints))
        self._pending_protection += 1
        return None


def _reply(typed: Any) -> m.Reply:
    return m.Reply(ok=True, data=m.to_fields(typed))
