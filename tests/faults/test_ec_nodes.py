"""Whole nodes lost and replaced: ftmem-launch agents on loopback rebuild from their peers.

Each node is an ``ftmem-launch`` agent with one rank of the test workload. A node is
lost for real: SIGKILL of its agent, SMP and rank at once, and its shared memory removed (a
dead machine takes its memory with it). A replacement agent with the lost node's name joins;
its SMP rebuilds the node's snapshot from the peers' data and parity before its rank starts,
and the run must end with the digests of a failure-free run of the same world size.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

from ftmem.protocol.smp_client import SmpClient
from tests._support.launcher import Launcher
from tests._support.nodes import SCRIPT, Nodes, reference


def test_four_nodes_lose_two_at_once_same_digest(launcher_env: Launcher) -> None:
    """Every SMP encodes in a worker process (``--ftmem-ec-encode-workers 1``); the two
    replacement nodes rebuild from that parity."""
    want = reference(launcher_env, 4)
    flags = ["--ftmem-ec-parity", "2", "--ftmem-ec-encode-workers", "1"]
    nodes = Nodes(launcher_env, 4, flags, script=[*SCRIPT, "--fast-after-resume"])
    nodes.start_all()
    nodes.wait_protected(5)
    status = [nodes.protection(i) for i in range(4)]
    assert all(ex is not None for ex in status), status
    got = [ex for ex in status if ex is not None]
    assert all(ex.encode_workers == 1 and ex.worker_fallbacks == 0 for ex in got), status
    # The snapshots are small (one stripe a round): not every node encodes one.
    assert sum(ex.worker_stripes for ex in got) > 0, status
    nodes.lose(1)
    nodes.lose(3)
    nodes.start(1)
    nodes.start(3)
    for i in (1, 3):
        nodes.agents[i].wait_for(r"REBUILT step (\d+) of this node", 180)
    assert nodes.finish() == want


def test_more_than_m_nodes_lost_stops_with_a_clear_message(launcher_env: Launcher) -> None:
    nodes = Nodes(launcher_env, 3, ["--ftmem-ec-parity", "1"])
    nodes.start_all()
    nodes.wait_protected(3)
    nodes.lose(1)
    nodes.lose(2)
    nodes.start(1)
    nodes.start(2)
    for i in range(3):
        code = nodes.agents[i].wait(180)
        assert code != 0
        assert (
            "UNRECOVERABLE" in nodes.agents[i].text() and "more than m=1" in nodes.agents[i].text()
        )


def test_stopped_exchange_killed_smp_and_lost_node_are_recovered_same_digest(
    launcher_env: Launcher,
) -> None:
    """Three faults of one 3-node run (a run of its own each would take minutes on 2 cores).

    1. Node 2's protection thread raises at its first protection round (an unexpected error,
       as a bug would): its agent notices, restarts the ranks from memory with a new mesh,
       the SMP replaces the thread, and protection goes on.
    2. Node 1's SMP is SIGKILLed: the new SMP rebuilds the node's snapshot from its peers.
    3. Node 1 is lost whole (agent, SMP, rank and shared memory) and a replacement with its
       name joins: its SMP rebuilds the snapshot before its rank starts and resumes from it.
    """
    want = reference(launcher_env, 3)
    crash = {"FTMEM_FAULT": "in_protect:rank=2:fault=crash"}
    nodes = Nodes(launcher_env, 3, ["--ftmem-ec-parity", "1"], env={2: crash})
    nodes.start_all()
    nodes.agents[2].wait_for(r"PROTECTION STOPPED: the SMP's erasure-coding thread", 120)
    nodes.agents[2].wait_for(r"generation \d+: started ranks", 120, count=2)
    nodes.wait_protected(5)
    os.kill(_smp_pid(nodes, 1), signal.SIGKILL)
    rebuilt = int(nodes.agents[1].wait_for(r"REBUILT step (\d+) of this node", 180)[0].group(1))
    nodes.wait_protected(rebuilt + 2)  # protection goes on after the rebuild
    nodes.lose(1)
    nodes.start(1)
    m = nodes.agents[1].wait_for(r"REBUILT step (\d+) of this node", 180)[0]
    nodes.agents[1].wait_for(rf"\[rank 1\] resumed from step {int(m.group(1))}", 180)
    assert nodes.finish() == want
    run_dir = Path(nodes.run_dir(2))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["event"] == "protection_failed"]
    assert len(failed) == 1 and "InjectedCrash" in failed[0]["error"]
    assert "replacing the protection thread that stopped" in (run_dir / "smp.log").read_text()


def _smp_pid(nodes: Nodes, i: int) -> int:
    with SmpClient(nodes.run_dir(i), timeout=timedelta(seconds=5)) as c:
        return c.status().pid
