"""The receiving half of the data channel (wire format and limits: data_channel.py): accept,
admit, read each connection through its stages into buffers checked before they are made."""

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

from ftmem.exchange import admission, data_mac
from ftmem.exchange.data_send import HELLO, HELLO_MAGIC, MAGIC, PRELUDE

log = logging.getLogger("ftmem.exchange.data_channel")

MAX_NAME = 64
MAX_BUFFERS = 8
MAX_HEADER = 1 << 20
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


def _buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes from the heap, not zeroed (it is about to be
    overwritten). With large blocks kept on the heap (:func:`~ftmem.exchange.codec.tune_malloc`,
    applied at :meth:`DataChannel.start`) a freed message's memory serves the next without new
    page faults: fresh anonymous maps would cost the receiver a fault per page."""
    return np.empty(n, np.uint8).data


@dataclass(eq=False, slots=True)
class Inbound:
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
    header: bytes = b""
    sizes: tuple[int, ...] = ()
    buffers: list[memoryview] = field(default_factory=list)
    reading: bool = True


class Receiver:
    """The receiving half of :class:`~ftmem.exchange.data_channel.DataChannel` (its I/O thread
    calls these)."""

    node: str
    _key: bytes
    _public: bytes
    max_message_bytes: int
    admit_wait_s: float
    dropped: int
    forged: int
    refused: deque[Refused]
    _peer_keys: dict[str, bytes] | None
    _by_public: dict[bytes, str]
    _seen: dict[bytes, None]
    _allowed: frozenset[str] | None
    _drops: admission.DropLog
    _accept_at: float
    _lock: threading.Condition
    _inbox: deque[Received]
    _in: list[Inbound]
    _sel: selectors.BaseSelector
    _ready_w: int
    _paused: bool
    _listener: socket.socket | None

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
            c = Inbound(sock, ip, time.monotonic() + HEAD_S)
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

    def _reading(self, c: Inbound, on: bool) -> None:
        if on != c.reading:
            c.reading = on
            if on:
                self._sel.register(c.sock, selectors.EVENT_READ, c)
                if c.due < math.inf:
                    c.due = max(c.due, time.monotonic() + HEAD_S)
            else:
                self._sel.unregister(c.sock)

    def _drop(self, c: Inbound, why: str) -> None:
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

    def _read(self, c: Inbound) -> None:
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

    def _advance(self, c: Inbound) -> None:
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
            text = name.decode("ascii", "replace") if name.isascii() else "?"
            self._after_head(c, text, raw[-data_mac.TAG_BYTES :])
        elif c.stage == "body":
            c.buffers.append(c.target)
            if len(c.buffers) < len(c.sizes):
                self._expect(c, "body", None)
            else:
                self._expect(c, "tag", bytearray(data_mac.TAG_BYTES))
        elif c.stage == "tag":
            self._deliver(c, bytes(c.target))

    def _expect(self, c: Inbound, stage: str, buf: bytearray | None) -> None:
        c.stage, c.got = stage, 0
        c.target = memoryview(buf) if buf is not None else _buffer(c.sizes[len(c.buffers)])
        if stage == "body" and not len(c.target):  # an empty buffer: nothing to read
            self._advance(c)

    def _after_hello(self, c: Inbound) -> None:
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

    def _after_head(self, c: Inbound, name: str, head: bytes) -> None:
        """Check a head (its sender's ``name`` and ``head`` tag), then read the body."""
        public = (self._peer_keys or {}).get(name)
        want = b""
        if public is not None and name == c.node:
            want = data_mac.head_tag(
                self._key, public, self._public, name, c.header, c.sizes, c.nonce, c.seq
            )
        if not want or not hmac.compare_digest(want, head):
            self.forged += 1
            if want:  # a member's, over that node's own connection (anyone can name one)
                self.refused.append(Refused(name, c.header))
            self._drop(
                c,
                f"a head naming node {name[:16]!r} without its tag "
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

    def _deliver(self, c: Inbound, tag: bytes) -> None:
        got = Received(c.node, c.header, c.buffers, tag)
        c.buffers, c.header, c.due = [], b"", math.inf
        self._expect(c, "prelude", bytearray(PRELUDE.size))
        with self._lock:
            self._inbox.append(got)
            full = len(self._inbox) >= RECV_QUEUE
        os.write(self._ready_w, b"m")
        if full:
            self._pause(True)

    def _pause(self, paused: bool) -> None:
        """Stop (or resume) reading key holders' connections while the inbox is full."""
        if paused != self._paused:
            self._paused = paused
            for c in self._in:
                if c.node and c.stage != "parked":
                    self._reading(c, not paused)
