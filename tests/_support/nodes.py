"""Whole nodes of one job on loopback, for the tests of node loss: each node an
``ftmem-launch`` agent (started by a test's :class:`~tests._support.launcher.Launcher`) with
one rank of the test workload; node ``i`` is named ``n<i>`` and holds global rank i.
A node is lost for real: SIGKILL of its agent, SMP and rank at once, and its shared memory
removed (a dead machine takes its memory with it)."""

from __future__ import annotations

import time
from datetime import timedelta

from ftmem.errors import FtmemError
from ftmem.protocol.smp_client import SmpClient
from ftmem.protocol.status import ProtectionStatus
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    Launch,
    Launcher,
    digests,
    free_port,
    launch_args,
    remove_shm,
)

STEPS = 40
SCRIPT = [str(WORKLOAD), "--steps", str(STEPS), "--step-delay", "0.15", *TINY]
"""The default script of :class:`Nodes` (a step delay leaves time to lose a node mid-run)."""
_REFERENCE: dict[int, dict[int, str]] = {}


def reference(launcher: Launcher, nproc: int) -> dict[int, str]:
    """Digests of a failure-free single-node run with ``nproc`` ranks (same world size)."""
    if nproc not in _REFERENCE:
        rid = launcher.new_run_id()
        ref = launcher.single_node(
            rid,
            nproc,
            ["--ftmem-ec-parity", "0"],
            [str(WORKLOAD), "--steps", str(STEPS), *TINY],
            name=f"reference{nproc}",
        )
        assert ref.wait(180) == 0, ref.text()[-3000:]
        _REFERENCE[nproc] = digests(ref.text())
        assert len(_REFERENCE[nproc]) == nproc
    return _REFERENCE[nproc]


class Nodes:
    """Agents of one multi-node run; node i is named n<i> and holds global rank i.

    ``extra`` are more agent flags, ``{i}`` in them replaced by the node's index; ``env``
    maps a node's index to more environment variables for its agent (and so its SMP and rank).
    """

    def __init__(
        self,
        launcher: Launcher,
        n: int,
        extra: list[str],
        script: list[str] = SCRIPT,
        env: dict[int, dict[str, str]] | None = None,
    ) -> None:
        self.script = script
        self.env = env or {}
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
        """The run directory of node ``i``'s current agent."""
        return str(self.launcher.tmp / f"n{i}-{self.starts[i]}-rd")

    def start(self, i: int) -> Launch:
        """Start node ``i``'s agent (a replacement if it ran before)."""
        self.starts[i] = self.starts.get(i, 0) + 1
        args = launch_args(
            nnodes=self.n,
            rdzv_endpoint=f"127.0.0.1:{self.port}",
            rdzv_id=self.rid,
            is_host=i == 0 and self.starts[i] == self.host_start,
            node=f"n{i}",
            run_dir=self.run_dir(i),
            flags=[
                "--ftmem-peer-host",
                "127.0.0.1",
                *(a.replace("{i}", str(i)) for a in self.extra),  # per-node values
            ],
            script=self.script,
        )
        launch = self.launcher.start(args, f"n{i}-{self.starts[i]}", **self.env.get(i, {}))
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

    def protection(self, i: int) -> ProtectionStatus | None:
        """The exchange part of node ``i``'s SMP status (None if it does not answer)."""
        try:
            with SmpClient(self.run_dir(i), timeout=timedelta(seconds=5)) as c:
                return c.status().protection
        except FtmemError:
            return None

    def wait_protected(self, at_least: int, timeout: float = 120.0) -> int:
        """Wait until every node's SMP reports a protected step >= ``at_least``; fail at once
        (with each node's exchange events) when an agent exits first."""
        deadline = time.monotonic() + timeout
        while True:
            steps = [getattr(self.protection(i), "protected_step", None) for i in range(self.n)]
            if all(isinstance(s, int) and s >= at_least for s in steps):
                return min(s for s in steps if isinstance(s, int))
            exited = {i: a.poll() for i, a in self.agents.items() if a.poll() is not None}
            if exited or time.monotonic() >= deadline:
                why = f"agents {exited} exited" if exited else f"{timeout} s passed"
                raise AssertionError(
                    f"protected steps {steps} never reached {at_least} ({why})\n" + self.diagnosis()
                )
            time.sleep(0.2)

    def diagnosis(self, lines: int = 25) -> str:
        """The last exchange events of each node's SMP and the tail of each agent's log."""
        out = []
        for i in range(self.n):
            path = f"{self.run_dir(i)}/smp-events.jsonl"
            try:
                with open(path) as f:
                    ev = [x for x in f.read().splitlines() if '"protect' in x or '"sync"' in x]
            except OSError as exc:
                ev = [f"({exc})"]
            out.append(f"--- node {i} exchange events:\n" + "\n".join(ev[-lines:]))
            out.append(f"--- node {i} agent log:\n" + self.agents[i].text()[-2000:])
        return "\n".join(out)

    def lose(self, i: int) -> None:
        """Node i dies: every process of it SIGKILLed at once, its shared memory gone."""
        self.agents[i].lose(timeout=10)
        remove_shm(self.rid, f"n{i}")

    def finish(self, timeout: float = 240.0) -> dict[int, str]:
        """Wait for every agent to exit 0; the digests their ranks printed."""
        out: dict[int, str] = {}
        for launch in self.agents.values():
            assert launch.wait(timeout) == 0, launch.text()[-4000:]
            out.update(digests(launch.text()))
        return out
