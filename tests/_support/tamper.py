"""A man in the middle for the peer data channel: a TCP proxy that flips one byte in the body
of ZeroMQ message frames (ZMTP 3: a 64-byte greeting, then frames of a flags byte, a 1- or
8-byte size and the body), never in the framing, so the connection lives and only the tagged
message is refused."""

from __future__ import annotations

import select
import socket
import threading

_MORE_LONG = 0x02
_COMMAND = 0x04


class _Flipper:
    """Tracks the ZMTP frames of one direction of a stream and flips a byte in the middle of
    the body of message frames of at least ``min_size`` bytes (every one, or the first)."""

    def __init__(self, every: bool, min_size: int) -> None:
        self.every, self.min_size = every, min_size
        self.flips = 0
        self._state, self._left = "greeting", 64
        self._flags, self._size = 0, bytearray()
        self._pos, self._flip_at = 0, -1

    def feed(self, chunk: bytearray) -> None:
        i = 0
        while i < len(chunk):
            if self._state == "greeting":
                n = min(self._left, len(chunk) - i)
                i, self._left = i + n, self._left - n
                if not self._left:
                    self._state = "flags"
            elif self._state == "flags":
                self._flags, self._size = chunk[i], bytearray()
                i, self._state = i + 1, "size"
            elif self._state == "size":
                width = 8 if self._flags & _MORE_LONG else 1
                n = min(width - len(self._size), len(chunk) - i)
                self._size += chunk[i : i + n]
                i += n
                if len(self._size) == width:
                    self._left = int.from_bytes(self._size, "big")
                    flip = not self._flags & _COMMAND and self._left >= self.min_size
                    flip = flip and (self.every or self.flips == 0)
                    self._pos, self._flip_at = 0, self._left // 2 if flip else -1
                    self._state = "body" if self._left else "flags"
            else:
                n = min(self._left, len(chunk) - i)
                if 0 <= self._flip_at - self._pos < n:
                    chunk[i + self._flip_at - self._pos] ^= 0x01
                    self.flips += 1
                self._pos, self._left, i = self._pos + n, self._left - n, i + n
                if not self._left:
                    self._state = "flags"


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
