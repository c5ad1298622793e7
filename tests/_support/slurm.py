"""A real Slurm cluster on network-namespace hosts, for the tests of ``launcher/slurm/``.

Debian's ``slurmctld``, ``slurmd`` and ``munge``: one ``munged`` (its socket in the test's
directory), ``slurmctld`` on host 0, one ``slurmd`` on each other host (its own address, host
name and /dev/shm: :class:`tests._support.hosts.Hosts`), all as root with a configuration of
the test's own (no cgroups, no accounting database: job completions go to a text file).
Every daemon and namespace is gone after :meth:`SlurmCluster.close`, also after a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from ftmem.config import user_base_dir
from tests._support.hosts import Hosts, unavailable

DAEMONS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


def slurm_unavailable() -> str | None:
    """Why a Slurm cluster cannot be started here (None: it can)."""
    why = unavailable()
    if why:
        return why
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)}: apt-get install slurmctld slurmd munge)"
    return None


class SlurmCluster:
    """``nodes`` Slurm nodes (hosts 1..nodes) and a controller (host 0) on one private bridge.

    Resource handling: a context manager; :meth:`close` (idempotent) stops every daemon, then
    the hosts (every process in them), and removes the directory.
    """

    def __init__(self, nodes: int, workdir: Path, shm_size: str = "512m") -> None:
        self.nodes = nodes
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._procs: list[subprocess.Popen[bytes]] = []
        self.jobs: list[int] = []
        """Every job submitted (:meth:`close` removes their agents' run directories)."""
        self.hosts = Hosts(nodes + 1, shm_size=shm_size)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    @property
    def conf(self) -> Path:
        """The cluster's slurm.conf (``SLURM_CONF`` for every client)."""
        return self.dir / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus ``SLURM_CONF``."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def node_name(self, k: int) -> str:
        """The Slurm name of node ``k`` (1-based: host ``k``)."""
        return self.hosts.name(k)

    def _start(self) -> None:
        d, h = self.dir, self.hosts
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (d / "state").mkdir()
        for k in range(1, self.nodes + 1):
            (d / f"spool-{self.node_name(k)}").mkdir()
        self._spawn(
            ["munged", "--foreground", "--force", f"--socket={d / 'munge.sock'}",
             f"--key-file={key}", f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
             f"--seed-file={d / 'munged.seed'}"],
            "munged.out",
        )  # fmt: skip
        self._wait(lambda: (d / "munge.sock").exists(), 20, "munged did not start")
        nodes = ",".join(self.node_name(k) for k in range(1, self.nodes + 1))
        lines = [
            "ClusterName=ftmemtest",
            f"SlurmctldHost={h.name(0)}({h.addr(0)})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge.sock'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}",
            "SlurmctldPort=6817",
            "SlurmdPort=6818",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            # The main scheduling loop runs every 60 s by default: a requeued job waited for it.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/linear",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmdTimeout=8",
            "SlurmctldTimeout=10",
            "MessageTimeout=5",
            "KillWait=10",
            "MinJobAge=600",
            "InactiveLimit=0",
            "JobRequeue=1",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={d / 'jobcomp.txt'}",
            "AccountingStorageType=accounting_storage/none",
            "PlugStackConfig=/dev/null",
            *(
                f"NodeName={self.node_name(k)} NodeAddr={h.addr(k)} CPUs=2 RealMemory=1000 "
                "State=UNKNOWN"
                for k in range(1, self.nodes + 1)
            ),
            f"PartitionName=test Nodes={nodes} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self._spawn(h.command(0, ["slurmctld", "-D", "-f", str(self.conf)]), "slurmctld.out")
        for k in range(1, self.nodes + 1):
            self.start_node(k)
        self._wait(self._all_idle, 60, "the nodes did not become idle")

    def start_node(self, k: int) -> None:
        """Start node ``k``'s slurmd (on host ``k``)."""
        # `ip netns exec` mounts a sysfs of its own, without the cgroup hierarchies slurmd
        # initialises (even with proctrack/linuxproc): mount them again (v1, as here).
        slurmd = f"slurmd -D -N {self.node_name(k)} -f {self.conf}"
        cg = "/sys/fs/cgroup"
        setup = (
            f"mount -t tmpfs cgroup_root {cg} && "
            + " && ".join(
                f"mkdir -p {cg}/{d} && mount -t cgroup -o {o} cgroup {cg}/{d}"
                for d, o in (
                    ("freezer", "freezer"),
                    ("cpuset", "cpuset"),
                    ("memory", "memory"),
                    ("devices", "devices"),
                    ("systemd", "none,name=systemd"),
                )
            )
            + f" && exec {slurmd}"
        )
        self._spawn(self.hosts.command(k, ["sh", "-c", setup]), f"slurmd-{k}.out")

    def _spawn(self, argv: list[str], log: str) -> None:
        with open(self.dir / log, "ab") as out:
            self._procs.append(
                subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env(),
                    start_new_session=True,
                )
            )

    def _wait(self, ok: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{what}: {p.args[0]} exited {p.returncode}; {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout} s; {self.logs()}")
            time.sleep(0.3)

    def run(self, *argv: str, timeout: float = 30.0) -> str:
        """A Slurm client command run on the controller's host; its output."""
        out = subprocess.run(
            self.hosts.command(0, list(argv)),
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
        )
        if out.returncode != 0:
            raise RuntimeError(f"{argv} exited {out.returncode}: {out.stderr}")
        return out.stdout

    def _all_idle(self) -> bool:
        try:
            states = self.run("sinfo", "-h", "-N", "-o", "%T").split()
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return len(states) == self.nodes and all(s == "idle" for s in states)

    def sbatch(self, script: Path, env: dict[str, str], *args: str) -> int:
        """Submit ``script`` (with ``args``) from the controller's host, with this process's
        environment plus ``env`` (the job gets it: ``--export=ALL``); the job id."""
        out = subprocess.run(
            self.hosts.command(0, ["sbatch", "--parsable", *args, str(script)]),
            capture_output=True,
            text=True,
            env=self.env({**os.environ, **env}),
            timeout=30,
        )
        if out.returncode != 0:
            raise RuntimeError(f"sbatch exited {out.returncode}: {out.stderr}")
        job = int(out.stdout.strip().split(";")[0])
        self.jobs.append(job)
        return job

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` ({} once it is forgotten)."""
        try:
            text = self.run("scontrol", "show", "job", "-o", str(job_id))
        except RuntimeError:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def completions(self) -> list[dict[str, str]]:
        """The job completion records (``jobcomp/filetxt``), oldest first."""
        path = self.dir / "jobcomp.txt"
        if not path.exists():
            return []
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in path.read_text().splitlines()]

    def logs(self, tail: int = 1500) -> str:
        """The tail of every daemon's log (for an assertion's message)."""
        out = []
        for name in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            with contextlib.suppress(OSError):
                out.append(f"--- {name.name}\n{name.read_text()[-tail:]}")
        return "\n".join(out)

    def close(self) -> None:
        """Stop every daemon, the hosts and their processes (idempotent)."""
        for p in reversed(self._procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        self._procs.clear()
        self.hosts.close()
        # ftmem-launch keeps an agent's run directory after a signal or a failure (for
        # inspection): the jobs' are this cluster's, named <job id>-<attempt>-<node>.
        base = user_base_dir()
        for job in self.jobs:
            for rd in base.glob(f"{job}-*-*"):
                shutil.rmtree(rd, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
