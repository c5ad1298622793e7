"""SmpDaemon: owns the SMP's ZeroMQ context, its rank socket, the arenas and the poll loop.

One thread (the caller of :meth:`SmpDaemon.serve_forever`) owns the ROUTER socket. Arena
creation (pre-faulting costs ~1 s/GiB) runs on a named worker thread so the loop keeps
answering other ranks; its result comes back through a queue and the deferred reply is
sent by the loop thread. Checksums of committed slots are computed by the
:class:`~ftmem.smp.hashing.HashService` (``--hash-threads``); a slot is served to loads,
protected and flushed only once verified, and a QUERY waits (bounded by the rank's own
timeout) for the hashes still running.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import zmq

from ftmem import shm
from ftmem._logging import get_logger
from ftmem._process import pid_alive
from ftmem.config import AUTH_KEY_NAME, READY_NAME, SOCKET_NAME, SmpConfig
from ftmem.errors import CorruptSnapshotError, ProtocolError, SmpStartError
from ftmem.events import SMP_EVENTS_NAME, EventLog
from ftmem.exchange.keys import CurveKeyPair, KeyFileError
from ftmem.format.layout import StoredSnapshot, parse_layout
from ftmem.protocol import messages as m
from ftmem.protocol.wire import decode, encode, peek_request_id
from ftmem.smp import records
from ftmem.smp.flush_scheduler import FlushRequest, FlushService, FlushSettings
from ftmem.smp.hashing import HashJob, HashService
from ftmem.smp.protection import BindCommand, ProtectionService, RankPiece, StartCommand
from ftmem.smp.store import RankSlots, Slot, SlotState, StoreError

log = get_logger(__name__)

_MAX_RANK = 1 << 20
_MAX_STEP = 1 << 62
_MAX_SLOT_BYTES = 1 << 40


@dataclass(slots=True)
class _AllocJob:
    ident: bytes
    req_id: int
    rank: int
    slots: list[tuple[int, Path, int]]  # (slot index, new path, capacity)
    error: str = ""


def prepare_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` with mode 0700 (or check an existing one is ours and private)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = run_dir.stat()
    if st.st_uid != os.getuid():
        raise SmpStartError(f"run directory {run_dir} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & 0o077:
        os.chmod(run_dir, 0o700)


class SmpDaemon:
    """The snapshot management process's server.

    Resource handling: :meth:`start` creates the run directory files (key, socket, ready
    file); :meth:`close` (idempotent, also on context exit) closes the socket, removes every
    arena file of this run and node, and the files it created.

    Error handling: a malformed, oversized, unauthenticated or out-of-place request gets an
    error reply (or is dropped when it cannot be answered) and the loop keeps serving.
    """

    def __init__(self, config: SmpConfig) -> None:
        self.config = config
        self.ranks: dict[int, RankSlots] = {}
        self._world_size = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._key: bytes = b""
        self._stop = threading.Event()
        self._jobs: queue.Queue[_AllocJob | None] = queue.Queue()
        self._done: queue.Queue[_AllocJob] = queue.Queue()
        self._pending_allocs = 0
        self._alloc_thread: threading.Thread | None = None
        self._closed = False
        self._owns_run_dir = False
        self.bad_messages = 0
        self.started_at = time.time()
        # The exchange thread pins, unpins and installs slots: every store change holds this.
        self._lock = threading.RLock()
        self.exchange: ProtectionService | None = None
        self._pending_exchange = 0
        self.flush: FlushService | None = None
        self._flush_replies: queue.Queue[tuple[Any, bool, dict[str, Any], str]] = queue.Queue()
        self._stopped_by_signal = False
        self.hasher = HashService(config.node, config.hash_threads)
        self._queries: list[tuple[bytes, int, int]] = []
        """QUERY requests (ident, request id, rank) waiting for that rank's hashes."""
        self.events = EventLog(config.run_dir / SMP_EVENTS_NAME, config.node)
        """The SMP's event log (JSON lines, ``smp-events.jsonl``); opened at the first event."""

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the run-directory files, remove stale arenas of this run/node, bind the socket."""
        cfg = self.config
        prepare_run_dir(cfg.run_dir)
        ready = cfg.run_dir / READY_NAME
        if ready.exists():
            try:
                other = int(json.loads(ready.read_text())["pid"])
            except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                other = -1
            if other > 0 and other != os.getpid() and pid_alive(other):
                raise SmpStartError(f"another SMP (pid {other}) serves {cfg.run_dir}")
            ready.unlink()
        self._owns_run_dir = True
        self.hasher.start()
        if cfg.adopt:
            self._adopt_left_slots()
        else:
            self._remove_stale_arenas()
        key_path = cfg.run_dir / AUTH_KEY_NAME
        key_path.unlink(missing_ok=True)
        self._key = secrets.token_bytes(32)
        fd = os.open(key_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._key)
        (cfg.run_dir / SOCKET_NAME).unlink(missing_ok=True)
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        # An unreachable peer (a rank that died) must not make the loop block on send.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.bind(cfg.endpoint)
        self._sock = sock
        self._alloc_thread = threading.Thread(
            target=self._alloc_worker, name="ftmem-smp-alloc", daemon=True
        )
        self._alloc_thread.start()
        if cfg.flush_tiers:
            self.flush = FlushService(
                cfg.node,
                FlushSettings(
                    list(cfg.flush_tiers), cfg.flush_every, cfg.flush_keep, cfg.flush_shared
                ),
                self,
                self._protected_step,
                lambda token, ok, data, err: self._flush_replies.put((token, ok, data, err)),
                events=self.events,
            )
            self.flush.start()
        info = {
            "pid": os.getpid(),
            "endpoint": cfg.endpoint,
            "node": cfg.node,
            "run_id": cfg.run_id,
        }
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, ready)
        log.info("[%s/smp] serving %s (pid %d)", cfg.node, cfg.endpoint, os.getpid())
        adopted = {str(r): [s.step for s in rs.committed()] for r, rs in self.ranks.items()}
        self.events.write("smp_start", pid=os.getpid(), slots=cfg.slots, adopted=adopted)

    def ready_line(self) -> str:
        """The line written to the readiness pipe: ``READY {json}``."""
        info = {"pid": os.getpid(), "endpoint": self.config.endpoint, "node": self.config.node}
        return "READY " + json.dumps(info) + "\n"

    def request_stop(self, signum: int | None = None, frame: FrameType | None = None) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._stopped_by_signal = signum is not None
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Turn SIGTERM and SIGINT into a clean stop (main thread only)."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)

    def close(self) -> None:
        """Stop the worker, close the socket, remove arenas and run-directory files."""
        if self._closed:
            return
        self._closed = True
        # The ranks' final commits may still be hashing: verify them (bounded) so that the
        # final flush writes the final step.
        if self.hasher.pending and self.hasher.wait_idle(self.config.flush_on_stop.total_seconds()):
            with self._lock:
                self._finish_hashes()
        self.hasher.close()
        if self.flush is not None:
            if self._stopped_by_signal:
                self.flush.final_flush(self.config.flush_on_stop.total_seconds())
            self.flush.close()
        if self.exchange is not None:
            self.exchange.close()
        self._jobs.put(None)
        if self._alloc_thread is not None:
            self._alloc_thread.join(timeout=30)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if not self._owns_run_dir:
            return  # refused to start: the files belong to another SMP
        removed = self._remove_stale_arenas()
        for name in (SOCKET_NAME, AUTH_KEY_NAME, READY_NAME):
            (self.config.run_dir / name).unlink(missing_ok=True)
        log.info("[%s/smp] stopped; removed %d arena files", self.config.node, removed)
        self.events.write(
            "smp_stop",
            by_signal=self._stopped_by_signal,
            uptime_s=round(time.time() - self.started_at, 3),
        )
        self.events.close()

    def __enter__(self) -> SmpDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _adopt_left_slots(self) -> None:
        prefix = f"ftmem-{self.config.run_id}-{self.config.node}-r"
        found, leftovers = records.scan(self.config.shm_dir, prefix, self.config.slots)
        for p in leftovers:
            try:
                shm.remove_segment(p)
                records.remove_record(p)
            except OSError as exc:
                log.warning("[%s/smp] cannot remove %s: %s", self.config.node, p.name, exc)
        for a in list(found):
            r = a.record
            try:
                snap = parse_layout(r.layout, r.capacity)
                self._rank(r.rank).adopt(
                    r.slot, r.gen, str(a.path), r.capacity, r.step, r.seq, r.layout, snap.verified
                )
                if not snap.verified:  # committed, not yet hashed when the previous SMP died
                    self._hash_slot(r.rank, self._rank(r.rank).slot(r.slot), snap)
            # e.g. a rank out of range, or a layout that does not parse: drop it, start anyway
            except (ValueError, CorruptSnapshotError) as exc:
                log.warning("[%s/smp] not adopting %s: %s", self.config.node, a.path.name, exc)
                found.remove(a)
                shm.remove_segment(a.path)
                records.remove_record(a.path)
        if found:
            log.info(
                "[%s/smp] adopted %d committed slot(s) left by a previous SMP: %s",
                self.config.node,
                len(found),
                ", ".join(f"rank {a.record.rank} step {a.record.step}" for a in found),
            )

    def _remove_stale_arenas(self) -> int:
        prefix = f"ftmem-{self.config.run_id}-{self.config.node}-r"
        n = 0
        for p in self.config.shm_dir.glob(prefix + "*"):
            shm.remove_segment(p)
            n += 1
        return n

    # -- loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve requests until :meth:`request_stop` or the parent process is gone."""
        assert self._sock is not None, "start() first"
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        interval_ms = max(1, int(self.config.poll_interval.total_seconds() * 1000))
        while not self._stop.is_set():
            busy = self._pending_allocs or self._pending_exchange or self.hasher.pending
            timeout = 5 if busy or self._queries else interval_ms
            events = dict(poller.poll(timeout))
            if self._sock in events:
                for _ in range(256):  # bounded burst so allocations and signals get a turn
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._handle_frames(frames)
            with self._lock:
                self._finish_allocations()
                self._finish_hashes()
            self._finish_exchange()
            self._finish_flushes()
            ppid = self.config.parent_pid
            # getppid: once the parent dies we are reparented at once, even while the dead
            # parent is an unreaped zombie (which kill(pid, 0) would still report alive).
            if ppid is not None and (os.getppid() != ppid or not pid_alive(ppid)):
                log.warning("[%s/smp] parent %d is gone; stopping", self.config.node, ppid)
                break

    def _send(self, ident: bytes, req_id: int, reply: m.Reply) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, encode(reply, req_id, self._key)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply to a gone peer dropped: %s", exc)

    def _handle_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.bad_messages += 1
            log.warning("[%s/smp] dropped a message of %d frames", self.config.node, len(frames))
            if len(frames) >= 2:
                self._send(frames[0], 0, m.Reply(ok=False, error="expected exactly one frame"))
            return
        ident, frame = frames
        try:
            req_id, kind, payload = decode(frame, self._key, self.config.max_message_bytes)
            if kind is m.Kind.REPLY:
                raise ProtocolError("a reply is not a request")
            reply = self._dispatch(ident, req_id, payload)
        except (ProtocolError, StoreError, ValueError) as exc:
            self.bad_messages += 1
            log.warning("[%s/smp] bad request: %s", self.config.node, exc)
            self._send(ident, peek_request_id(frame) or 0, m.Reply(ok=False, error=str(exc)))
            return
        if reply is not None:
            self._send(ident, req_id, reply)

    # -- handlers --------------------------------------------------------------------------
    def _rank(self, rank: int) -> RankSlots:
        if not 0 <= rank < _MAX_RANK:
            raise ValueError(f"rank {rank} out of range")
        rs = self.ranks.get(rank)
        if rs is None:
            rs = self.ranks[rank] = RankSlots(rank=rank, nslots=self.config.slots)
        return rs

    @staticmethod
    def _check_step(step: int) -> None:
        if not 0 <= step < _MAX_STEP:
            raise ValueError(f"step {step} out of range")

    def _dispatch(self, ident: bytes, req_id: int, p: Any) -> m.Reply | None:
        node = self.config.node
        if isinstance(p, m.Ping):
            return m.Reply(ok=True, data={"pid": os.getpid()})
        if isinstance(p, m.Hello):
            if p.world_size > 0:
                self._world_size = p.world_size
            rs = self._rank(p.rank)
            torn = rs.restarted(p.pid)
            if torn:
                log.info("[%s/%d] rank restarted; dropped torn slots %s", node, p.rank, torn)
            self.events.write("hello", rank=p.rank, pid=p.pid, torn=torn)
            return m.Reply(ok=True, data=self._hello_data())
        if isinstance(p, m.Heartbeat):
            self._check_step(p.step)
            self._rank(p.rank).progress(p.step)
            return m.Reply(ok=True)
        if isinstance(p, m.Begin):
            return self._begin(p)
        if isinstance(p, m.Prepare):
            return self._prepare(ident, req_id, p)
        if isinstance(p, m.Commit):
            return self._commit(p)
        if isinstance(p, m.Abort):
            self._rank(p.rank).abort(p.slot, p.gen)
            return m.Reply(ok=True)
        if isinstance(p, m.Skipped):
            self._check_step(p.step)
            self._skipped(self._rank(p.rank), p.step, p.reason[:200])
            return m.Reply(ok=True)
        if isinstance(p, m.Query):
            rs = self._rank(p.rank)
            if rs.unverified():
                self._queries.append((ident, req_id, p.rank))
                return None  # answered by _finish_hashes once the rank's slots are verified
            return self._query_reply(rs)
        if isinstance(p, m.DiscardNewer):
            self._check_step(p.step)
            if self.flush is not None:
                self.unpin(self.flush.cancel_newer(p.step))
            rs = self._rank(p.rank)
            for sl in rs.slots:
                if sl.state is SlotState.COMMITTED and (sl.step or 0) > p.step and not sl.pinned:
                    records.remove_record(sl.path)
            dropped = rs.discard_newer(p.step)
            rs.restored_time = time.time()
            self.events.write("discard_newer", rank=p.rank, step=p.step, dropped=dropped)
            if dropped:
                log.info(
                    "[%s/%d %d] dropped newer steps %s of an abandoned run",
                    node,
                    p.rank,
                    p.step,
                    dropped,
                )
            return m.Reply(ok=True, data={"dropped": dropped})
        if isinstance(p, m.Status):
            return m.Reply(ok=True, data=self.status())
        if isinstance(p, m.Flush):
            if self.flush is None:
                raise ValueError("this SMP has no disk tiers (start it with --flush-dir)")
            if p.tier not in ("", "local", "persistent"):
                raise ValueError(f"tier must be local or persistent, not {p.tier!r}")
            tiers = 1 if p.tier == "local" else len(self.config.flush_tiers)
            step = None if p.step < 0 else p.step
            self.flush.request(FlushRequest((ident, req_id), step, tiers))
            return None
        if isinstance(p, m.PeerBind):
            try:
                keys = CurveKeyPair.from_json(p.keys)
            except KeyFileError as exc:
                raise ValueError(str(exc)) from exc
            self._exchange().submit(BindCommand((ident, req_id), keys, p.host, p.me, p.port))
            self._pending_exchange += 1
            return None
        if isinstance(p, m.PeerStart):
            try:
                endpoints = {int(k): str(v) for k, v in p.endpoints.items()}
            except ValueError as exc:
                raise ValueError(f"bad endpoints: {exc}") from exc
            cmd = StartCommand(
                (ident, req_id),
                p.epoch,
                p.me,
                endpoints,
                p.m,
                p.max_group,
                list(p.ranks),
                p.protect_interval_s,
            )
            self._exchange().submit(cmd)
            self._pending_exchange += 1
            return None
        raise ProtocolError(f"unexpected request {type(p).__name__}")

    @staticmethod
    def _query_reply(rs: RankSlots) -> m.Reply:
        snaps = [
            {
                "step": s.step,
                "slot": s.index,
                "gen": s.gen,
                "path": s.path,
                "capacity": s.capacity,
                "layout": s.layout,
            }
            for s in rs.verified()
        ]
        return m.Reply(ok=True, data={"snapshots": snaps})

    def _skipped(self, rs: RankSlots, step: int, reason: str) -> None:
        rs.count_skip(reason)
        self.events.write("skipped", rank=rs.rank, step=step, reason=reason)

    # -- verification ----------------------------------------------------------------------
    def _hash_slot(self, rank: int, sl: Slot, snap: StoredSnapshot) -> None:
        """Pin a committed slot and queue its checksums (caller holds the lock); ``snap``:
        its layout, already parsed against the slot."""
        assert sl.step is not None
        sl.pinned += 1
        self.hasher.submit(HashJob(rank, sl.index, sl.gen, sl.step, sl.path, sl.layout, snap))

    def _finish_hashes(self) -> None:
        """Take the hasher's results: verified slots get their checksummed layout and record;
        a slot that could not be hashed is dropped. Then answer the QUERYs they held up."""
        results = self.hasher.results()
        for r in results:
            job = r.job
            rs = self.ranks.get(job.rank)
            if rs is None:
                continue
            sl = rs.slot(job.slot)
            if sl.gen == job.gen and sl.pinned > 0:
                sl.pinned -= 1
            if r.error:
                log.error(
                    "[%s/%d %d] cannot verify slot %d: %s; dropped",
                    self.config.node,
                    job.rank,
                    job.step,
                    job.slot,
                    r.error,
                )
                if sl.gen == job.gen and not sl.pinned:
                    records.remove_record(sl.path)
                    rs.drop(job.slot, job.gen)
                continue
            if not rs.verify(job.slot, job.gen, job.step, r.layout):
                continue  # replaced or dropped while it was hashed
            rs.last_hash_s = r.seconds
            self._write_record(rs, sl)
            if self.flush is not None and self.flush.wants(job.step):
                sl.pinned += 1  # kept for the scheduled flush of this step
                used = job.snap.used_bytes  # checksums do not move extents
                piece = RankPiece(job.rank, sl.index, sl.gen, sl.path, sl.capacity, used, sl.layout)
                self.unpin(self.flush.reserve(job.rank, job.step, piece))
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
            for ident, req_id, rank in waiting:
                rs = self._rank(rank)
                if rs.unverified():
                    self._queries.append((ident, req_id, rank))
                else:
                    self._send(ident, req_id, self._query_reply(rs))

    def _write_record(self, rs: RankSlots, sl: Slot) -> None:
        assert sl.step is not None
        try:
            records.write_record(
                sl.path,
                records.CommitRecord(
                    rank=rs.rank,
                    slot=sl.index,
                    gen=sl.gen,
                    capacity=sl.capacity,
                    step=sl.step,
                    seq=sl.seq,
                    layout=sl.layout,
                ),
            )
        except OSError as exc:  # the commit stands; only adoption after an SMP crash is lost
            log.warning(
                "[%s/%d %d] cannot write commit record: %s", self.config.node, rs.rank, sl.step, exc
            )

    def _exchange(self) -> ProtectionService:
        if self.exchange is None:
            self.exchange = ProtectionService(self.config.node, self, events=self.events)
            self.exchange.start()
        return self.exchange

    def _finish_exchange(self) -> None:
        if self.exchange is None:
            return
        for r in self.exchange.results():
            self._pending_exchange -= 1
            ident, req_id = r.token
            self._send(ident, req_id, m.Reply(ok=r.ok, error=r.error, data=r.data))

    def _finish_flushes(self) -> None:
        while True:
            try:
                token, ok, data, err = self._flush_replies.get_nowait()
            except queue.Empty:
                return
            if token is None:
                continue  # the final flush on SIGTERM: nobody waits on the socket
            ident, req_id = token
            self._send(ident, req_id, m.Reply(ok=ok, error=err, data=data))

    def _protected_step(self) -> int | None:
        if self.exchange is None:
            return None
        step = self.exchange.status().get("protected_step")
        return step if isinstance(step, int) else None

    def world_size(self) -> int:
        """The job's world size as the newest rank to say hello reported (0: unknown)."""
        return self._world_size

    def all_ranks(self) -> list[int]:
        """Every rank this SMP has seen."""
        with self._lock:
            return sorted(self.ranks)

    # -- what the exchange thread uses (LocalSnapshots) ----------------------------------------
    def complete_steps(self, ranks: list[int] | Any) -> list[int]:
        """Steps every rank of ``ranks`` has committed, newest first."""
        with self._lock:
            common: set[int] | None = None
            for r in ranks:
                rs = self.ranks.get(r)
                steps = {s.step for s in rs.verified() if s.step is not None} if rs else set()
                common = steps if common is None else common & steps
            return sorted(common or (), reverse=True)

    def pin_step(self, ranks: list[int] | Any, step: int) -> list[RankPiece] | None:
        """Pin every rank's committed slot of ``step``; None if a rank has none."""
        with self._lock:
            chosen: list[tuple[int, Slot]] = []
            for r in ranks:
                rs = self.ranks.get(r)
                found = [s for s in rs.verified() if s.step == step] if rs else []
                if not found:
                    return None
                chosen.append((r, found[0]))
            pieces = []
            for r, sl in chosen:
                sl.pinned += 1
                used = parse_layout(sl.layout, sl.capacity).used_bytes
                pieces.append(RankPiece(r, sl.index, sl.gen, sl.path, sl.capacity, used, sl.layout))
            return pieces

    def unpin(self, pieces: list[RankPiece] | Any) -> None:
        """Undo :meth:`pin_step` (slots replaced since are left alone)."""
        with self._lock:
            for p in pieces:
                rs = self.ranks.get(p.rank)
                if rs is None:
                    continue
                sl = rs.slot(p.slot)
                if sl.gen == p.gen and sl.pinned > 0:
                    sl.pinned -= 1

    def install_rebuilt(
        self, step: int, manifest: dict[str, Any], data: memoryview
    ) -> list[RankPiece]:
        """Write each rebuilt rank's bytes into a new slot file, commit it and pin it.

        Raises:
            ValueError: the manifest does not describe ``data`` (nothing is installed).
            OSError: a slot file cannot be made (e.g. /dev/shm is full).
        """
        entries = manifest.get("ranks")
        if not isinstance(entries, list):
            raise ValueError("manifest without ranks")
        spans, off = [], 0
        for e in entries:
            rank, n, cap, layout = (
                int(e["rank"]),
                int(e["nbytes"]),
                int(e["capacity"]),
                str(e["layout"]),
            )
            try:
                snap = parse_layout(layout, cap)
            except CorruptSnapshotError as exc:
                raise ValueError(f"manifest entry of rank {rank}: {exc}") from exc
            if not (0 <= n <= cap <= _MAX_SLOT_BYTES and snap.used_bytes == n):
                raise ValueError(f"manifest entry of rank {rank} does not fit its slot")
            spans.append((rank, off, n, cap, layout, snap))
            off += n
        if off != data.nbytes:
            raise ValueError(f"manifest covers {off} bytes, the rebuilt data has {data.nbytes}")
        pieces = []
        for rank, off, n, cap, layout, snap in spans:
            with self._lock:
                rs = self._rank(rank)
                sl = _slot_for_rebuild(rs, step)
                old = Path(sl.path) if sl.path else None
                sl.state, sl.step, sl.layout, sl.verified = SlotState.ALLOCATING, None, "", False
                gen = sl.gen + 1
            path = self.config.shm_dir / shm.slot_file_name(
                self.config.run_id, self.config.node, rank, sl.index, gen
            )
            if old is not None:
                records.remove_record(old)
                shm.remove_segment(old)
            ok = False
            try:
                shm.create_segment(path, cap)
                shm.write_segment(path, data[off : off + n])
                ok = True
            finally:
                with self._lock:
                    rs.finish_resize(sl.index, str(path), cap, ok)
                    if not ok:
                        shm.remove_segment(path)
            with self._lock:
                # Its checksums came with the manifest; the ranks verify them again at load.
                rs.adopt(
                    sl.index, sl.gen, str(path), cap, step, rs.next_seq(), layout, snap.verified
                )
                sl.pinned += 1
                self._write_record(rs, sl)
                if not snap.verified:
                    self._hash_slot(rank, sl, snap)
            pieces.append(RankPiece(rank, sl.index, sl.gen, str(path), cap, n, layout))
            log.info(
                "[%s/%d %d] rebuilt slot %d (%.1f MiB)",
                self.config.node,
                rank,
                step,
                sl.index,
                n / 2**20,
            )
        return pieces

    def _hello_data(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node": self.config.node,
            "run_id": self.config.run_id,
            "slots": self.config.slots,
            "shm_dir": str(self.config.shm_dir),
        }

    def _begin(self, p: m.Begin) -> m.Reply:
        self._check_step(p.step)
        if not 0 < p.nbytes <= _MAX_SLOT_BYTES:
            raise ValueError(f"nbytes {p.nbytes} out of range")
        rs = self._rank(p.rank)
        rs.progress(p.step)
        d = rs.begin(p.step, p.nbytes)
        if d.action == "skip" and self.flush is not None:
            # A slot pinned for a scheduled flush that may never be complete must not keep the
            # rank from saving (its final save would wait for it in vain).
            released = self.flush.release_incomplete(p.rank)
            if released:
                self.unpin(released)
                d = rs.begin(p.step, p.nbytes)
        if d.action == "skip":
            if not p.final:  # a final save polling for a slot is not a skip (yet)
                self._skipped(rs, p.step, d.reason)
            return m.Reply(ok=True, data={"action": "skip", "reason": d.reason})
        s = rs.slot(d.slot)
        if d.action == "write":
            records.remove_record(s.path)  # its old data is about to be overwritten
        return m.Reply(
            ok=True,
            data={
                "action": d.action,
                "slot": s.index,
                "gen": s.gen,
                "path": s.path,
                "capacity": s.capacity,
            },
        )

    def _commit(self, p: m.Commit) -> m.Reply:
        self._check_step(p.step)
        rs = self._rank(p.rank)
        s = rs.slot(p.slot)
        try:
            snap = parse_layout(p.layout, s.capacity)
        except CorruptSnapshotError as exc:
            raise ValueError(str(exc)) from exc
        if snap.step != p.step:
            raise ValueError(f"layout of step {snap.step} committed as step {p.step}")
        rs.commit(p.slot, p.gen, p.step, p.layout)
        self._write_record(rs, s)  # unverified: a restarted SMP hashes it when adopting
        self._hash_slot(p.rank, s, snap)
        rs.progress(p.step)
        rs.last_stall_s, rs.last_copy_s, rs.skipped = (
            p.stall_s,
            p.copy_s,
            max(rs.skipped, p.skipped),
        )
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
        return m.Reply(ok=True)

    def _prepare(self, ident: bytes, req_id: int, p: m.Prepare) -> m.Reply | None:
        if not 0 < p.nbytes <= _MAX_SLOT_BYTES:
            raise ValueError(f"nbytes {p.nbytes} out of range")
        rs = self._rank(p.rank)
        capacity = shm.round_capacity(p.nbytes)
        targets = [] if p.slot < 0 else [rs.start_resize(p.slot)]
        # Grow every other free slot now too, so the next saves need no resize.
        for s in rs.slots:
            if (
                s.index != p.slot
                and s.state in (SlotState.FREE, SlotState.EMPTY)
                and s.capacity < capacity
            ):
                targets.append(rs.start_resize(s.index))
        job = _AllocJob(ident, req_id, p.rank, [])
        for s in targets:
            name = shm.slot_file_name(
                self.config.run_id, self.config.node, p.rank, s.index, s.gen + 1
            )
            old = Path(s.path) if s.path else None
            job.slots.append((s.index, self.config.shm_dir / name, capacity))
            if old is not None:
                records.remove_record(old)
                shm.remove_segment(old)
        self._pending_allocs += 1
        self._jobs.put(job)
        log.info(
            "[%s/%d] allocating %d slot(s) of %.1f MiB",
            self.config.node,
            p.rank,
            len(targets),
            capacity / 2**20,
        )
        return None  # the reply is sent when the allocation finishes

    def _alloc_worker(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            for _, path, capacity in job.slots:
                try:
                    shm.create_segment(path, capacity)
                except OSError as exc:
                    job.error = f"cannot create {path.name} ({capacity} bytes): {exc}"
                    log.error("[%s/smp] %s", self.config.node, job.error)
                    break
            self._done.put(job)

    def _finish_allocations(self) -> None:
        while True:
            try:
                job = self._done.get_nowait()
            except queue.Empty:
                return
            self._pending_allocs -= 1
            rs = self._rank(job.rank)
            for index, path, capacity in job.slots:
                ok = not job.error and path.exists()
                if not ok:
                    shm.remove_segment(path)
                rs.finish_resize(index, str(path), capacity, ok)
            if job.error:
                self._send(job.ident, job.req_id, m.Reply(ok=False, error=job.error))
            else:
                made = [{"slot": i, "path": str(p), "capacity": c} for i, p, c in job.slots]
                self._send(job.ident, job.req_id, m.Reply(ok=True, data={"slots": made}))

    def status(self) -> dict[str, Any]:
        """Return the SMP's state: identity, and each rank's slots, progress and statistics."""
        return {
            "pid": os.getpid(),
            "run_id": self.config.run_id,
            "node": self.config.node,
            "endpoint": self.config.endpoint,
            "uptime_s": time.time() - self.started_at,
            "bad_messages": self.bad_messages,
            "ranks": {str(r): rs.describe() for r, rs in sorted(self.ranks.items())},
            "exchange": self.exchange.status() if self.exchange else {"enabled": False},
            "flush": self.flush.status() if self.flush else {"enabled": False},
        }


def _slot_for_rebuild(rs: RankSlots, step: int) -> Slot:
    """The slot a rebuilt snapshot goes into: one already holding ``step`` (its data may be
    stale or corrupt), else a free one, else the oldest committed one, never a pinned one."""
    newest = rs.newest()
    candidates = [s for s in rs.slots if not s.pinned and s.state is not SlotState.WRITING]
    for s in candidates:
        if s.state is SlotState.COMMITTED and s.step == step:
            return s
    free = [s for s in candidates if s.state in (SlotState.FREE, SlotState.EMPTY)]
    if free:
        return free[0]
    older = sorted((s for s in candidates if s is not newest), key=lambda s: s.seq)
    if older:
        return older[0]
    if candidates:
        return candidates[0]
    raise StoreError(f"rank {rs.rank} has no slot to take a rebuilt snapshot")
