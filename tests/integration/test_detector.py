"""The failure detector over real UDP sockets on loopback: three detectors, one goes silent."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from ftmem.launch.detector import FailureDetector, Heartbeat

KEY = b"j" * 32
NAMES = ["a", "b", "c"]


class Verdicts:
    """What the detectors published and acted on."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str]] = []
        self.lost: list[tuple[str, str, str]] = []
        self.changed = threading.Condition()
        self.store_up = True

    def publisher(self, who: str) -> Callable[[str], bool]:
        def publish(node: str) -> bool:
            with self.changed:
                if not self.store_up:
                    raise ConnectionError("the store does not answer")
                self.published.append((who, node))
            return True

        return publish

    def on_lost(self, who: str) -> Callable[[str, str], None]:
        def lost(node: str, why: str) -> None:
            with self.changed:
                self.lost.append((who, node, why))
                self.changed.notify_all()

        return lost

    def wait(self, count: int, timeout: float) -> list[tuple[str, str, str]]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.lost) >= count, timeout)
            return list(self.lost)


@contextmanager
def detectors(v: Verdicts, suspect_s: float = 0.5) -> Iterator[dict[str, FailureDetector]]:
    ds = {
        n: FailureDetector(
            n, "run", KEY, "127.0.0.1", timedelta(seconds=suspect_s), v.publisher(n), v.on_lost(n)
        )
        for n in NAMES
    }
    try:
        addrs = {n: d.start() for n, d in ds.items()}
        for n, d in ds.items():
            d.watch(0, n, addrs, NAMES)
        yield ds
    finally:
        for d in ds.values():
            d.close()


def test_a_silent_peer_is_declared_by_both_others_and_nothing_else_is() -> None:
    v = Verdicts()
    with detectors(v) as ds:
        time.sleep(1.5)  # three bounds of healthy heartbeats: no suspicion
        assert not v.lost and all(not d.suspected() for d in ds.values())
        t0 = time.monotonic()
        ds["c"].close(leaving=False)  # silent: no goodbye, no more heartbeats
        lost = v.wait(2, 10.0)
        took = time.monotonic() - t0
        assert sorted((who, node) for who, node, _ in lost) == [("a", "c"), ("b", "c")]
        assert {node for _, node in v.published} == {"c"}
        assert took < 5.0, took  # about the bound plus a heartbeat (0.6-0.8 s here)
        # Asked why a node left the rendezvous: the silent one is gone, the heard one is not.
        assert ds["a"].why_gone("c") is not None and ds["a"].why_gone("b") is None


def test_a_peer_that_says_goodbye_is_not_declared() -> None:
    v = Verdicts()
    with detectors(v) as ds:
        time.sleep(0.3)
        ds["c"].close()  # leaving
        time.sleep(1.5)
        assert not v.lost and all(not ds[n].suspected() for n in "ab")


def test_a_paused_detector_declares_nothing_and_an_unreachable_store_delays_the_verdict() -> None:
    v = Verdicts()
    with detectors(v) as ds:
        ds["a"].pause()
        v.store_up = False
        ds["c"].close(leaving=False)
        time.sleep(1.5)
        assert not v.lost  # a paused; b could not publish
        assert "c" in ds["b"].suspected()
        v.store_up = True
        lost = v.wait(1, 5.0)
        assert [(who, node) for who, node, _ in lost] == [("b", "c")]


def test_forged_and_replayed_datagrams_are_dropped_and_keep_nobody_alive() -> None:
    v = Verdicts()
    with detectors(v) as ds:
        target = ds["a"].address
        stop = threading.Event()

        def forge() -> None:
            """Speak for c: with a wrong key, and by replaying one of c's real heartbeats."""
            real = Heartbeat("run", "c", 1, 0).encode(KEY)
            fake = Heartbeat("run", "c", 10**9, 0).encode(b"x" * 32)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                while not stop.is_set():
                    s.sendto(fake, target)
                    s.sendto(real, target)
                    s.sendto(b"\0" * 5000, target)
                    time.sleep(0.01)

        ds["c"].close(leaving=False)
        t = threading.Thread(target=forge, daemon=True)
        t.start()
        try:
            lost = v.wait(2, 10.0)
        finally:
            stop.set()
            t.join(5)
        assert sorted((who, node) for who, node, _ in lost) == [("a", "c"), ("b", "c")]
        assert ds["a"].dropped > 10


def test_a_verdict_of_an_earlier_round_is_void_in_the_next() -> None:
    """c re-joined after a's verdict on it: b's leftover heartbeats of the earlier round,
    which still name c as lost, must not make a declare it again (a restart loop)."""
    v = Verdicts()
    with detectors(v) as ds:
        addrs = {n: d.address for n, d in ds.items()}
        for n, d in ds.items():
            d.watch(1, n, addrs, NAMES)
        stale = Heartbeat("run", "b", 10**6, 0, lost=("c",)).encode(KEY)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _ in range(5):
                s.sendto(stale, ds["a"].address)
                time.sleep(0.1)
        time.sleep(1.0)
        assert not v.lost and not v.published
