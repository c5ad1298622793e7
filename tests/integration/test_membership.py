"""The agent's rendezvous handler wrapper (ftmem.launch.membership) against a real c10d
rendezvous whose TCPStore runs in another process, stopped (SIGSTOP) and resumed: the
agent's loop is never held longer than its patience, the outage is logged once, and the
handler answers again when the store does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from ftmem.launch.membership import MembershipWatch
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
