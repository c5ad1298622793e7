"""N ``ftmem-launch`` agents of one job on loopback: the nodes of a multi-node run on one host.

Each node is one ``python -m launcher`` process in its own session, logging to a file, with
its own run directory and node-local flush tier; node 0 hosts the c10d rendezvous store. A
node is *lost* for real: its agent, SMP, flush worker and ranks are SIGKILLed at once and
its shared memory is removed (a dead machine takes its memory along); a *replacement* is a
new agent with the lost node's name and a new run directory.

Used by the chaos runner (:mod:`ftmem.testing.chaos`) and by tests. Processes are found with
psutil (a rank is a descendant whose environment has ``RANK``; the SMP runs
``-m ftmem.smp``); SMP status goes through ``SmpClient`` (whose package imports torch: a
cluster pays that once, when it is made).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from ftmem.errors import FtmemError
from ftmem.exchange import keys
from ftmem.faults import ENV_FAULT_FILE
from ftmem.protocol.smp_client import SmpClient

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
"""The source tree this module belongs to (examples/ lives here in a checkout)."""
EXAMPLE = REPO / "examples" / "train_gpt.py"
"""The example the chaos runner trains."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer exists (a zombie counts as gone)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: set[int], timeout: timedelta) -> set[int]:
    """Wait (polling) until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout.total_seconds()
    alive = {p for p in pids if not pid_gone(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {p for p in alive if not pid_gone(p)}
    return alive


def shm_files(run_id: str, node: str | None = None) -> list[str]:
    """Shared-memory files of ``run_id`` (of one node if given) in /dev/shm."""
    prefix = f"ftmem-{run_id}-" + (f"{node}-" if node is not None else "")
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(prefix))


class Agent:
    """One ``python -m launcher`` process, in its own session, logging to ``log``.

    Resource handling: :meth:`kill_all` (idempotent, bounded) stops the agent and every
    descendant it was ever seen with (ranks lead their own sessions, so killing the agent's
    group does not reach them); :meth:`lose` SIGKILLs all of them at once.
    """

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self.seen: set[int] = set()
        """Every descendant ever seen (also reaped by :meth:`kill_all`)."""
        with open(log_path, "w") as f:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "ftmem.launch", *args],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=REPO,
            )
        self.pid = self.popen.pid

    def text(self) -> str:
        """The agent's log so far."""
        return self.log_path.read_text(errors="replace")

    def descendants(self) -> list[psutil.Process]:
        """The agent's live descendants (their pids are remembered in :attr:`seen`)."""
        try:
            kids = list(psutil.Process(self.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            kids = []
        self.seen |= {k.pid for k in kids}
        return kids

    def poll(self) -> int | None:
        """The agent's exit code, or None while it runs."""
        return self.popen.poll()

    def wait(self, timeout: timedelta) -> int | None:
        """Wait for the agent to exit (noting descendants meanwhile); its code or None."""
        deadline = time.monotonic() + timeout.total_seconds()
        while self.popen.poll() is None and time.monotonic() < deadline:
            self.descendants()
            time.sleep(0.1)
        return self.popen.poll()

    def _kill(self, pids: set[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def lose(self) -> None:
        """The node dies: the agent and every descendant SIGKILLed at once, then reaped."""
        procs = {self.pid, *(p.pid for p in self.descendants())}
        self._kill(procs)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("agent %s (pid %d) survived SIGKILL for 10 s", self.name, self.pid)
        left = wait_gone(procs, timedelta(seconds=10))
        if left:
            log.error("node %s: processes %s survived SIGKILL for 10 s", self.name, left)

    def terminate(self) -> None:
        """Send SIGTERM to the agent (it stops its ranks and its SMP, which frees its arenas)."""
        self.descendants()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def kill_rest(self) -> None:
        """SIGKILL the agent's group and every descendant ever seen; reap the agent."""
        self.descendants()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._kill(self.seen)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("agent %s (pid %d) still alive after SIGKILL", self.name, self.pid)

    def kill_all(self, term_timeout: timedelta = timedelta(seconds=60)) -> None:
        """:meth:`terminate`, wait up to ``term_timeout`` for the agent, then :meth:`kill_rest`."""
        self.terminate()
        if self.wait(term_timeout) is None:
            log.warning("agent %s did not stop on SIGTERM; killing it", self.name)
        self.kill_rest()


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """What a :class:`LoopbackCluster` runs."""

    workdir: Path
    """Short private directory: run directories, logs, disk tiers, key and fault files."""
    nodes: int
    """Number of nodes (agents)."""
    nproc: int = 1
    """Ranks per node."""
    script: list[str]
    """The training script and its arguments."""
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
        self.agents: dict[int, Agent] = {}
        """The current agent of each node."""
        self.all_agents: list[Agent] = []
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
        args = [
            f"--nnodes={c.nodes}",
            f"--nproc-per-node={c.nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf=is_host={1 if i == 0 and self.starts[i] == 1 else 0}",
            "--monitor-interval=0.1",
            "--max-restarts=100000",
            f"--ftmem-node={self.node_name(i)}",
            f"--ftmem-run-dir={self.run_dir(i)}",
            "--ftmem-peer-host=127.0.0.1",
            f"--ftmem-ec-parity={c.parity}",
            f"--ftmem-hang-timeout={c.hang_timeout}",
        ]
        if self.key_file.exists():
            args.append(f"--ftmem-key-file={self.key_file}")
        if c.flush_every > 0:
            args += [
                f"--ftmem-flush-dir={self.flush_dir(i)}",
                f"--ftmem-flush-every={c.flush_every}",
            ]
            if c.nodes > 1:
                args.append(f"--ftmem-flush-persistent-dir={self.shared_dir}")
        return [*args, *c.extra_args, *c.script]

    def _env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # ftmem-launch's default
        env.pop("FTMEM_FAULT", None)
        env.setdefault("PET_FTMEM_STANDBY", "0")  # warm-ups would slow multi-node tests
        env["FTMEM_NODE"] = self.node_name(i)  # the SMP and flush worker match armed faults
        env[ENV_FAULT_FILE] = str(self.fault_file)
        env.update(self.config.env)
        return env

    def start(self, i: int) -> Agent:
        """Start node ``i``'s agent (a replacement if the node ran before)."""
        if self.starts.get(i, 0) and i == 0:
            raise ValueError("node 0 hosts the rendezvous store: it cannot be replaced")
        self.starts[i] = self.starts.get(i, 0) + 1
        name = f"{self.node_name(i)}-{self.starts[i]}"
        agent = Agent(name, self._args(i), self.config.workdir / f"{name}.log", self._env(i))
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
        rx = re.compile(pattern)
        agent = self.agents[i]
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            agent.descendants()
            found = rx.search(agent.text())
            if found:
                return found
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{pattern!r} not in {agent.name}'s log within {timeout} "
                    f"(exit {agent.poll()}); tail:\n{agent.text()[-3000:]}"
                )
            time.sleep(0.1)

    def lose(self, i: int) -> None:
        """Node ``i`` dies: every process SIGKILLed at once, its shared memory removed."""
        self.agents[i].lose()
        for name in shm_files(self.run_id, self.node_name(i)):
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass

    def smp_pid(self, i: int) -> int | None:
        """The pid of node ``i``'s SMP, or None."""
        for p in self.agents[i].descendants():
            try:
                if "ftmem.smp" in p.cmdline():
                    return int(p.pid)
            except psutil.Error:
                continue
        return None

    def rank_pids(self, i: int) -> dict[int, int]:
        """Global rank -> pid of node ``i``'s live ranks."""
        out: dict[int, int] = {}
        for p in self.agents[i].descendants():
            try:
                env = p.environ()
                if "RANK" in env and "FTMEM_RUN_DIR" in env and p.status() != psutil.STATUS_ZOMBIE:
                    out[int(env["RANK"])] = int(p.pid)
            except (psutil.Error, ValueError):
                continue
        return out

    def status(self, i: int, timeout: timedelta = timedelta(seconds=3)) -> dict[str, Any] | None:
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
        left = shm_files(self.run_id)
        for name in left:  # a SIGKILLed SMP of a node that was never restarted
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass
        return alive, left

    def __enter__(self) -> LoopbackCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
