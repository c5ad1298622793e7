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
  is admission.py's: one over its quota is closed at once, before the receiver's first byte
  (the sender sends it again); no open connection is closed to make room. One whose right
  hello is already in as it is accepted is taken anyway (a flood from a shared address does
  not shut the peers out). A replayed hello (its nonce seen in the generation) is closed.
- A key holder's connection must send a head whose tag is right within :data:`HEAD_S` of the
  nonce; buffers are made only once the head tag, which binds their sizes, is right: it holds
  at most one message of ``max_message_bytes``, and within a message it may stay silent at
  most :data:`BODY_S`. A node keeps at most :data:`PER_NODE` connections that carried a
  message (the older is closed): a head is good on one connection only (the nonce), so only
  the node itself can make a newer one.
- At most :data:`RECV_QUEUE` whole messages wait for :meth:`DataChannel.take`; reading key
  holders' connections stops while they do.
- A sender binds its outgoing socket to the address it advertises. Refused and closed
  connections without a right hello are logged as counts (admission.DropLog); accept failing
  for want of descriptors pauses accepting briefly.

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

import ipaddress
import logging
import math
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable

from ftmem.errors import FtmemError
from ftmem.exchange import admission, data_mac
from ftmem.exchange.codec import tune_malloc
from ftmem.exchange.data_recv import RECV_QUEUE, Inbound, Received, Receiver, Refused
from ftmem.exchange.data_send import Outbound, Outgoing, Sender, frame

__all__ = ["DataChannel", "Outgoing", "Received", "Refused", "frame", "split_endpoint"]

log = logging.getLogger(__name__)


class DataChannelError(FtmemError):
    """The data channel cannot work any more (its I/O thread stopped)."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host without IPv6 brackets, port)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def peer_hosts(endpoints: Iterable[str], what: str) -> frozenset[str] | None:
    """The addresses of ``endpoints``' hosts; None (any address) if one does not resolve,
    which is logged for ``what`` (the port that then takes any address)."""
    try:
        return frozenset(
            str(ipaddress.ip_address(str(ai[4][0]).split("%")[0]))
            for ep in endpoints
            for ai in socket.getaddrinfo(split_endpoint(ep)[0], None, proto=socket.IPPROTO_TCP)
        )
    except (OSError, ValueError) as exc:
        log.warning("%s: a peer host does not resolve (%s); taking any address", what, exc)
        return None


class DataChannel(Sender, Receiver):
    """Receives and sends data-channel messages (module docstring). Thread-safe between the
    protection thread (:meth:`set_members`, :meth:`wait_room`, :meth:`put`,
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
        """Why the I/O thread stopped on an unexpected error ("" while it runs): :meth:`take`
        then raises rather than let the protection thread wait for data that cannot come."""
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
        self._in: list[Inbound] = []
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
        allowed = peer_hosts(data.values(), f"[{self.node}] data channel")
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

    def wait_room(self, node: str, timeout_s: float) -> bool:
        """Wait (bounded) until ``node``'s queue takes a message; False on timeout or if
        ``node`` is no peer."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (o := self._out.get(node)) is None or len(o.queue) >= self.send_hwm:
                left = deadline - time.monotonic()
                if left <= 0 or o is None:
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
                    elif isinstance(what, Inbound):
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
        self._pause(paused)
        if self._accept_at and now >= self._accept_at and self._listener is not None:
            self._accept_at = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._drops.flush(now)
