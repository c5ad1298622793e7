"""Erasure-coded protection across nodes over real CURVE sockets on loopback (a thread per node):
protect a step, lose up to m nodes, rebuild their snapshots and parity bitwise from the rest."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest

from ftmem.errors import UnrecoverableError
from ftmem.exchange import keys
from ftmem.exchange.placement import plan_group
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.zmq_transport import ZmqPeerTransport

STRIPE = 256 << 10


def run_threads(fns: list[Callable[[], None]], timeout: float = 60.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(f), daemon=True) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a node thread hung"
    if errors:
        raise errors[0]


def scenario(n: int, m: int, sizes: list[int], lost: set[int]) -> None:
    plan = plan_group(list(range(n)), m)
    key = keys.generate()
    data = [os.urandom(s) for s in sizes]
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    eps = {str(i): t.start() for i, t in enumerate(transports)}
    for t in transports:
        t.connect(eps)
    prots = [GroupProtector(i, plan, transports[i], STRIPE, timeout_s=30) for i in range(n)]
    parity_before: dict[int, dict[tuple[int, int], bytes]] = {}
    done = threading.Event()
    replacements: list[ZmqPeerTransport] = []
    try:
        run_threads([lambda i=i: prots[i].protect(1, memoryview(data[i])) for i in range(n)])
        assert all(p.is_protected(1) for p in prots)
        for i in range(n):
            parity_before[i] = dict(prots[i].steps[1].parity)
        # Lose nodes: their transports close; replacements bind the same ports, empty.
        for i in lost:
            transports[i].close()
            port = int(eps[str(i)].rsplit(":", 1)[1])
            t = ZmqPeerTransport(str(i), key, port=port)
            t.start()
            t.connect(eps)
            replacements.append(t)
            prots[i] = GroupProtector(i, plan, t, STRIPE, timeout_s=30)
        survivors = [i for i in range(n) if i not in lost]
        rebuilt: dict[int, bytes] = {}

        def rebuild(i: int) -> None:
            rebuilt[i] = prots[i].rebuild(1, lost, source=survivors[0])

        def serve(i: int) -> None:
            prots[i].serve(done.is_set, poll_s=0.05)

        def rebuild_all() -> None:
            try:
                run_threads([lambda i=i: rebuild(i) for i in lost])
            finally:
                done.set()

        run_threads([rebuild_all, *[lambda i=i: serve(i) for i in survivors]])
        for i in lost:
            assert rebuilt[i] == data[i], f"node {i}'s snapshot was not rebuilt bitwise"
            assert prots[i].steps[1].parity == parity_before[i], f"node {i}'s parity differs"
    finally:
        done.set()
        for t in transports + replacements:
            t.close()


def test_three_nodes_one_lost() -> None:
    scenario(3, 1, [3_300_000, 1_000_000, 2_500_000], {2})


def test_four_nodes_two_lost_at_once() -> None:
    scenario(4, 2, [1_200_000, 2_000_000, 700_000, 2_000_000], {1, 3})


def test_more_than_m_lost_is_unrecoverable() -> None:
    with pytest.raises(UnrecoverableError, match="cannot rebuild"):
        scenario(3, 1, [500_000, 500_000, 500_000], {0, 2})


def test_parity_is_about_m_over_n_minus_m() -> None:
    n, m, size = 4, 2, 2_000_000
    plan = plan_group(list(range(n)), m)
    key = keys.generate()
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    try:
        eps = {str(i): t.start() for i, t in enumerate(transports)}
        for t in transports:
            t.connect(eps)
        prots = [GroupProtector(i, plan, transports[i], STRIPE, timeout_s=30) for i in range(n)]
        blobs = [os.urandom(size) for _ in range(n)]
        run_threads([lambda i=i: prots[i].protect(7, memoryview(blobs[i])) for i in range(n)])
        for p in prots:
            ratio = p.parity_bytes(7) / size
            assert abs(ratio - m / (n - m)) < 0.15, ratio
    finally:
        for t in transports:
            t.close()
