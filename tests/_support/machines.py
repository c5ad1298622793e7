"""Whole machines of one job: each host a network namespace (:mod:`ftmem.testing.hosts`)
running one ``ftmem-launch`` agent with one rank of ``examples/train_gpt.py``; the c10d
rendezvous store is served by host 0's agent; erasure coding with a key file; agents beyond
``--nnodes`` wait as hot spares. A machine is lost for real: its link cut, every process on
it SIGKILLed, its /dev/shm wiped."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ftmem.exchange.keys import generate, write_key_file
from ftmem.testing.harness import launch_args, launch_command
from ftmem.testing.hosts import Hosts, unavailable
from tests._support.launcher import EXAMPLE, TINY, Launch, Launcher, digests
from tests._support.procs import REPO

RDZV_PORT = 29400
STEPS = 300
"""Long enough to outlast a 60 s partition with ``--step-delay 0.3``."""


def script(step_delay: float) -> list[str]:
    """The training script and its arguments (the digest does not depend on the delay)."""
    return [str(EXAMPLE), "--steps", str(STEPS), "--step-delay", f"{step_delay:g}", *TINY]


class Machines:
    """``hosts.n`` machines of a job of ``nnodes`` nodes (the rest are spares)."""

    def __init__(
        self,
        launcher: Launcher,
        hosts: Hosts,
        nnodes: int,
        extra: list[str],
        step_delay: float,
        rdzv_conf: str,
    ) -> None:
        self.rdzv_conf = rdzv_conf
        self.launcher = launcher
        self.hosts = hosts
        self.nnodes = nnodes
        self.extra = extra
        self.script = script(step_delay)
        self.rid = launcher.new_run_id()
        self.key = launcher.tmp / "job.key"
        write_key_file(self.key, generate())
        self.agents: dict[int, Launch] = {}

    def start(self, i: int) -> Launch:
        """Start host ``i``'s agent."""
        h = self.hosts
        args = launch_args(
            nnodes=self.nnodes,
            rdzv_endpoint=f"{h.addr(0)}:{RDZV_PORT}",
            rdzv_id=self.rid,
            node=h.name(i),
            run_dir=self.launcher.tmp / f"{h.name(i)}-rd",
            flags=[
                "--rdzv-conf",
                ",".join(c for c in (f"is_host={int(i == 0)}", self.rdzv_conf) if c),
                "--ftmem-ec-parity",
                "1",
                "--ftmem-key-file",
                str(self.key),
                "--ftmem-peer-host",
                h.addr(i),
                "--ftmem-standby",
                "1",
                *self.extra,
            ],
            script=self.script,
        )
        log_path = self.launcher.tmp / f"{h.name(i)}.log"
        launch = Launch(h.command(i, launch_command(args)), log_path, self.launcher.env(), cwd=REPO)
        self.launcher.launches.append(launch)
        self.agents[i] = launch
        return launch

    def start_all(self) -> None:
        """Start host 0 (the rendezvous store), then the other nodes of the job; once their
        ranks run, the spares (which then find the job full)."""
        self.start(0).wait_for(r"SMP pid \d+ ready", 60)
        for i in range(1, self.nnodes):
            self.start(i)
        for i in range(self.nnodes):
            self.agents[i].wait_for(r"generation 0: started ranks", 120)
        for i in range(self.nnodes, self.hosts.n):
            self.start(i).wait_for(r"SPARE: the job has all its nodes", 120)

    def wait_step(self, i: int, step: int, timeout: float = 120.0) -> None:
        """Wait until host ``i``'s rank logged ``step``."""
        self.agents[i].wait_for(rf"step {step} loss", timeout)

    def finish(self, hosts: list[int], timeout: float = 300.0) -> dict[int, str]:
        """Wait for the agents of ``hosts`` to exit 0; the digests their ranks printed."""
        out: dict[int, str] = {}
        for i in hosts:
            code = self.agents[i].wait(timeout)
            assert code == 0, f"h{i} exited {code}:\n" + self.agents[i].text()[-4000:]
            out.update(digests(self.agents[i].text()))
        return out


@contextmanager
def machines(
    launcher: Launcher,
    n: int,
    nnodes: int,
    extra: list[str] | None = None,
    step_delay: float = 0.1,
    rdzv_conf: str = "",
) -> Iterator[Machines]:
    """``n`` namespace hosts running a job of ``nnodes`` nodes; every process, namespace and
    mount is gone afterwards (skips where namespace hosts cannot be made)."""
    why = unavailable()
    if why:
        pytest.skip(why)
    with Hosts(n, shm_size="512m") as hosts:
        yield Machines(launcher, hosts, nnodes, extra or [], step_delay, rdzv_conf)
        launcher.cleanup()
        launcher.launches.clear()


def events(run_dir: Path) -> list[str]:
    """The event names of an agent's event log."""
    import json

    path = run_dir / "events.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x)["event"] for x in path.read_text().splitlines() if x.strip()]
