"""SmpDaemon: owns the SMP's ZeroMQ context, its rank socket, its services and the poll loop.

One thread (the caller of :meth:`SmpDaemon.serve_forever`) owns the ROUTER socket: it decodes
each request, hands it to its handler (:class:`~ftmem.smp.handlers.RequestHandlers`) and sends
the reply. Slot files are made on the :class:`~ftmem.smp.allocation.Allocator`'s thread and
committed slots checksummed by the :class:`~ftmem.smp.hashing.HashService`, so the loop keeps
answering other ranks; their deferred replies are sent by the loop thread.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from types import FrameType

import zmq

from ftmem._logging import get_logger
from ftmem._process import pid_alive
from ftmem.config import AUTH_KEY_NAME, READY_NAME, SOCKET_NAME, SmpConfig, hash_threads_for
from ftmem.errors import ErrorKind, ProtocolError, SmpStartError, UnsafePathError
from ftmem.events import SMP_EVENTS_NAME, EventLog
from ftmem.protocol import messages as m
from ftmem.protocol.status import FlushStatus, SmpStatus
from ftmem.protocol.wire import decode, encode, peek_request_id
from ftmem.secure_fs import prepare_private_dir, replace_private_file
from ftmem.smp.allocation import Allocator, SlotFiles
from ftmem.smp.flush_scheduler import FlushService
from ftmem.smp.handlers import Request, RequestHandlers
from ftmem.smp.hashing import HashService
from ftmem.smp.node_lock import NodeLock
from ftmem.smp.slot_store import SlotStore, UnknownLayoutError
from ftmem.smp.store import StoreError

log = get_logger(__name__)


class SmpDaemon:
    """The snapshot management process's server.

    Resource handling: :meth:`start` creates the run directory files (key, socket, ready
    file); :meth:`close` (idempotent) closes the socket, removes every arena file of this run
    and node, and the files it created.

    Error handling: a malformed, oversized, unauthenticated or out-of-place request gets an
    error reply (or is dropped when it cannot be answered) and the loop keeps serving.
    """

    def __init__(self, config: SmpConfig) -> None:
        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._key: bytes = b""
        self._stop = threading.Event()
        self._closed = False
        self._owns_run_dir = False
        self.bad_messages = 0
        self.started_at = time.time()
        self._stopped_by_signal = False
        self.hasher = HashService(config.node, hash_threads_for(config.hash_threads))
        self.files = SlotFiles(config.shm_dir, config.run_id, config.node)
        self.node_lock = NodeLock(config.run_id, config.node)
        """Held while this SMP lives: no other SMP of this user serves this run and node."""
        self.store = SlotStore(config.node, config.slots, self.files, self.hasher.submit)
        """Every rank's slots: the loop, protection, flush threads all change them here."""
        self.allocator = Allocator(config.node)
        self.flush: FlushService | None = None
        self.events = EventLog(config.run_dir / SMP_EVENTS_NAME, config.node)
        """The SMP's event log (JSON lines, ``smp-events.jsonl``); opened at the first event."""
        self.handlers = RequestHandlers(
            config, self.store, self.hasher, self.allocator, self.events, self._send, self.status
        )

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the run-directory files and the private shared-memory directory, adopt (or
        remove) the slot files a previous SMP of this run and node left, bind the socket.

        Raises:
            SmpStartError: the run directory or the shared-memory directory is unsafe (the
                message names the path and its owner), or another SMP holds this run and
                node.
        """
        cfg = self.config
        try:  # ours and private, in a parent nobody else can swap it in
            prepare_private_dir(cfg.run_dir, "run directory")
        except UnsafePathError as exc:
            raise SmpStartError(str(exc)) from exc
        ready = cfg.run_dir / READY_NAME
        if ready.exists():
            try:
                other = m.SmpReady.from_json(ready.read_text()).pid
            except (OSError, ProtocolError):
                other = -1
            if other > 0 and other != os.getpid() and pid_alive(other):
                raise SmpStartError(f"another SMP (pid {other}) serves {cfg.run_dir}")
            ready.unlink()
        try:
            self.files.prepare()  # the private directory of every slot file (mode 0700)
        except UnsafePathError as exc:
            raise SmpStartError(str(exc)) from exc
        self.node_lock.acquire()  # before any slot file of this run and node is touched
        self._owns_run_dir = True
        self.hasher.start()
        if cfg.adopt:
            self._adopt_left_slots()
        else:
            self.files.remove_all()
        self._key = secrets.token_bytes(32)
        replace_private_file(cfg.run_dir / AUTH_KEY_NAME, self._key)
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
        self.allocator.start()
        if cfg.flush_tiers:
            self.flush = FlushService(
                cfg,
                self.store,
                self.handlers.protected_step,
                self.handlers.flush_reply,
                events=self.events,
            )
            self.handlers.flush = self.flush
            self.flush.start()
        replace_private_file(ready, self.ready_info().to_json().encode())
        log.info(
            "[%s/smp] serving %s (pid %d); slot files in %s, nonce %s",
            cfg.node,
            cfg.endpoint,
            os.getpid(),
            cfg.shm_dir,
            self.files.nonce,
        )
        adopted = self.store.committed_steps()
        self.events.write("smp_start", pid=os.getpid(), slots=cfg.slots, adopted=adopted)

    def ready_info(self) -> m.SmpReady:
        """What this SMP says of itself once ready (the pipe's line, the ready file)."""
        cfg = self.config
        return m.SmpReady(os.getpid(), cfg.endpoint, cfg.node, cfg.run_id)

    def ready_line(self) -> str:
        """The line written to the readiness pipe: ``READY {json}``."""
        return "READY " + self.ready_info().to_json() + "\n"

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
        # The ranks' final commits may still be hashing: verify them so that the final flush
        # writes the final step. Both share one bound (flush_on_stop), which the launcher's
        # grace before SIGKILL counts on.
        deadline = time.monotonic() + self.config.flush_on_stop.total_seconds()
        if self.hasher.pending and self.hasher.wait_idle(deadline - time.monotonic()):
            self.handlers.finish_hashes()
        self.hasher.close()
        if self.flush is not None:
            if self._stopped_by_signal:
                self.flush.final_flush(max(0.0, deadline - time.monotonic()))
            self.flush.close()
        self.handlers.close()
        self.store.close()
        self.allocator.close(timeout_s=30)
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if not self._owns_run_dir:
            return  # refused to start: the files belong to another SMP
        removed = self.files.remove_all()
        self.node_lock.release()
        for name in (SOCKET_NAME, AUTH_KEY_NAME, READY_NAME):
            (self.config.run_dir / name).unlink(missing_ok=True)
        log.info("[%s/smp] stopped; removed %d arena files", self.config.node, removed)
        self.events.write(
            "smp_stop",
            by_signal=self._stopped_by_signal,
            uptime_s=round(time.time() - self.started_at, 3),
        )
        self.events.close()

    def _adopt_left_slots(self) -> None:
        found = self.store.adopt_left()
        if found:
            log.info(
                "[%s/smp] adopted %d committed slot(s) left by a previous SMP: %s",
                self.config.node,
                len(found),
                ", ".join(f"rank {a.record.rank} step {a.record.step}" for a in found),
            )

    # -- loop ------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve requests until :meth:`request_stop` or the parent process is gone."""
        assert self._sock is not None, "start() first"
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        interval_ms = max(1, int(self.config.poll_interval.total_seconds() * 1000))
        while not self._stop.is_set():
            timeout = 5 if self.handlers.busy() else interval_ms
            events = dict(poller.poll(timeout))
            if self._sock in events:
                for _ in range(256):  # bounded burst so allocations and signals get a turn
                    if not int(self._sock.get(zmq.EVENTS)) & zmq.POLLIN:
                        break  # (asked first: a zmq.Again raised on every pass costs more)
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self._handle_frames(frames)
            self.handlers.poll()
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
                refused = m.refusal("expected exactly one frame", ErrorKind.BAD_REQUEST)
                self._send(frames[0], 0, refused)
            return
        ident, frame = frames
        try:
            req_id, kind, payload = decode(frame, self._key, self.config.max_message_bytes)
            if kind is m.Kind.REPLY:
                raise ProtocolError("a reply is not a request")
            reply = self.handlers.handle(Request(ident, req_id), kind, payload)
        except (ProtocolError, StoreError, ValueError) as exc:
            self.bad_messages += 1
            log.warning("[%s/smp] bad request: %s", self.config.node, exc)
            refusal = (
                ErrorKind.UNKNOWN_LAYOUT
                if isinstance(exc, UnknownLayoutError)
                else ErrorKind.BAD_REQUEST
            )
            self._send(ident, peek_request_id(frame) or 0, m.refusal(str(exc), refusal))
            return
        if reply is not None:
            self._send(ident, req_id, reply)

    def status(self) -> SmpStatus:
        """The SMP's state: identity, request counts, each rank's slots and progress, the
        protection service's and the flush's."""
        protection = self.handlers.protection
        return SmpStatus(
            pid=os.getpid(),
            run_id=self.config.run_id,
            node=self.config.node,
            endpoint=self.config.endpoint,
            uptime_s=time.time() - self.started_at,
            bad_messages=self.bad_messages,
            requests=dict(self.handlers.requests),
            ranks=self.store.statuses(),
            protection=protection.board.read() if protection else None,
            flush=self.flush.status() if self.flush else FlushStatus(),
        )
