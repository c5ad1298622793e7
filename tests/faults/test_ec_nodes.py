"""Whole nodes lost and replaced: ftmem-launch agents on loopback rebuild from their peers.

Each node is an ``ftmem-launch`` agent with one rank of ``examples/train_gpt.py``. A node is
lost for real: SIGKILL of its agent, SMP and rank at once, and its shared memory removed (a
dead machine takes its memory with it). A replacement agent with the lost node's name joins;
its SMP rebuilds the node's snapshot from the peers' data and parity before its rank starts,
and the run must end with the digests of a failure-free run of the same world size.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import psutil

from ftmem.errors import FtmemError
from ftmem.protocol.smp_client import SmpClient
from tests.integration.test_launcher_support import (
    EXAMPLE,
    TINY,
    Launch,
    Launcher,
    digests,
    free_port,
    launcher_env,
)

__all__ = ["launcher_env"]  # the fixture

STEPS = 40
SCRIPT = [str(EXAMPLE), "--steps", str(STEPS), "--step-delay", "0.15", *TINY]
_REFERENCE: dict[int, dict[int, str]] = {}


def reference(launcher: Launcher, nproc: int) -> dict[int, str]:
    """Digests of a failure-free single-node run with ``nproc`` ranks (same world size)."""
    if nproc not in _REFERENCE:
        rid = launcher.new_run_id()
        ref = launcher.single_node(
            rid,
            nproc,
            ["--ftmem-ec-parity", "0"],
            [str(EXAMPLE), "--steps", str(STEPS), *TINY],
            name=f"reference{nproc}",
        )
        assert ref.wait(180) == 0, ref.text()[-3000:]
        _REFERENCE[nproc] = digests(ref.text())
        assert len(_REFERENCE[nproc]) == nproc
    return _REFERENCE[nproc]


class Nodes:
    """Agents of one multi-node run; node i is named n<i> and holds global rank i."""

    def __init__(
        self, launcher: Launcher, n: int, extra: list[str], script: list[str] = SCRIPT
    ) -> None:
        self.script = script
        self.launcher = launcher
        self.n = n
        self.extra = extra
        self.rid = launcher.new_run_id()
        self.port = free_port()
        self.agents: dict[int, Launch] = {}
        self.starts: dict[int, int] = {}
        self.host_start = 1
        """Node 0's start that hosts the rendezvous store (a whole new job hosts it again)."""

    def run_dir(self, i: int) -> str:
        return str(self.launcher.tmp / f"n{i}-{self.starts[i]}-rd")

    def start(self, i: int) -> Launch:
        self.starts[i] = self.starts.get(i, 0) + 1
        launch = self.launcher.start(
            [
                "--nnodes",
                str(self.n),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{self.port}",
                "--rdzv-id",
                self.rid,
                "--rdzv-conf",
                f"is_host={1 if i == 0 and self.starts[i] == self.host_start else 0}",
                "--monitor-interval",
                "0.1",
                "--ftmem-node",
                f"n{i}",
                "--ftmem-run-dir",
                self.run_dir(i),
                "--ftmem-peer-host",
                "127.0.0.1",
                *(a.replace("{i}", str(i)) for a in self.extra),  # per-node values
                *self.script,
            ],
            f"n{i}-{self.starts[i]}",
        )
        self.agents[i] = launch
        return launch

    def start_all(self, new_job: bool = False) -> None:
        """Start every node; ``new_job``: after every node was lost (new rendezvous host)."""
        if new_job:
            self.port = free_port()
            self.host_start = self.starts.get(0, 0) + 1
        self.start(0).wait_for(r"SMP pid \d+ ready", 60)
        for i in range(1, self.n):
            # Node order in the first round is by join order; stable ranks keep it after.
            time.sleep(0.5)
            self.start(i)
        for i in range(self.n):
            self.agents[i].wait_for(r"generation \d+: started ranks", 120)

    def exchange(self, i: int) -> dict[str, object]:
        try:
            with SmpClient(self.run_dir(i), timeout=timedelta(seconds=5)) as c:
                st = c.status()
        except FtmemError:
            return {}
        return dict(st.get("exchange", {}))

    def wait_protected(self, at_least: int, timeout: float = 120.0) -> int:
        """Wait until every node's SMP reports a protected step >= ``at_least``."""
        deadline = time.monotonic() + timeout
        while True:
            steps = [self.exchange(i).get("protected_step") for i in range(self.n)]
            if all(isinstance(s, int) and s >= at_least for s in steps):
                return min(s for s in steps if isinstance(s, int))
            assert time.monotonic() < deadline, f"protected steps {steps} never reached {at_least}"
            time.sleep(0.2)

    def lose(self, i: int) -> None:
        """Node i dies: every process of it SIGKILLed at once, its shared memory gone."""
        launch = self.agents[i]
        procs = [launch.pid, *launch.descendants()]
        for pid in procs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launch.popen.wait(10)
        psutil.wait_procs([p for p in map(_proc, procs) if p is not None], timeout=10)
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ftmem-{self.rid}-n{i}-"):
                os.unlink(f"/dev/shm/{name}")

    def finish(self, timeout: float = 240.0) -> dict[int, str]:
        out: dict[int, str] = {}
        for launch in self.agents.values():
            assert launch.wait(timeout) == 0, launch.text()[-4000:]
            out.update(digests(launch.text()))
        return out


def _proc(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_three_nodes_lose_one_replacement_rebuilds_same_digest(launcher_env: Launcher) -> None:
    want = reference(launcher_env, 3)
    nodes = Nodes(launcher_env, 3, ["--ftmem-ec-parity", "1"])
    nodes.start_all()
    nodes.wait_protected(5)
    nodes.lose(2)
    nodes.start(2)
    m = nodes.agents[2].wait_for(r"REBUILT step (\d+) of this node", 180)[0]
    step = int(m.group(1))
    nodes.agents[2].wait_for(rf"\[rank 2\] resumed from step {step}", 180)
    assert nodes.finish() == want


def test_four_nodes_lose_two_at_once_same_digest(launcher_env: Launcher) -> None:
    want = reference(launcher_env, 4)
    nodes = Nodes(launcher_env, 4, ["--ftmem-ec-parity", "2"])
    nodes.start_all()
    nodes.wait_protected(5)
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


def test_smp_killed_on_a_surviving_node_is_rebuilt_from_peers(launcher_env: Launcher) -> None:
    want = reference(launcher_env, 3)
    nodes = Nodes(launcher_env, 3, ["--ftmem-ec-parity", "1"])
    nodes.start_all()
    nodes.wait_protected(5)
    smp_pid = int(dict(nodes.exchange(1)).get("pid", 0) or 0) or _smp_pid(nodes, 1)
    os.kill(smp_pid, signal.SIGKILL)
    nodes.agents[1].wait_for(r"REBUILT step (\d+) of this node", 180)
    assert nodes.finish() == want


def _smp_pid(nodes: Nodes, i: int) -> int:
    with SmpClient(nodes.run_dir(i), timeout=timedelta(seconds=5)) as c:
        return int(c.status()["pid"])
