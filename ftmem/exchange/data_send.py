"""The sending half of the data channel (wire format: data_channel.py): per peer one
connection, made on demand (a hello, then the receiver's nonce), and a queue of messages whose
head tags are written for the connection they go on."""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ftmem.exchange import data_mac

log = logging.getLogger("ftmem.exchange.data_channel")

MAGIC = b"FTD1"
PRELUDE = struct.Struct("<4sHHI")
"""magic, name bytes, buffer count, header bytes."""
HELLO_MAGIC = b"FTH1"
HELLO = struct.Struct(f"<4s40s{data_mac.NONCE_BYTES}s{data_mac.TAG_BYTES}s")
"""magic, the sender's public key (Z85, as the peers' addresses give it), its nonce,
data_mac.hello_tag."""
_IOV = 64  # parts per sendmsg call
BACKOFF_S = (0.1, 2.0)


@dataclass(eq=False, slots=True)
class Outgoing:
    """One message to send (:func:`frame`): its wire parts, whose head tag is written in place
    (:attr:`prefix`'s last bytes) once the connection's nonce is known."""

    wire: tuple[memoryview, ...]
    prefix: bytearray
    header: bytes
    sizes: tuple[int, ...]
    receiver_public: bytes
    left: list[memoryview] = field(default_factory=list)
    """What is still to send of it on the current connection."""


@dataclass(eq=False, slots=True)
class Outbound:
    node: str
    host: str
    port: int
    public: bytes
    queue: deque[Outgoing] = field(default_factory=deque)
    sock: socket.socket | None = None
    connected: bool = False
    nonce: bytearray = field(default_factory=lambda: bytearray(data_mac.NONCE_BYTES))
    got: int = 0
    """Bytes of the receiver's nonce in (all of them: messages may go)."""
    seq: int = 0
    current: Outgoing | None = None
    sent_any: bool = False
    retry_at: float = 0.0
    backoff: float = BACKOFF_S[0]


def frame(
    key: bytes,
    sender_public: bytes,
    receiver_public: bytes,
    sender: str,
    header: bytes,
    buffers: list[memoryview],
) -> Outgoing:
    """One message (module docstring), its head tag still to be written; buffers are not
    copied. The tag over the buffers is made here (the caller's thread)."""
    name = sender.encode()
    sizes = tuple(b.nbytes for b in buffers)
    tag = data_mac.tag(key, sender_public, receiver_public, sender, header, buffers)
    prefix = bytearray(
        b"".join(
            (
                PRELUDE.pack(MAGIC, len(name), len(buffers), len(header)),
                struct.pack(f"<{len(sizes)}Q", *sizes),
                name,
                header,
                bytes(data_mac.TAG_BYTES),
            )
        )
    )
    wire = (memoryview(prefix), *(b.cast("B") for b in buffers), memoryview(tag))
    return Outgoing(wire, prefix, bytes(header), sizes, receiver_public)


class Sender:
    """The sending half of :class:`~ftmem.exchange.data_channel.DataChannel` (its I/O thread
    calls these)."""

    node: str
    host: str
    _key: bytes
    _public: bytes
    _sel: selectors.BaseSelector
    _lock: threading.Condition

    def _watch(self, o: Outbound, events: int) -> None:
        assert o.sock is not None
        try:
            self._sel.modify(o.sock, events, o)
        except KeyError:
            self._sel.register(o.sock, events, o)

    def _connect(self, o: Outbound) -> None:
        family = socket.AF_INET6 if ":" in o.host else socket.AF_INET
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:  # no descriptor left: try again later
            log.debug("[%s] data channel: no socket for node %s: %s", self.node, o.node, exc)
            self._close_out(o)
            return
        s.setblocking(False)
        try:
            s.bind((self.host.strip("[]"), 0))  # connections come from the advertised host
        except OSError as exc:
            log.debug("[%s] data channel: cannot bind to %s: %s", self.node, self.host, exc)
        err = s.connect_ex((o.host, o.port))
        o.sock, o.connected, o.got, o.seq = s, False, 0, 0
        if err not in (0, errno.EINPROGRESS):
            self._close_out(o)
            return
        self._watch(o, selectors.EVENT_WRITE)

    def _close_out(self, o: Outbound) -> None:
        """Close ``o``'s connection; its current message goes back to the queue if none of it
        was sent (so a connection refused or closed before acceptance loses nothing)."""
        if o.sock is not None:
            try:
                self._sel.unregister(o.sock)
            except (KeyError, ValueError):
                pass
            o.sock.close()
        if o.current is not None and not o.sent_any:
            with self._lock:
                o.queue.appendleft(o.current)
        elif o.current is not None:
            log.warning("[%s] data channel: a message to node %s was cut", self.node, o.node)
        o.sock, o.connected, o.current, o.got = None, False, None, 0
        o.retry_at = time.monotonic() + o.backoff
        o.backoff = min(o.backoff * 2, BACKOFF_S[1])

    def _hello(self, o: Outbound) -> bool:
        """Send the hello on ``o``'s fresh connection; False if it did not go whole."""
        assert o.sock is not None
        nonce = os.urandom(data_mac.NONCE_BYTES)
        tag = data_mac.hello_tag(self._key, self._public, o.public, nonce)
        hello = HELLO.pack(HELLO_MAGIC, self._public, nonce, tag)
        try:
            return o.sock.send(hello) == len(hello)
        except OSError:
            return False

    def _write(self, o: Outbound, events: int) -> None:
        if o.sock is None:
            return
        if not o.connected:
            err = o.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err or not self._hello(o):
                self._close_out(o)
                return
            o.connected = True
            self._watch(o, selectors.EVENT_READ)
            return
        if events & selectors.EVENT_READ:
            in_nonce = o.got < data_mac.NONCE_BYTES
            try:
                n = o.sock.recv_into(memoryview(o.nonce)[o.got :] if in_nonce else bytearray(4096))
            except (BlockingIOError, InterruptedError):
                n = -1  # nothing to read after all
            except OSError:
                n = 0
            if n == 0 or (n > 0 and not in_nonce):  # after the nonce, only a close or junk
                self._close_out(o)
                return
            if n > 0:
                o.got += n
                if o.got == data_mac.NONCE_BYTES:
                    o.backoff = BACKOFF_S[0]
        if o.got < data_mac.NONCE_BYTES:
            return
        while True:
            if not o.current:
                with self._lock:
                    o.current = o.queue.popleft() if o.queue else None
                    self._lock.notify_all()
                if o.current is None:
                    self._watch(o, selectors.EVENT_READ)
                    return
                self._seal(o, o.current)
            try:
                n = o.sock.sendmsg(o.current.left[:_IOV])
            except (BlockingIOError, InterruptedError):
                self._watch(o, selectors.EVENT_READ | selectors.EVENT_WRITE)
                return
            except OSError:
                self._close_out(o)
                return
            o.sent_any = o.sent_any or n > 0
            parts = o.current.left
            while parts and n >= len(parts[0]):
                n -= len(parts[0])
                parts.pop(0)
            if parts and n:
                parts[0] = parts[0][n:]
            if not parts:
                o.current = None

    def _seal(self, o: Outbound, msg: Outgoing) -> None:
        """Write ``msg``'s head tag for ``o``'s connection (its nonce, the next number)."""
        msg.prefix[-data_mac.TAG_BYTES :] = data_mac.head_tag(
            self._key,
            self._public,
            msg.receiver_public,
            self.node,
            msg.header,
            msg.sizes,
            bytes(o.nonce),
            o.seq,
        )
        o.seq += 1
        msg.left, o.sent_any = list(msg.wire), False
