"""DataChannel: the mesh's plain data channel, a length-prefixed TCP stream read into bounded
buffers.

Why not ZeroMQ here: ZeroMQ bounds each frame (``MAXMSGSIZE``), not a message, and buffers a
multipart message whole before the application sees any of it, so anyone who can reach the port
grows the receiver without bound with frames that never end a message. Here every byte is read
by this module into buffers whose sizes were checked, and authenticated, before they are made.

Wire format (one direction of a TCP connection, messages back to back, integers little endian)::

    prelude   12 bytes: b"FTD1", name bytes (u16), buffer count (u16), header bytes (u32)
    sizes     8 bytes per buffer (u64)
    name      the sender's node name (ASCII)
    header    the PEER envelope frame (wire.py: sizes and xxh3 checksums of the buffers)
    head tag  32 bytes: data_mac.head_tag over both public keys, the name, header and sizes
    buffers   the raw bytes
    tag       32 bytes: data_mac.tag over both public keys, the name, header and buffers

A receiver reads a connection through these stages::

    PRELUDE -> HEAD -> (PARKED until the generation's keys are known) -> BODY -> TAG -> PRELUDE
       any bad prelude or head, a head tag that is wrong, EOF, a deadline: the connection closes

What it holds, whatever anyone sends:
- A connection that has not yet sent a head whose tag is right (no key holder, so far) holds at
  most one head (:data:`MAX_HEAD` bytes); at most :data:`MAX_PENDING` such connections are open
  (the oldest is closed for a new one) and each is closed after ``admit_wait_s``.
- Buffers are made only once the head tag, which binds their sizes, is right: a key holder's
  connection holds at most one message of ``max_message_bytes``; a node keeps at most
  :data:`PER_NODE` connections (the older is closed).
- At most :data:`RECV_QUEUE` whole messages wait for :meth:`DataChannel.take`; reading stops
  while they do.
- Connections come only from the generation's peer hosts once those are known; a sender binds
  its outgoing socket to the address it advertises, so its connections come from there.

The full tag is checked by the consumer (zmq_transport.py) before anything else is read; a
message whose buffers do not match it leaves the stream in frame (the sizes were
authenticated), so the connection goes on. Sending: per peer, a queue of at most ``send_hwm``
messages and one connection (made on demand, remade after a failure with a backoff; a message
cut by a failure is lost, as on any dead link; the group protocol asks again).

One thread ("data-channel") does all socket I/O; the exchange thread queues sends and takes
received messages, and is woken through :attr:`DataChannel.wake_fd`.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ftmem.errors import FtmemError
from ftmem.exchange import data_mac
from ftmem.exchange.codec import tune_malloc

log = logging.getLogger(__name__)

MAGIC = b"FTD1"
PRELUDE = struct.Struct("<4sHHI")
"""magic, name bytes, buffer count, header bytes."""
MAX_NAME = 64
MAX_BUFFERS = 8
MAX_HEADER = 1 << 20
MAX_HEAD = MAX_BUFFERS * 8 + MAX_NAME + MAX_HEADER + data_mac.TAG_BYTES
"""The most a connection holds before its sender is authenticated."""
MAX_PENDING = 16
"""Open connections whose sender is not yet authenticated."""
PER_NODE = 2
"""Connections kept per authenticated node."""
RECV_QUEUE = 8
"""Whole messages waiting for take(); reading pauses while this many do."""
_IOV = 64  # parts per sendmsg call
_BACKOFF_S = (0.1, 2.0)


class DataChannelError(FtmemError):
    """The data channel cannot work any more (its I/O thread stopped)."""


@dataclass(frozen=True, slots=True)
class Received:
    """A message as it came off the wire: its head is authenticated, its buffers are not yet
    (their tag is :attr:`tag`)."""

    sender: str
    header: bytes
    buffers: list[memoryview]
    tag: bytes


@dataclass(frozen=True, slots=True)
class Refused:
    """What a refused message claimed (its sender, a member, and its header bytes); kept only
    for a message that came over a connection already authenticated as that sender."""

    sender: str
    header: bytes


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host without IPv6 brackets, port)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def _ips(host: str) -> set[str]:
    return {
        str(ipaddress.ip_address(str(ai[4][0]).split("%")[0]))
        for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    }


def _buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes from the heap, not zeroed (it is about to be
    overwritten). With large blocks kept on the heap (:func:`~ftmem.exchange.codec.tune_malloc`,
    applied at :meth:`DataChannel.start`) a freed message's memory serves the next without new
    page faults: fresh anonymous maps cost the receiver ~1 CPU-s per GiB in faults here."""
    return np.empty(n, np.uint8).data


@dataclass(eq=False, slots=True)
class _Inbound:
    sock: socket.socket
    ip: str
    since: float
    node: str = ""
    """The authenticated sender ("" until a head's tag was right)."""
    stage: str = "prelude"
    target: memoryview = field(default_factory=lambda: memoryview(bytearray(PRELUDE.size)))
    got: int = 0
    layout: tuple[int, int, int] = (0, 0, 0)
    """The head's buffer count, name and header bytes (from the prelude)."""
    name: str = ""
    header: bytes = b""
    sizes: tuple[int, ...] = ()
    buffers: list[memoryview] = field(default_factory=list)
    head: bytes = b""
    reading: bool = True


@dataclass(eq=False, slots=True)
class _Outbound:
    node: str
    host: str
    port: int
    queue: deque[list[memoryview]] = field(default_factory=deque)
    sock: socket.socket | None = None
    connected: bool = False
    current: list[memoryview] | None = None
    retry_at: float = 0.0
    backoff: float = _BACKOFF_S[0]


class DataChannel:
    """Receives and sends data-channel messages (module docstring). Thread-safe between the
    exchange thread (:meth:`set_members`, :meth:`has_room`, :meth:`wait_room`, :meth:`put`,
    :meth:`take`) and its own I/O thread.

    Resource handling: :meth:`start` binds a listener and starts the thread; :meth:`close`
    stops it (bounded) and closes every socket.
    """

    def __init__(
        self,
        node: str,
        key: bytes,
        public: bytes,
        host: str,
        max_message_bytes: int,
        send_hwm: int,
        admit_wait_s: float,
    ) -> None:
        self.node, self.host = node, host
        self._key, self._public = key, public
        self.max_message_bytes = max_message_bytes
        self.send_hwm = send_hwm
        self.admit_wait_s = admit_wait_s
        self.dropped = 0
        """Messages or connections dropped by the I/O thread (malformed, refused, cut)."""
        self.forged = 0
        """Heads whose tag was wrong (altered, or sent without the job's key)."""
        self.refused: deque[Refused] = deque(maxlen=64)
        self.failed = ""
        """Why the I/O thread stopped on an unexpected error ("" while it runs):
        :meth:`take` then raises, so the exchange thread fails visibly instead of waiting for
        data that can no longer come."""
        self.port = 0
        self._peer_keys: dict[str, bytes] | None = None
        self._allowed: frozenset[str] | None = None
        self._lock = threading.Condition()
        self._inbox: deque[Received] = deque()
        self._out: dict[str, _Outbound] = {}
        self._retired: list[_Outbound] = []
        self._in: list[_Inbound] = []
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._ready_r, self._ready_w = os.pipe()
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        os.set_blocking(self._ready_r, False)
        os.set_blocking(self._ready_w, False)
        self._stop = False
        self._paused = False
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None

    @property
    def wake_fd(self) -> int:
        """Readable while a received message waits for :meth:`take` (one byte per message)."""
        return self._ready_r

    @property
    def endpoint(self) -> str:
        """``tcp://host:port`` of the listener."""
        return f"tcp://{self.host}:{self.port}"

    def start(self) -> str:
        """Bind the listener on ``host`` (a free port) and start the I/O thread."""
        tune_malloc()
        host = self.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lst = socket.create_server((host, 0), family=family, backlog=64)
        lst.setblocking(False)
        self.port = lst.getsockname()[1]
        self._listener = lst
        self._sel.register(lst, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="data-channel", daemon=True)
        self._thread.start()
        return self.endpoint

    # -- the exchange thread's side ---------------------------------------------------------
    def set_members(self, peer_keys: dict[str, bytes], data: dict[str, str]) -> None:
        """The generation: each peer's public key and data endpoint. Connections to peers that
        left or moved are closed (their queues dropped); only the peers' hosts may connect."""
        try:
            allowed: frozenset[str] | None = frozenset(
                ip for ep in data.values() for ip in _ips(split_endpoint(ep)[0])
            )
        except (OSError, ValueError) as exc:
            log.warning(
                "[%s] data channel: a peer host does not resolve (%s); "
                "taking connections from any address",
                self.node,
                exc,
            )
            allowed = None
        with self._lock:
            self._peer_keys = dict(peer_keys)
            self._allowed = allowed
            for node, o in list(self._out.items()):
                if node not in data or split_endpoint(data[node]) != (o.host, o.port):
                    self._out.pop(node)
                    o.queue.clear()
                    o.current = None
                    o.retry_at = -1.0  # closed by the I/O thread
                    self._retired.append(o)
            for node, ep in data.items():
                if node not in self._out:
                    host, port = split_endpoint(ep)
                    self._out[node] = _Outbound(node, host, port)
            self._lock.notify_all()
        self._wake()

    def has_peer(self, node: str) -> bool:
        """True if ``node`` is a peer of the generation."""
        return node in self._out

    def has_room(self, node: str) -> bool:
        """True if ``node``'s queue takes a message now."""
        o = self._out.get(node)
        return o is not None and len(o.queue) < self.send_hwm

    def wait_room(self, node: str, timeout_s: float) -> bool:
        """Wait (bounded) until ``node``'s queue takes a message; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self.has_room(node):
                left = deadline - time.monotonic()
                if left <= 0 or node not in self._out:
                    return False
                self._lock.wait(left)
        return True

    def put(self, node: str, parts: list[memoryview]) -> None:
        """Queue one message (its wire parts, sent without copies; kept until sent)."""
        with self._lock:
            self._out[node].queue.append(parts)
        self._wake()

    def take(self) -> Received | None:
        """The next received message, if one waits (call when :attr:`wake_fd` is readable).

        Raises:
            DataChannelError: the I/O thread stopped on an unexpected error.
        """
        if self.failed:
            raise DataChannelError(f"the data channel's I/O thread stopped: {self.failed}")
        try:
            os.read(self._ready_r, 1)
        except BlockingIOError:
            return None
        with self._lock:
            got = self._inbox.popleft() if self._inbox else None
            resume = self._paused and len(self._inbox) < RECV_QUEUE
        if resume:
            self._wake()
        return got

    def close(self) -> None:
        """Stop the I/O thread (bounded) and close every socket (idempotent)."""
        self._stop = True
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        for c in self._in:
            c.sock.close()
        self._in.clear()
        for o in [*self._out.values(), *self._retired]:
            if o.sock is not None:
                o.sock.close()
        self._out.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for s in (self._wake_r, self._wake_w):
            s.close()
        for fd in (self._ready_r, self._ready_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._sel.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):  # a wake is already pending, or closed
            pass

    # -- the I/O thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, events in self._sel.select(self._timeout()):
                    what = key.data
                    if what == "accept":
                        self._accept()
                    elif what == "wake":
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except (BlockingIOError, OSError):
                            pass
                    elif isinstance(what, _Inbound):
                        self._read(what)
                    elif isinstance(what, _Outbound):
                        self._write(what, events)
                self._housekeep()
        except Exception as exc:  # a bug here must not go unnoticed: no data would come
            log.exception("[%s] the data channel's I/O thread failed", self.node)
            self.failed = f"{type(exc).__name__}: {exc}"
            try:
                os.write(self._ready_w, b"x")  # wake the exchange thread to see it
            except OSError:
                pass

    def _timeout(self) -> float | None:
        now = time.monotonic()
        times = [c.since + self.admit_wait_s for c in self._in if not c.node]
        times += [o.retry_at for o in list(self._out.values()) if o.sock is None and o.queue]
        return max(0.0, min(times) - now) if times else None

    def _housekeep(self) -> None:
        now = time.monotonic()
        with self._lock:
            retired, self._retired[:] = list(self._retired), []
            outs = list(self._out.values())
            paused = len(self._inbox) >= RECV_QUEUE
            keys = self._peer_keys
        for o in retired:
            self._close_out(o, cut=False)
        for c in list(self._in):
            if not c.node and now > c.since + self.admit_wait_s:
                self._drop(c, "no authenticated head in time")
            elif c.stage == "parked" and keys is not None:
                c.stage = "checked"
                self._after_head(c)
        for o in outs:
            if o.sock is None and (o.queue or o.current) and now >= o.retry_at:
                self._connect(o)
            elif o.connected and (o.queue or o.current):
                self._watch(o, selectors.EVENT_READ | selectors.EVENT_WRITE)
        if paused != self._paused:
            self._paused = paused
            for c in self._in:
                if c.stage != "parked":
                    self._reading(c, not paused)

    # inbound
    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the peer retries
                log.warning("[%s] data channel: accept failed: %s", self.node, exc)
                return
            ip = str(ipaddress.ip_address(addr[0].split("%")[0]))
            allowed = self._allowed
            if allowed is not None and ip not in allowed:
                self.dropped += 1  # counted before the peer can see the close
                sock.close()
                log.warning(
                    "[%s] data channel: refused a connection from %s, no peer host of "
                    "this generation",
                    self.node,
                    ip,
                )
                continue
            pending = [c for c in self._in if not c.node]
            if len(pending) >= MAX_PENDING:
                self._drop(pending[0], "too many unauthenticated connections")
            sock.setblocking(False)
            c = _Inbound(sock, ip, time.monotonic())
            self._in.append(c)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _reading(self, c: _Inbound, on: bool) -> None:
        if on != c.reading:
            c.reading = on
            if on:
                self._sel.register(c.sock, selectors.EVENT_READ, c)
            else:
                self._sel.unregister(c.sock)

    def _drop(self, c: _Inbound, why: str) -> None:
        if c in self._in:
            self._in.remove(c)
            if c.reading:
                self._sel.unregister(c.sock)
            self.dropped += 1  # counted before the peer can see the close
            c.sock.close()
            log.warning(
                "[%s] data channel: closed a connection from %s (%s): %s",
                self.node,
                c.ip,
                c.node or "not authenticated",
                why,
            )

    def _read(self, c: _Inbound) -> None:
        while c.reading and c in self._in:
            try:
                n = c.sock.recv_into(c.target[c.got :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(c, f"read failed: {exc}")
                return
            if n == 0:
                if c.stage == "prelude" and c.got == 0 and c.node:
                    self._in.remove(c)  # a clean close between messages
                    self._sel.unregister(c.sock)
                    c.sock.close()
                else:
                    self._drop(c, "closed in the middle of a message")
                return
            c.got += n
            if c.got == len(c.target):
                self._advance(c)

    def _advance(self, c: _Inbound) -> None:
        """The current stage's bytes are all in: check them and go to the next stage."""
        if c.stage == "prelude":
            magic, name_n, nbuf, header_n = PRELUDE.unpack(c.target)
            if (
                magic != MAGIC
                or not 0 < name_n <= MAX_NAME
                or not 0 < nbuf <= MAX_BUFFERS
                or (header_n > MAX_HEADER)
            ):
                self._drop(c, "not a data-channel message (or over its limits)")
                return
            c.layout = (nbuf, name_n, header_n)
            self._expect(c, "head", bytearray(nbuf * 8 + name_n + header_n + data_mac.TAG_BYTES))
        elif c.stage == "head":
            nbuf, name_n, header_n = c.layout
            raw = bytes(c.target)
            c.sizes = struct.unpack_from(f"<{nbuf}Q", raw)
            name = raw[nbuf * 8 : nbuf * 8 + name_n]
            c.header = raw[nbuf * 8 + name_n : nbuf * 8 + name_n + header_n]
            c.head = raw[-data_mac.TAG_BYTES :]
            c.name = name.decode("ascii", "replace") if name.isascii() else "?"
            if self._peer_keys is None:  # no generation yet: wait for it (bounded)
                c.stage = "parked"
                self._reading(c, False)
                return
            c.stage = "checked"
            self._after_head(c)
        elif c.stage == "body":
            c.buffers.append(c.target)
            if len(c.buffers) < len(c.sizes):
                self._expect(c, "body", None)
            else:
                self._expect(c, "tag", bytearray(data_mac.TAG_BYTES))
        elif c.stage == "tag":
            self._deliver(c, bytes(c.target))

    def _expect(self, c: _Inbound, stage: str, buf: bytearray | None) -> None:
        c.stage, c.got = stage, 0
        c.target = memoryview(buf) if buf is not None else _buffer(c.sizes[len(c.buffers)])
        if stage == "body" and not len(c.target):  # an empty buffer: nothing to read
            self._advance(c)

    def _after_head(self, c: _Inbound) -> None:
        keys = self._peer_keys or {}
        public = keys.get(c.name)
        want = (
            data_mac.head_tag(self._key, public, self._public, c.name, c.header, c.sizes)
            if public is not None
            else b""
        )
        if not want or not hmac.compare_digest(want, c.head):
            self.forged += 1
            if public is not None and c.node == c.name:  # only over that node's own connection:
                self.refused.append(Refused(c.name, c.header))  # anyone can name a member
            self._drop(
                c,
                f"a head naming node {c.name[:16]!r} without its tag "
                "(altered on the way, or sent without the job's key)",
            )
            return
        if c.node and c.node != c.name:
            self._drop(c, f"node {c.node!r}'s connection sent a message naming {c.name!r}")
            return
        if sum(c.sizes) > self.max_message_bytes:
            self._drop(c, f"a message of {sum(c.sizes)} bytes (at most {self.max_message_bytes})")
            return
        if not c.node:
            c.node = c.name
            mine = [x for x in self._in if x.node == c.node]
            if len(mine) > PER_NODE:
                self._drop(mine[0], "a newer connection of the same node")
        self._reading(c, not self._paused)
        c.buffers = []
        self._expect(c, "body", None)

    def _deliver(self, c: _Inbound, tag: bytes) -> None:
        got = Received(c.node, c.header, c.buffers, tag)
        c.buffers, c.header = [], b""
        self._expect(c, "prelude", bytearray(PRELUDE.size))
        with self._lock:
            self._inbox.append(got)
            full = len(self._inbox) >= RECV_QUEUE
        os.write(self._ready_w, b"m")
        if full and not self._paused:
            self._paused = True
            for x in self._in:
                if x.stage != "parked":
                    self._reading(x, False)

    # outbound
    def _watch(self, o: _Outbound, events: int) -> None:
        assert o.sock is not None
        try:
            self._sel.modify(o.sock, events, o)
        except KeyError:
            self._sel.register(o.sock, events, o)

    def _connect(self, o: _Outbound) -> None:
        family = socket.AF_INET6 if ":" in o.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((self.host.strip("[]"), 0))  # connections come from the advertised host
        except OSError as exc:
            log.debug("[%s] data channel: cannot bind to %s: %s", self.node, self.host, exc)
        err = s.connect_ex((o.host, o.port))
        o.sock, o.connected = s, False
        if err not in (0, errno.EINPROGRESS):
            self._close_out(o, cut=False)
            return
        self._watch(o, selectors.EVENT_WRITE)

    def _close_out(self, o: _Outbound, cut: bool) -> None:
        if o.sock is not None:
            try:
                self._sel.unregister(o.sock)
            except (KeyError, ValueError):
                pass
            o.sock.close()
        if cut and o.current is not None:
            log.warning("[%s] data channel: a message to node %s was cut", self.node, o.node)
        o.sock, o.connected, o.current = None, False, None
        o.retry_at = time.monotonic() + o.backoff
        o.backoff = min(o.backoff * 2, _BACKOFF_S[1])

    def _write(self, o: _Outbound, events: int) -> None:
        if o.sock is None:
            return
        if not o.connected:
            err = o.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._close_out(o, cut=False)
                return
            o.connected, o.backoff = True, _BACKOFF_S[0]
        if events & selectors.EVENT_READ:  # a receiver sends nothing: its close, or junk
            try:
                o.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close_out(o, cut=True)
                return
            else:
                self._close_out(o, cut=True)
                return
        while True:
            if not o.current:
                with self._lock:
                    o.current = o.queue.popleft() if o.queue else None
                    self._lock.notify_all()
                if o.current is None:
                    self._watch(o, selectors.EVENT_READ)
                    return
            try:
                n = o.sock.sendmsg(o.current[:_IOV])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close_out(o, cut=True)
                return
            parts = o.current
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts and n:
                parts[0] = parts[0][n:]


def frame(
    key: bytes,
    sender_public: bytes,
    receiver_public: bytes,
    sender: str,
    header: bytes,
    buffers: list[memoryview],
) -> list[memoryview]:
    """The wire parts of one message (module docstring); buffers are not copied."""
    name = sender.encode()
    sizes = tuple(b.nbytes for b in buffers)
    head = data_mac.head_tag(key, sender_public, receiver_public, sender, header, sizes)
    tag = data_mac.tag(key, sender_public, receiver_public, sender, header, buffers)
    prefix = b"".join(
        (
            PRELUDE.pack(MAGIC, len(name), len(buffers), len(header)),
            struct.pack(f"<{len(sizes)}Q", *sizes),
            name,
            header,
            head,
        )
    )
    return [memoryview(prefix), *(b.cast("B") for b in buffers), memoryview(tag)]


__all__ = ["DataChannel", "Received", "Refused", "frame", "split_endpoint"]
