"""N ``ftmem-launch`` agents of one job on loopback: the nodes of a multi-node run on one host.

Each node is one ``ftmem-launch`` agent (:class:`~tests._support.launcher.AgentProcess`: its
own session, a log file, a bounded SIGTERM -> SIGKILL stop), with its own run directory and
node-local flush tier; node 0 hosts the c10d rendezvous store. A
node is *lost* for real: its agent, SMP, flush worker and ranks are SIGKILLed at once and
its shared memory is removed (a dead machine takes its memory along); a *replacement* is a
new agent with the lost node's name and a new run directory.

Used by the chaos runner (:mod:`tests._support.chaos`) and by tests. The training script is a
config value; the default is the test workload (:mod:`tests._support.workload`), run by its
path: the agents and ranks need an installed ftmem, not the checkout on ``sys.path``. Processes are found with psutil (a rank is a
descendant whose environment has ``RANK``; the SMP runs ``-m ftmem.smp``); SMP status goes
through ``SmpClient``.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil

from ftmem.config import ENV_FAULT_FILE, ENV_NODE
from ftmem.errors import FtmemError
from ftmem.exchange import keys
from ftmem.protocol.smp_client import SmpClient
from ftmem.protocol.status import SmpStatus
from tests._support.launcher import (
    AgentProcess,
    agent_env,
    free_port,
    launch_args,
    rank_pids,
    remove_shm,
    shm_files,
    wait_gone,
)
from tests._support.workload import SCRIPT

__all__ = ["ClusterConfig", "LoopbackCluster", "shm_files"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """What a :class:`LoopbackCluster` runs."""

    workdir: Path
    """Short private directory: run directories, logs, disk tiers, key and fault files."""
    nodes: int
    """Number of nodes (agents)."""
    nproc: int = 1
    """Ranks per node."""
    script: list[str] = field(default_factory=lambda: [str(SCRIPT)])
    """The training script and its arguments (default: the test workload,
    :data:`tests._support.workload.SCRIPT`, with its defaults)."""
    parity: int = 1
    """``--ftmem-ec-parity`` (0: no erasure coding)."""
    flush_every: int = 0
    """``--ftmem-flush-every``; > 0 also gives every node a flush tier and a shared tier."""
    hang_timeout: float = 0.0
    """``--ftmem-hang-timeout`` (0: hang detection off)."""
    extra_args: list[str] = field(default_factory=list)
    """More agent arguments (before the script)."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment for every agent."""
    run_id: str = ""
    """Rendezvous id (default: a new unique one)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc < 1:
            raise ValueError("nodes and nproc must be >= 1")
        if len(str(self.workdir)) > 40:
            raise ValueError(f"workdir {self.workdir} is too long for ipc socket paths")


class LoopbackCluster:
    """The agents of one job (see the module docstring); node ``i`` is named ``n<i>``.

    Resource handling: :meth:`close` (idempotent; context manager) stops every agent ever
    started, SIGKILLs what is left and removes the run's shared memory; it returns what it
    could not remove. The workdir is the caller's.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.run_id = config.run_id or "ch" + uuid.uuid4().hex[:10]
        self.port = free_port()
        self.agents: dict[int, AgentProcess] = {}
        """The current agent of each node."""
        self.all_agents: list[AgentProcess] = []
        self.starts: dict[int, int] = {}
        self.fault_file = config.workdir / "armed.jsonl"
        """The run's armed-faults file (FTMEM_FAULT_FILE of every process)."""
        self.key_file = config.workdir / "mesh.key"
        if config.parity > 0 and config.nodes > 1 and not self.key_file.exists():
            keys.write_key_file(self.key_file, keys.generate())
        self.shared_dir = config.workdir / "shared"

    def node_name(self, i: int) -> str:
        """The name of node ``i``."""
        return f"n{i}"

    def run_dir(self, i: int) -> Path:
        """The run directory of node ``i``'s current agent."""
        return self.config.workdir / f"n{i}-{self.starts[i]}-rd"

    def flush_dir(self, i: int) -> Path:
        """Node ``i``'s node-local disk tier."""
        return self.config.workdir / f"disk-n{i}"

    def _args(self, i: int) -> list[str]:
        c = self.config
        flags = [
            "--max-restarts=100000",
            "--ftmem-peer-host=127.0.0.1",
            f"--ftmem-ec-parity={c.parity}",
            f"--ftmem-hang-timeout={c.hang_timeout}",
        ]
        if self.key_file.exists():
            flags.append(f"--ftmem-key-file={self.key_file}")
        if c.flush_every > 0:
            flags += [
                f"--ftmem-flush-dir={self.flush_dir(i)}",
                f"--ftmem-flush-every={c.flush_every}",
            ]
            if c.nodes > 1:
                flags.append(f"--ftmem-flush-persistent-dir={self.shared_dir}")
        return launch_args(
            nnodes=c.nodes,
            nproc=c.nproc,
            rdzv_endpoint=f"127.0.0.1:{self.port}",
            rdzv_id=self.run_id,
            is_host=i == 0 and self.starts[i] == 1,
            node=self.node_name(i),
            run_dir=self.run_dir(i),
            flags=[*flags, *c.extra_args],
            script=c.script,
        )

    def _env(self, i: int) -> dict[str, str]:
        return agent_env(
            {
                # warm-ups would slow multi-node runs; the caller's setting wins
                ENV_NODE: self.node_name(i),  # the SMP and flush worker match armed faults
                ENV_FAULT_FILE: str(self.fault_file),
                **self.config.env,
            }
        )

    def start(self, i: int) -> AgentProcess:
        """Start node ``i``'s agent (a replacement if the node ran before)."""
        if self.starts.get(i, 0) and i == 0:
            raise ValueError("node 0 hosts the rendezvous store: it cannot be replaced")
        self.starts[i] = self.starts.get(i, 0) + 1
        name = f"{self.node_name(i)}-{self.starts[i]}"
        log_path = self.config.workdir / f"{name}.log"
        agent = AgentProcess.launch(self._args(i), log_path, self._env(i), name=name)
        self.agents[i] = agent
        self.all_agents.append(agent)
        log.info("started agent %s (pid %d)", name, agent.pid)
        return agent

    def start_all(self, timeout: timedelta = timedelta(seconds=120)) -> None:
        """Start every node: node 0 (the store's host) first, the others once its SMP is
        ready; return when every agent has started its ranks (else RuntimeError)."""
        self.start(0)
        self.wait_log(0, r"SMP pid \d+ ready", timeout)
        for i in range(1, self.config.nodes):
            self.start(i)
        for i in range(self.config.nodes):
            self.wait_log(i, r"generation \d+: started ranks", timeout)

    def wait_log(self, i: int, pattern: str, timeout: timedelta) -> re.Match[str]:
        """Wait until node ``i``'s current log matches ``pattern``; RuntimeError otherwise."""
        return self.agents[i].wait_log(pattern, timeout)[0]

    def lose(self, i: int) -> None:
        """Node ``i`` dies: every process SIGKILLed at once, its shared memory removed."""
        self.agents[i].lose()
        remove_shm(self.run_id, self.node_name(i))

    def smp_pid(self, i: int) -> int | None:
        """The pid of node ``i``'s SMP, or None."""
        for p in self.agents[i].children():
            try:
                if "ftmem.smp" in p.cmdline():
                    return int(p.pid)
            except psutil.Error:
                continue
        return None

    def rank_pids(self, i: int) -> dict[int, int]:
        """Global rank -> pid of node ``i``'s live ranks."""
        return rank_pids(self.run_dir(i))

    def status(self, i: int, timeout: timedelta = timedelta(seconds=3)) -> SmpStatus | None:
        """Node ``i``'s SMP status, or None if it does not answer."""
        try:
            with SmpClient(self.run_dir(i), timeout=timeout) as c:
                return c.status()
        except (FtmemError, OSError):
            return None

    def close(self, term_timeout: timedelta = timedelta(seconds=90)) -> tuple[set[int], list[str]]:
        """Stop every agent ever started (SIGTERM to all at once: an SMP's final flush on
        SIGTERM may wait for its peers'; SIGKILL after ``term_timeout``); return (pids still
        alive, shm files that were left and are now removed)."""
        for agent in self.all_agents:
            agent.terminate()
        deadline = time.monotonic() + term_timeout.total_seconds()
        for agent in self.all_agents:
            remaining = timedelta(seconds=max(0.0, deadline - time.monotonic()))
            if agent.wait(remaining) is None:
                log.warning("agent %s did not stop on SIGTERM; killing it", agent.name)
        for agent in self.all_agents:
            agent.kill_rest()
        pids = {p for a in self.all_agents for p in a.seen | {a.pid}}
        alive = wait_gone(pids, timedelta(seconds=15))
        left = remove_shm(self.run_id)  # a SIGKILLed SMP of a node that was never restarted
        return alive, left

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
