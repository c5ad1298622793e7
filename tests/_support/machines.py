"""A job on network-namespace machines for the tests (:mod:`ftmem.testing.machines`): one
rank of the test workload per machine, processes reaped by the test's
:class:`~tests._support.launcher.Launcher`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ftmem.observe.timeline import read_events
from ftmem.testing.harness import AgentProcess
from ftmem.testing.hosts import Hosts, unavailable
from ftmem.testing.machines import Machines
from tests._support.launcher import TINY, WORKLOAD, Launch, Launcher, digests
from tests._support.procs import REPO

STEPS = 150
"""Long enough to outlast a 30 s partition with ``--step-delay 0.3`` (the Slurm test runs as
many steps of the same world size, so both share one reference run)."""


def script(step_delay: float, steps: int = STEPS) -> list[str]:
    """The training script and its arguments (the digest does not depend on the delay)."""
    return [str(WORKLOAD), "--steps", str(steps), "--step-delay", f"{step_delay:g}", *TINY]


@contextmanager
def machines(
    launcher: Launcher,
    n: int,
    nnodes: int,
    step_delay: float = 0.1,
    rdzv_conf: str = "",
    extra: list[str] | None = None,
    steps: int = STEPS,
    min_nodes: int | None = None,
    command: list[str] | None = None,
) -> Iterator[Machines]:
    """``n`` namespace hosts running a job of ``nnodes`` nodes (``min_nodes``: it may shrink
    to that many) of the test workload (or ``command``: a script and its arguments); every
    process, namespace and mount is gone afterwards (skips where namespace hosts cannot be
    made)."""
    why = unavailable()
    if why:
        pytest.skip(why)

    def started(proc: AgentProcess) -> None:
        assert isinstance(proc, Launch)
        launcher.launches.append(proc)

    with Hosts(n, shm_size="512m") as hosts:
        yield Machines(
            hosts,
            launcher.tmp,
            launcher.new_run_id(),
            nnodes,
            command or script(step_delay, steps),
            launcher.env(),
            rdzv_conf=rdzv_conf,
            extra=extra or [],
            process=Launch,
            on_start=started,
            cwd=REPO,
            min_nodes=min_nodes,
        )
        launcher.cleanup()
        launcher.launches.clear()


def finish(m: Machines, hosts: list[int], timeout: float = 300.0) -> dict[int, str]:
    """Wait for the agents of ``hosts`` to exit 0; the digests their ranks printed."""
    out: dict[int, str] = {}
    for i in hosts:
        code = m.agents[i].wait(timeout)
        assert code == 0, f"h{i} exited {code}:\n" + m.agents[i].text()[-4000:]
        out.update(digests(m.agents[i].text()))
    return out


def events(run_dir: Path, name: str | None = None) -> list[dict[str, object]]:
    """The events of an agent's event log and its SMP's (all, or those called ``name``)."""
    return [
        {"event": e.event, "time": e.time, **e.fields}
        for e in read_events([run_dir]).events
        if name is None or e.event == name
    ]
