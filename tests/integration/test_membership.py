"""The agent's rendezvous handler wrapper (ftmem.launch.membership) against a real c10d
rendezvous whose TCPStore runs in another process, stopped (SIGSTOP) and resumed: the
agent's loop is never held longer than its patience, the outage is logged once, and the
handler answers again when the store does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from ftmem.launch.elastic_compat import rendezvous_members
from ftmem.launch.membership import MembershipWatch
from ftmem.launch.state_guard import expire_keep_alive
from tests._support.launcher import free_port, pid_gone

STORE = """
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
             timeout=timedelta(seconds=60))
print("up", flush=True)
signal.pause()
"""


def _c10d_handler(port: int, run_id: str, *, max_nodes: int, is_host: bool) -> Any:
    """elastic's c10d rendezvous handler on a store at 127.0.0.1:``port``."""
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=max_nodes,
        is_host=is_host,
    )
    return get_rendezvous_handler(params)


def _until(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_a_store_that_stops_answering_holds_the_agent_at_most_its_patience() -> None:
    port = free_port()
    store = subprocess.Popen(
        [sys.executable, "-c", STORE, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert store.stdout is not None and store.stdout.readline().strip() == "up"
        events: list[tuple[str, dict[str, Any]]] = []
        watch = MembershipWatch(
            _c10d_handler(port, "membership", max_nodes=1, is_host=False),
            "n0",
            patience=timedelta(seconds=0.5),
            on_event=lambda name, **fields: events.append((name, fields)),
        )
        watch.next_rendezvous()  # one node: the round completes at once
        assert watch.num_nodes_waiting() == 0 and events == []
        os.kill(store.pid, signal.SIGSTOP)
        slowest = 0.0

        def unreachable() -> bool:
            nonlocal slowest
            t0 = time.monotonic()
            assert watch.num_nodes_waiting() == 0
            slowest = max(slowest, time.monotonic() - t0)
            return any(name == "store_unreachable" for name, _ in events)

        _until(unreachable, 15)
        for _ in range(5):  # the outage goes on: logged once, each call bounded
            unreachable()
        assert [n for n, _ in events] == ["store_unreachable"]
        assert slowest < 0.5 + 1.0  # the patience, plus scheduling on a busy machine
        os.kill(store.pid, signal.SIGCONT)
        _until(lambda: watch.num_nodes_waiting() == 0 and len(events) == 2, 15)
        assert events[1][0] == "store_reachable" and events[1][1]["after_s"] > 0
        watch.shutdown()
    finally:
        os.kill(store.pid, signal.SIGCONT)
        store.kill()
        store.wait(10)
        assert pid_gone(store.pid)
        if store.stdout is not None:
            store.stdout.close()


def test_the_wrapper_is_the_handler_elastic_sees() -> None:
    inner = _c10d_handler(free_port(), "wrapped", max_nodes=2, is_host=True)
    watch = MembershipWatch(inner, "n0")
    assert watch.get_backend() == "c10d" and watch.get_run_id() == "wrapped"
    assert watch.settings is inner.settings  # elastic's internals, read through the wrapper
    assert not watch.is_closed()
    with pytest.raises(AttributeError):
        _ = watch.no_such_attribute
    watch.shutdown()


def test_a_node_another_reader_dropped_first_is_named_lost_when_the_detector_agrees() -> None:
    """Three nodes of a real c10d rendezvous. Node 1 publishes node 2 lost (as its failure
    detector does: the keep-alive marked expired) and re-joins at once, so its read drops
    node 2 from the state before node 0 reads it: node 0 then finds node 2 gone but not dead.
    Node 1 is gone too (it re-joins), and its heartbeats are still heard: a restart. Node 2's
    are not: node 0 names it lost, with its detector's why, and not node 1."""
    port = free_port()
    params = {"keep_alive_interval": 600, "join_timeout": 60}  # no keep-alive revives node 2
    handlers = [
        get_rendezvous_handler(
            RendezvousParameters(
                backend="c10d",
                endpoint=f"127.0.0.1:{port}",
                run_id="dropped-first",
                min_nodes=3,
                max_nodes=3,
                is_host=i == 0,
                **params,
            )
        )
        for i in range(3)
    ]
    events: list[tuple[str, dict[str, Any]]] = []
    watch = MembershipWatch(
        handlers[0], "n0", on_event=lambda name, **fields: events.append((name, fields))
    )
    joins = [threading.Thread(target=h.next_rendezvous, daemon=True) for h in handlers[1:]]
    rejoin = threading.Thread(target=_joined_or_closed, args=(handlers[1],), daemon=True)
    try:
        for t in joins:
            t.start()
        watch.next_rendezvous()
        for t in joins:
            t.join(60)
            assert not t.is_alive(), "round 0 did not form"
        n1, n2 = (rendezvous_members(h).me for h in handlers[1:])  # type: ignore[union-attr]
        watch.why_gone = lambda node: "no heartbeat for 1.0 s" if node == n2 else None
        assert expire_keep_alive(handlers[1], n2)
        rejoin.start()

        def node_1_left() -> bool:  # its exit from the round, written: node 0 reads only now
            seen = rendezvous_members(handlers[1])
            return seen is not None and {n1, n2}.isdisjoint(seen.participants)

        _until(node_1_left, 30)
        _until(lambda: watch.num_nodes_waiting() >= 1, 30)
        after = rendezvous_members(handlers[0])
        assert after is not None and {n1, n2}.isdisjoint(after.participants)
        assert watch.lost == [n2]  # node 1 left too, to re-join: not lost
        assert [(n, f["peer"], f["declared"], f["why"]) for n, f in events] == [
            ("machine_lost", n2, True, "no heartbeat for 1.0 s")
        ]
    finally:
        watch.shutdown()  # closes the rendezvous: node 1's join ends
        rejoin.join(60) if rejoin.ident is not None else None
        assert not rejoin.is_alive()


def _joined_or_closed(handler: Any) -> None:
    """A re-join that ends when the rendezvous closes."""
    with contextlib.suppress(RendezvousClosedError):
        handler.next_rendezvous()
