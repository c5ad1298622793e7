"""The agent's metrics server under idle and slow connections (real sockets, the real server):
100 idle connections cost no thread, the oldest beyond the bound are closed at once, every
other is closed after the per-connection deadline (also one that trickles its request a byte at
a time), and a scrape is answered while they are held."""

from __future__ import annotations

import os
import select
import socket
import time
import urllib.error
import urllib.request

import pytest

from ftmem.launch.metrics import AgentMetrics, MetricsServer

pytest.importorskip("prometheus_client")

TIMEOUT_S = 2.0
BOUND = 32


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server closed ``s`` (EOF or reset), without blocking."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def _wait_closed(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """Those of ``socks`` still open after ``within`` seconds (waits less once all closed)."""
    open_ = list(socks)
    deadline = time.monotonic() + within
    while open_ and time.monotonic() < deadline:
        open_ = [s for s in open_ if not _closed_by_server(s)]
        time.sleep(0.05)
    return open_


def test_idle_connections_hold_no_thread_are_closed_and_a_scrape_is_answered() -> None:
    server = MetricsServer(
        AgentMetrics("n0", lambda: None), 0, timeout=TIMEOUT_S, max_connections=BOUND
    )
    before = _threads()
    server.start()
    idle: list[socket.socket] = []
    slow = socket.socket()
    try:
        for _ in range(100):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        slow.connect(("127.0.0.1", server.port))
        # The oldest 100 + 1 - BOUND were closed as newer ones came; the server kept one thread.
        still = _wait_closed(idle, TIMEOUT_S / 4)
        assert len(still) >= BOUND - 2, len(still)
        assert _threads() <= before + 1
        # A scrape is answered while the others are held (it closes the oldest of them).
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert r.status == 200
            assert b'ftmem_restarts_total{cause="hang",node="n0"} 0.0' in r.read()
        assert _threads() <= before + 1
        # A request trickled a byte at a time does not extend the deadline.
        trickle_until = time.monotonic() + TIMEOUT_S + 10
        while time.monotonic() < trickle_until and not _closed_by_server(slow):
            try:
                slow.send(b"G")
            except OSError:
                break
            time.sleep(0.2)
        assert time.monotonic() < trickle_until, "a trickling connection was never closed"
        # Every idle connection is closed after the deadline (bounded wait, generous).
        assert _wait_closed(idle, TIMEOUT_S + 10) == []
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/nope", timeout=10)
    finally:
        for s in [*idle, slow]:
            s.close()
        server.stop()
        server.stop()  # idempotent
    deadline = time.monotonic() + 10
    while _threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _threads() <= before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2)
