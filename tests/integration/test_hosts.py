"""The multi-host harness itself (tests._support.hosts): namespace hosts with their own
address, host name, /etc/hosts and /dev/shm; a host killed takes its processes and memory;
a cut link is silent; an impaired link delays and drops packets; nothing is left after."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._support.hosts import Hosts, impair_unavailable, unavailable

PROBE = """
import socket, sys, time
s = socket.socket(); s.settimeout(float(sys.argv[2]))
t0 = time.monotonic()
try:
    s.connect((sys.argv[1], 22222)); print("connected", time.monotonic() - t0)
except OSError as exc:
    print("failed", type(exc).__name__, time.monotonic() - t0)
"""
SERVER = """
import signal, socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 22222)); s.listen(8); print("up", flush=True); signal.pause()
"""

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


def _run(h: Hosts, i: int, code: str, *args: str) -> str:
    out = subprocess.run(
        h.command(i, [sys.executable, "-c", code, *args]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout + out.stderr


def _probe(h: Hosts, timeout: float) -> list[str]:
    return _run(h, 0, PROBE, "h1", str(timeout)).split()


def test_hosts_have_their_own_name_address_shm_and_die_whole() -> None:
    with Hosts(2) as h:
        out = _run(
            h,
            1,
            "import socket, os; open('/dev/shm/mine', 'w');"
            "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
            " socket.gethostbyname('h0'))",
        )
        assert out.split() == ["h1", h.addr(1), h.addr(0)]
        assert [p.name for p in h.shm_dir(1).iterdir()] == ["mine"]
        assert list(h.shm_dir(0).iterdir()) == []
        server = subprocess.Popen(
            h.command(1, [sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert _probe(h, 5)[0] == "connected"
        h.cut(1)  # silent: no reset, the connect times out
        assert _probe(h, 1)[:2] == ["failed", "TimeoutError"]
        h.heal(1)
        assert _probe(h, 5)[0] == "connected"
        h.kill(1)
        assert server.wait(10) == -9 and h.pids(1) == set()
        assert list(h.shm_dir(1).iterdir()) == []
        server.stdout.close()
        root, names = h.root, [h.netns(i) for i in range(2)] + [h.bridge_ns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names) and not root.exists()
    assert not any((Path("/etc/netns") / n).exists() for n in names)


@pytest.mark.skipif(impair_unavailable() is not None, reason=str(impair_unavailable()))
def test_an_impaired_link_delays_and_drops() -> None:
    with Hosts(2) as h:
        server = subprocess.Popen(
            h.command(1, [sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        h.impair(1, delay_ms=150)
        out = _probe(h, 10)
        assert out[0] == "connected" and float(out[1]) >= 0.3  # SYN and SYN-ACK held 150 ms
        h.impair(1, delay_ms=0, loss=1.0)
        assert _probe(h, 1)[:2] == ["failed", "TimeoutError"]
        h.unimpair(1)
        assert _probe(h, 5)[0] == "connected"
        h.kill(1)
        server.wait(10)
        server.stdout.close()
