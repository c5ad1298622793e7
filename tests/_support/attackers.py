"""Keyless attackers of an SMP's peer ports, run as their own process for as long as a test or
a benchmark runs (``python -m tests._support.attackers MODE ...``; SIGTERM ends one, which
then prints ``{"connects": N}`` on stdout):

- ``flood --pids FILE``: connects in bursts of 16 to every port the processes whose pids
  FILE lists (one line, comma-separated) listen on, as anyone on the host can find them in
  /proc/net/tcp; both are read again every 0.2 s, so a new generation's ports, and a
  replacement node's, are flooded as soon as they are bound. It holds the newest 64 per port.
- ``idle --to host:port,... --count N``: holds N idle TCP connections (spread over the
  endpoints), opening a new one for each the server closes.

:class:`Attacker` starts one and stops it (bounded)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    out = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        out |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def _connect(addr: tuple[str, int]) -> socket.socket | None:
    s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT
    s.setblocking(False)
    try:
        s.connect(addr)
    except BlockingIOError:
        pass
    except OSError:
        s.close()
        return None
    return s


def flood(pids_file: Path, stop: list[bool]) -> int:
    """Bursts of connects to every listening port of the processes ``pids_file`` lists until
    ``stop``; the connects made."""
    held: dict[tuple[str, int], deque[socket.socket]] = {}
    ports: set[tuple[str, int]] = set()
    seen_at, n = 0.0, 0
    while not stop:
        if time.monotonic() > seen_at + 0.2:
            pids = [int(x) for x in pids_file.read_text().split(",") if x.strip()]
            ports, seen_at = _listening(pids), time.monotonic()
        for addr in ports:
            q = held.setdefault(addr, deque())
            for _ in range(16):
                s = _connect(addr)
                if s is not None:
                    q.append(s)
                    n += 1
            while len(q) > 64:
                q.popleft().close()
        time.sleep(0.005)
    return n


def idle(to: list[tuple[str, int]], count: int, stop: list[bool]) -> int:
    """Hold ``count`` idle connections to ``to`` until ``stop``; connects made."""
    sel = selectors.DefaultSelector()
    n = 0

    def refill() -> None:
        nonlocal n
        while len(sel.get_map()) < count and not stop:
            s = _connect(to[n % len(to)])
            n += 1
            if s is not None:
                sel.register(s, selectors.EVENT_READ)

    refill()
    while not stop:
        for key, _ in sel.select(0.05):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                if s.recv(4096):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            sel.unregister(s)  # closed by the server: open another
            s.close()
        refill()
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["flood", "idle"])
    p.add_argument("--pids", default="")
    p.add_argument("--to", default="")
    p.add_argument("--count", type=int, default=1500)
    a = p.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16), hard))
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print("READY", flush=True)
    if a.mode == "flood":
        n = flood(Path(a.pids), stop)
    else:
        to = [(h, int(port)) for h, _, port in (e.rpartition(":") for e in a.to.split(","))]
        n = idle(to, a.count, stop)
    print(json.dumps({"connects": n}), flush=True)


class Attacker:
    """One attacker process (module docstring); :meth:`stop` ends it and returns its count of
    connects. Usable as a context manager (stopped on exit, even on failure)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._support.attackers", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the process's READY (bounded by its start)
        assert line.strip() == "READY", line
        self.connects = 0

    def stop(self) -> int:
        """End the attack (bounded); the connects it made."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        self.connects = json.loads(lines[-1])["connects"] if lines else self.connects
        return self.connects

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()
