"""DataChannel: the mesh's plain data channel, a length-prefixed TCP stream read into bounded
buffers.

Why not ZeroMQ here: ZeroMQ bounds each frame (``MAXMSGSIZE``), not a message, and buffers a
multipart message whole before the application sees any of it, so anyone who can reach the port
grows the receiver without bound with frames that never end a message. Here every byte is read
by this module into buffers whose sizes were checked, and authenticated, before they are made.

Wire format (one TCP connection, integers little endian)::

    sender -> receiver, first:
    hello     92 bytes: b"FTH1", the sender's public key of the generation (Z85), its nonce
              (16 bytes, fresh), data_mac.hello_tag over both public keys and that nonce
    receiver -> sender, once the hello's tag is right (and nothing else ever):
    nonce     16 random bytes
    sender -> receiver, then messages back to back:
    prelude   12 bytes: b"FTD1", name bytes (u16), buffer count (u16), header bytes (u32)
    sizes     8 bytes per buffer (u64)
    name      the sender's node name (ASCII)
    header    the PEER envelope frame (wire.py: sizes and xxh3 checksums of the buffers)
    head tag  32 bytes: data_mac.head_tag over both public keys, the name, header and sizes,
              the receiver's nonce and the message's number on the connection (0, 1, ...)
    buffers   the raw bytes
    tag       32 bytes: data_mac.tag over both public keys, the name, header and buffers

A receiver reads a connection through these stages::

    HELLO -> (PARKED until the generation's keys are known) -> send the nonce ->
    PRELUDE -> HEAD -> BODY -> TAG -> PRELUDE
       a bad hello, prelude or head, a tag that is wrong, EOF, a deadline: the connection closes

What it holds, whatever anyone sends:
- A connection whose hello is not yet right (anyone's) holds at most :data:`HELLO` bytes and
  lives at most :data:`HEAD_S` (``admit_wait_s`` while its hello is parked). Who may hold one
  (admission.py): at most ``PER_SOURCE`` per address, each peer host of the generation with
  room of its own, no other address once those are known. One over its quota is closed at
  once, before the receiver's first byte (the sender sends it again: nothing is lost); no open
  connection is closed to make room. One whose right hello is already in as it is accepted is
  taken anyway (a key holder: a flood from a shared address does not shut the peers out). A
  hello whose nonce was seen before in the generation (a replay) closes the connection.
- A key holder's connection (its hello was right) must send a head whose tag is right within
  :data:`HEAD_S` of the nonce; buffers are made only once the head tag, which binds their
  sizes, is right: it holds at most one message of ``max_message_bytes``, and within a message
  it may stay silent at most :data:`BODY_S` (the body deadline). A node keeps at most
  :data:`PER_NODE` connections that carried a message (the older is closed): a head is good on
  one connection only (the nonce), so only the node itself can make a newer one.
- At most :data:`RECV_QUEUE` whole messages wait for :meth:`DataChannel.take`; reading key
  holders' connections stops while they do.
- A sender binds its outgoing socket to the address it advertises, so its connections come
  from there. Refused and closed connections without a right hello are logged as counts
  (admission.DropLog); accept failing for want of descriptors pauses accepting briefly.

The full tag is checked by the consumer (zmq_transport.py) before anything else is read; a
message whose buffers do not match it leaves the stream in frame (the sizes were
authenticated), so the connection goes on. Sending: per peer, a queue of at most ``send_hwm``
messages and one connection (made on demand, remade after a failure with a backoff). A message
leaves the queue once the receiver's nonce is in, and goes back to it if its connection closes
before any of its bytes were sent; a message cut by a failure is lost, as on any dead link
(the group protocol asks again).

One thread ("data-channel") does all socket I/O; the protection thread queues sends and takes
received messages, and is woken through :attr:`DataChannel.wake_fd`.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from ftmem.errors import FtmemError
from ftmem.exchange import admission, data_mac
from ftmem.exchange.codec import tune_malloc
from ftmem.exchange.data_send import (
    HELLO,
    HELLO_MAGIC,
    MAGIC,
    PRELUDE,
    Outbound,
    Outgoing,
    Sender,
    frame,
)

log = logging.getLogger(__name__)

MAX_NAME = 64
MAX_BUFFERS = 8
MAX_HEADER = 1 << 20
MAX_HEAD = MAX_BUFFERS * 8 + MAX_NAME + MAX_HEADER + data_mac.TAG_BYTES
"""The most a key holder's connection holds before its head's tag is checked."""
HEAD_S = 1.5
"""A connection's hello, and a key holder's first head after the nonce, within this."""
BODY_S = 10.0
"""Within a message, a connection may stay silent this long at most."""
PER_NODE = 2
"""Connections kept per node (those that carried a message)."""
RECV_QUEUE = 8
"""Whole messages waiting for take(); reading pauses while this many do."""
SEEN = 4096
"""Hello nonces remembered per generation (a replayed hello is refused)."""
_ACCEPT_PAUSE_S = 0.5  # accept failing for want of descriptors: wait this long
_NO_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


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
    page faults: fresh anonymous maps would cost the receiver a fault per page."""
    return np.empty(n, np.uint8).data


@dataclass(eq=False, slots=True)
class _Inbound:
    sock: socket.socket
    ip: str
    due: float
    """When it is closed unless it moves on (inf: never; only while it is read or parked)."""
    node: str = ""
    """The key holder its hello named ("" until the hello's tag was right)."""
    proven: bool = False
    """A head's tag was right on it (the node itself sent it)."""
    nonce: bytes = b""
    seq: int = 0
    stage: str = "hello"
    target: memoryview = field(default_factory=lambda: memoryview(bytearray(HELLO.size)))
    got: int = 0
    layout: tuple[int, int, int] = (0, 0, 0)
    """The head's buffer count, name and header bytes (from the prelude)."""
    name: str = ""
    header: bytes = b""
    sizes: tuple[int, ...] = ()
    buffers: list[memoryview] = field(default_factory=list)
    head: bytes = b""
    reading: bool = True


class DataChannel(Sender):
    """Receives and sends data-channel messages (module docstring). Thread-safe between the
    protection thread (:meth:`set_members`, :meth:`has_room`, :meth:`wait_room`, :meth:`put`,
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
        """Hellos and heads whose tag was wrong (altered, replayed, or sent without the job's
        key; a connection whose first bytes are no hello counts as one)."""
        self.refused: deque[Refused] = deque(maxlen=64)
        self.failed = ""
        """Why the I/O thread stopped on an unexpected error ("" while it runs):
        :meth:`take` then raises, so the protection thread fails visibly instead of waiting for
        data that can no longer come."""
        self.port = 0
        self._peer_keys: dict[str, bytes] | None = None
        self._by_public: dict[bytes, str] = {}
        self._seen: dict[bytes, None] = {}
        self._allowed: frozenset[str] | None = None
        self._drops = admission.DropLog(log, f"[{node}] data channel")
        self._accept_at = 0.0  # > 0: accepting paused until then
        self._lock = threading.Condition()
        self._inbox: deque[Received] = deque()
        self._out: dict[str, Outbound] = {}
        self._retired: list[Outbound] = []
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
        lst = socket.create_server((host, 0), family=family, backlog=256)
        lst.setblocking(False)
        self.port = lst.getsockname()[1]
        self._listener = lst
        self._sel.register(lst, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="data-channel", daemon=True)
        self._thread.start()
        return self.endpoint

    # -- the protection thread's side ---------------------------------------------------------
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
            if peer_keys != self._peer_keys:
                self._seen = {}
            self._by_public = {k: n for n, k in peer_keys.items()}
            self._peer_keys = dict(peer_keys)
            self._allowed = allowed
            for node, o in list(self._out.items()):
                if node not in data or split_endpoint(data[node]) != (o.host, o.port):
                    self._out.pop(node)
                    o.queue.clear()
                    o.current = None
                    o.retry_at = -1.0  # closed by the I/O thread
                    self._retired.append(o)
                else:
                    o.public = peer_keys[node]
            for node, ep in data.items():
                if node not in self._out:
                    host, port = split_endpoint(ep)
                    self._out[node] = Outbound(node, host, port, peer_keys[node])
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

    def put(self, node: str, msg: Outgoing) -> None:
        """Queue one message (:func:`frame`'s; its buffers are sent without copies and kept
        until sent)."""
        with self._lock:
            self._out[node].queue.append(msg)
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
        self._drops.flush(force=True)
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
                    elif isinstance(what, Outbound):
                        self._write(what, events)
                self._housekeep()
        except Exception as exc:  # a bug here must not go unnoticed: no data would come
            log.exception("[%s] the data channel's I/O thread failed", self.node)
            self.failed = f"{type(exc).__name__}: {exc}"
            try:
                os.write(self._ready_w, b"x")  # wake the protection thread to see it
            except OSError:
                pass

    def _timeout(self) -> float | None:
        now = time.monotonic()
        times = [c.due for c in self._in if c.reading or c.stage == "parked"]
        times += [o.retry_at for o in list(self._out.values()) if o.sock is None and o.queue]
        times += [self._drops.due(), self._accept_at or math.inf]
        soonest = min(times)
        return max(0.0, soonest - now) if soonest < math.inf else None

    def _housekeep(self) -> None:
        now = time.monotonic()
        with self._lock:
            retired, self._retired[:] = list(self._retired), []
            outs = list(self._out.values())
            paused = len(self._inbox) >= RECV_QUEUE
            keys = self._peer_keys
        for o in retired:
            self._close_out(o)
        for c in list(self._in):
            if now > c.due and (c.reading or c.stage == "parked"):
                self._drop(c, "no hello" if c.stage == "hello" else "a deadline passed")
            elif c.stage == "parked" and keys is not None:
                self._after_hello(c)
        for o in outs:
            if o.sock is None and (o.queue or o.current) and now >= o.retry_at:
                self._connect(o)
            elif o.got == data_mac.NONCE_BYTES and (o.queue or o.current):
                self._watch(o, selectors.EVENT_READ | selectors.EVENT_WRITE)
        if paused != self._paused:
            self._paused = paused
            for c in self._in:
                if c.node and c.stage != "parked":
                    self._reading(c, not paused)
        if self._accept_at and now >= self._accept_at and self._listener is not None:
            self._accept_at = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._drops.flush(now)

    # inbound
    def _accept(self) -> None:
        assert self._listener is not None
        while not self._accept_at:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in _NO_FDS:
                    continue  # that connection is gone (ECONNABORTED and the like)
                self._drops.count("any address", f"accept failed ({exc.strerror}); paused a while")
                self._sel.unregister(self._listener)  # the peer's connect waits meanwhile
                self._accept_at = time.monotonic() + _ACCEPT_PAUSE_S
                return
            sock.setblocking(False)
            ip = str(ipaddress.ip_address(addr[0].split("%")[0]))
            c = _Inbound(sock, ip, time.monotonic() + HEAD_S)
            why = admission.refusal(
                ip, Counter(x.ip for x in self._in if not x.node), self._allowed
            )
            self._in.append(c)
            if not why:
                self._sel.register(sock, selectors.EVENT_READ, c)
                continue
            c.reading = False  # over quota: taken only if its right hello is in already
            try:
                c.got = sock.recv_into(c.target)
            except OSError:
                pass
            if c.got == HELLO.size and self._peer_keys is not None:
                self._reading(c, True)
                c.stage = "parked"
                self._after_hello(c)
                why = "" if c.node else why
            if why:
                self._drop(c, why)

    def _reading(self, c: _Inbound, on: bool) -> None:
        if on != c.reading:
            c.reading = on
            if on:
                self._sel.register(c.sock, selectors.EVENT_READ, c)
                if c.due < math.inf:
                    c.due = max(c.due, time.monotonic() + HEAD_S)
            else:
                self._sel.unregister(c.sock)

    def _drop(self, c: _Inbound, why: str) -> None:
        if c in self._in:
            self._in.remove(c)
            if c.reading:
                self._sel.unregister(c.sock)
            self.dropped += 1  # counted before the peer can see the close
            c.sock.close()
            if not c.node:  # anyone's: counted, logged now and then
                self._drops.count(c.ip, why)
                return
            log.warning(
                "[%s] data channel: closed a connection from %s (node %s): %s",
                self.node,
                c.ip,
                c.node,
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
                if c.stage == "prelude" and c.got == 0 and c.proven:
                    self._in.remove(c)  # a clean close between messages
                    self._sel.unregister(c.sock)
                    c.sock.close()
                else:
                    self._drop(c, f"closed in stage {c.stage}")
                return
            c.got += n
            if c.proven:
                c.due = time.monotonic() + BODY_S
            if c.got == len(c.target):
                self._advance(c)

    def _advance(self, c: _Inbound) -> None:
        """The current stage's bytes are all in: check them and go to the next stage."""
        if c.stage == "hello":
            c.stage = "parked"
            if self._peer_keys is None:  # no generation yet: wait for it (bounded)
                self._reading(c, False)
                c.due = time.monotonic() + self.admit_wait_s
                return
            self._after_hello(c)
        elif c.stage == "prelude":
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

    def _after_hello(self, c: _Inbound) -> None:
        """Check a (parked) connection's hello now that the keys are known: a key holder's
        gets the nonce and goes on to its first message; any other closes."""
        magic, public, nonce, tag = HELLO.unpack(c.target)
        node = self._by_public.get(public, "") if magic == HELLO_MAGIC else ""
        if not node or not hmac.compare_digest(
            tag, data_mac.hello_tag(self._key, public, self._public, nonce)
        ):
            self.forged += 1
            self._drop(c, "not a key holder's hello" if node else "no member's hello")
            return
        if nonce in self._seen:
            self.forged += 1
            self._drop(c, "a replayed hello")
            return
        self._seen[nonce] = None
        if len(self._seen) > SEEN:
            del self._seen[next(iter(self._seen))]
        c.nonce = os.urandom(data_mac.NONCE_BYTES)
        try:
            sent = c.sock.send(c.nonce)
        except OSError:
            sent = 0
        if sent != len(c.nonce):
            self._drop(c, "the nonce could not be sent")
            return
        c.node, c.due = node, time.monotonic() + HEAD_S
        self._reading(c, not self._paused)
        self._expect(c, "prelude", bytearray(PRELUDE.size))

    def _after_head(self, c: _Inbound) -> None:
        keys = self._peer_keys or {}
        public = keys.get(c.name)
        want = (
            data_mac.head_tag(
                self._key, public, self._public, c.name, c.header, c.sizes, c.nonce, c.seq
            )
            if public is not None and c.name == c.node
            else b""
        )
        if not want or not hmac.compare_digest(want, c.head):
            self.forged += 1
            if want:  # a member's, over that node's own connection (anyone can name one)
                self.refused.append(Refused(c.name, c.header))
            self._drop(
                c,
                f"a head naming node {c.name[:16]!r} without its tag "
                "(altered on the way, replayed, or sent without the job's key)",
            )
            return
        c.seq += 1
        if sum(c.sizes) > self.max_message_bytes:
            self._drop(c, f"a message of {sum(c.sizes)} bytes (at most {self.max_message_bytes})")
            return
        if not c.proven:
            c.proven = True
            mine = [x for x in self._in if x.node == c.node and x.proven]
            if len(mine) > PER_NODE:
                self._drop(mine[0], "a newer connection of the same node")
        c.due = time.monotonic() + BODY_S
        c.buffers = []
        self._expect(c, "body", None)

    def _deliver(self, c: _Inbound, tag: bytes) -> None:
        got = Received(c.node, c.header, c.buffers, tag)
        c.buffers, c.header, c.due = [], b"", math.inf
        self._expect(c, "prelude", bytearray(PRELUDE.size))
        with self._lock:
            self._inbox.append(got)
            full = len(self._inbox) >= RECV_QUEUE
        os.write(self._ready_w, b"m")
        if full and not self._paused:
            self._paused = True
            for x in self._in:
                if x.node and x.stage != "parked":
                    self._reading(x, False)


__all__ = ["DataChannel", "Outgoing", "Received", "Refused", "frame", "split_endpoint"]
