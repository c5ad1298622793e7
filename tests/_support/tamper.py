"""A man in the middle for the peer data channel: a TCP proxy that flips one byte in the body
of data-channel buffers (data_channel.py's wire format: a 92-byte hello first, then a 12-byte prelude of magic, name
length u16, buffer count u16 and header length u32, little endian; the buffer sizes as u64; the
name, header and a 32-byte head tag; the buffers; a 32-byte tag), never in the framing, so the
connection lives and only the tagged message is refused."""

from __future__ import annotations

import select
import socket
import struct
import threading

_TAG = 32
_HELLO = 92  # the connection's hello, before its first message


class _Flipper:
    """Follows the messages of one direction of a data-channel stream and flips a byte in the
    middle of buffers of at least ``min_size`` bytes (every one, or the first)."""

    def __init__(self, every: bool, min_size: int) -> None:
        self.every, self.min_size = every, min_size
        self.flips = 0
        self._want, self._got = _HELLO, bytearray()  # the bytes of the current framing part
        self._state = "hello"
        self._sizes: list[int] = []
        self._left, self._pos, self._flip_at = 0, 0, -1
        self._head = 0

    def _framing(self, done: bytes) -> None:
        if self._state == "hello":
            self._state, self._want = "prelude", 12
        elif self._state == "prelude":
            _, name_n, nbuf, header_n = struct.unpack("<4sHHI", done)
            self._head = nbuf * 8
            self._state, self._want = "head", nbuf * 8 + name_n + header_n + _TAG
        elif self._state == "head":
            self._sizes = list(struct.unpack_from(f"<{self._head // 8}Q", done))
            self._next_buffer()
        else:  # the tag
            self._state, self._want = "prelude", 12

    def _next_buffer(self) -> None:
        if not self._sizes:
            self._state, self._want = "tag", _TAG
            return
        self._left = self._sizes.pop(0)
        flip = self._left >= self.min_size and (self.every or self.flips == 0)
        self._state, self._pos, self._flip_at = "body", 0, self._left // 2 if flip else -1
        if not self._left:
            self._next_buffer()

    def feed(self, chunk: bytearray) -> None:
        i = 0
        while i < len(chunk):
            if self._state == "body":
                n = min(self._left, len(chunk) - i)
                if 0 <= self._flip_at - self._pos < n:
                    chunk[i + self._flip_at - self._pos] ^= 0x01
                    self.flips += 1
                self._pos, self._left, i = self._pos + n, self._left - n, i + n
                if not self._left:
                    self._next_buffer()
                continue
            n = min(self._want - len(self._got), len(chunk) - i)
            self._got += chunk[i : i + n]
            i += n
            if len(self._got) == self._want:
                done, self._got = bytes(self._got), bytearray()
                self._framing(done)


class TamperingProxy:
    """Accepts one connection, relays it to ``target`` (``tcp://host:port``), and flips a
    byte in message frames of ``min_size`` bytes or more that the client sends: the first
    only, or ``every`` one. :attr:`endpoint` is where to connect; :meth:`close` stops it."""

    def __init__(self, target: str, every: bool = False, min_size: int = 4096) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.flipper = _Flipper(every, min_size)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def flips(self) -> int:
        """Bytes flipped so far (one per tampered message)."""
        return self.flipper.flips

    def _run(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:  # closed before anyone connected
            return
        server = socket.create_connection(self.target, timeout=10)
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.05)
                for s in ready:
                    chunk = bytearray(s.recv(1 << 16))
                    if not chunk:
                        return
                    if s is client:
                        self.flipper.feed(chunk)
                        server.sendall(chunk)
                    else:
                        client.sendall(chunk)
        finally:
            client.close()
            server.close()

    def close(self) -> None:
        """Stop relaying and close both sides (bounded)."""
        self._stop.set()
        self.listener.close()
        self._thread.join(10)


def data_message(
    name: bytes, header: bytes, buffers: list[bytes], head_tag: bytes = b"", tag: bytes = b""
) -> bytes:
    """One data-channel message as the wire carries it, with made-up tags (random unless
    given): what anyone without the job's key can send."""
    import os

    sizes = struct.pack(f"<{len(buffers)}Q", *(len(b) for b in buffers))
    prelude = struct.pack("<4sHHI", b"FTD1", len(name), len(buffers), len(header))
    return b"".join(
        [
            prelude,
            sizes,
            name,
            header,
            head_tag or os.urandom(_TAG),
            *buffers,
            tag or os.urandom(_TAG),
        ]
    )


def send_raw(endpoint: str, data: bytes, timeout: float = 5.0) -> None:
    """Connect to ``tcp://host:port``, send ``data``, close."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
