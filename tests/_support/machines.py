"""One job on several machines (:mod:`tests._support.hosts`), for the tests and benchmarks of
machine loss: each host runs one ``ftmem-launch`` agent; host 0's agent serves the c10d
rendezvous store unless :meth:`Machines.use_etcd` puts the rendezvous on an etcd cluster;
erasure coding with a key file and warm standbys; agents beyond ``--nnodes`` wait as hot
spares. For tests, :func:`machines` runs one rank of the test workload per machine, its
processes reaped by the test's :class:`~tests._support.launcher.Launcher`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ftmem.exchange.keys import generate, write_key_file
from ftmem.observe.timeline import read_events
from tests._support.hosts import Hosts, unavailable
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    AgentProcess,
    Launch,
    Launcher,
    digests,
    launch_args,
    launch_command,
)
from tests._support.procs import REPO

RDZV_PORT = 29400
_KILLED_ON_TERM = (
    "trap 'kill -KILL $p 2>/dev/null' TERM INT; \"$@\" & p=$!; s=0; "
    "while kill -0 $p 2>/dev/null; do wait $p; s=$?; done; exit $s"
)
"""Runs ``"$@"`` (an etcd member) and SIGKILLs it on SIGTERM or SIGINT (see
:meth:`Machines.use_etcd`)."""


class Machines:
    """``hosts.n`` machines running a job of ``nnodes`` nodes (the rest are spares).

    Args:
        hosts: the machines.
        workdir: where logs, run directories, the key file and etcd's data go.
        run_id: the rendezvous id.
        nnodes: the job's nodes (``--nnodes``).
        min_nodes: the fewest nodes it may shrink to (``--nnodes MIN:MAX``; None: fixed).
        script: the training script and its arguments (one rank per node).
        env: the agents' environment.
        extra: more ``ftmem-launch`` flags.
        rdzv_conf: more ``--rdzv-conf`` settings (``key=value,...``).
        process: the class of the processes started (an :class:`AgentProcess`).
        on_start: called with every process started (agents and etcd members).

    Resource handling: every process runs on a host; :meth:`Hosts.close` kills them all.
    """

    def __init__(
        self,
        hosts: Hosts,
        workdir: Path,
        run_id: str,
        nnodes: int,
        script: Sequence[str],
        env: Mapping[str, str],
        *,
        extra: Sequence[str] = (),
        rdzv_conf: str = "",
        process: type[AgentProcess] = AgentProcess,
        on_start: Callable[[AgentProcess], None] | None = None,
        cwd: Path | None = None,
        min_nodes: int | None = None,
    ) -> None:
        self.hosts = hosts
        self.workdir = workdir
        self.rid = run_id
        self.nnodes = nnodes
        self.min_nodes = min_nodes
        self.script = list(script)
        self.env = dict(env)
        self.extra = list(extra)
        self.rdzv_conf = rdzv_conf
        self.process = process
        self.on_start = on_start or (lambda proc: None)
        self.cwd = cwd
        self.rdzv_backend = "c10d"
        self.rdzv_endpoint = f"{hosts.addr(0)}:{RDZV_PORT}"
        self.key = workdir / "job.key"
        write_key_file(self.key, generate())
        self.agents: dict[int, AgentProcess] = {}

    def run_dir(self, i: int) -> Path:
        """Host ``i``'s agent's run directory."""
        return self.workdir / f"{self.hosts.name(i)}-rd"

    def _spawn(self, i: int, argv: list[str], log_name: str) -> AgentProcess:
        cmd = self.hosts.command(i, argv)
        proc = self.process(cmd, self.workdir / log_name, self.env, cwd=self.cwd)
        self.on_start(proc)
        return proc

    def start(self, i: int) -> AgentProcess:
        """Start host ``i``'s agent."""
        h = self.hosts
        conf = [self.rdzv_conf] if self.rdzv_conf else []
        if self.rdzv_backend == "c10d":
            conf.insert(0, f"is_host={int(i == 0)}")
        args = launch_args(
            nnodes=self.nnodes,
            min_nodes=self.min_nodes,
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rid,
            node=h.name(i),
            run_dir=self.run_dir(i),
            flags=[
                *(["--rdzv-conf", ",".join(conf)] if conf else []),
                "--rdzv-backend",
                self.rdzv_backend,
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
        self.agents[i] = self._spawn(i, launch_command(args), f"{h.name(i)}.log")
        return self.agents[i]

    def use_etcd(self, members: Sequence[int], timeout: float = 60.0, api: str = "v3") -> None:
        """Run an etcd cluster with a member on each host of ``members`` and make it the
        rendezvous: ``api="v3"`` (``etcd-v3``) or ``"v2"`` (``etcd-v2``, the v2 API turned
        on). The endpoint is the first member's only; the client learns the others from it.
        A member is a process on its host: losing the host loses it. Stopping one (SIGTERM,
        as the tests' cleanup does) SIGKILLs it: etcd's graceful stop can outlast any
        reasonable wait while a peer's host is silently gone (a leader hands its leadership
        over, then stays up for tens of seconds), and its data directory is thrown away."""
        if api not in ("v2", "v3"):
            raise ValueError(f"api must be 'v2' or 'v3', not {api!r}")
        h = self.hosts
        cluster = ",".join(f"e{i}=http://{h.addr(i)}:2380" for i in members)
        started = []
        for i in members:
            cmd = [
                "sh", "-c", _KILLED_ON_TERM, "sh",
                "etcd", "--name", f"e{i}", "--data-dir", str(self.workdir / f"etcd{i}"),
                "--listen-client-urls", f"http://{h.addr(i)}:2379",
                "--advertise-client-urls", f"http://{h.addr(i)}:2379",
                "--listen-peer-urls", f"http://{h.addr(i)}:2380",
                "--initial-advertise-peer-urls", f"http://{h.addr(i)}:2380",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.rid,
                *(["--enable-v2=true"] if api == "v2" else []),
            ]  # fmt: skip
            started.append(self._spawn(i, cmd, f"etcd{i}.log"))
        for member in started:
            member.wait_log(r"ready to serve client requests", timeout)
        self.rdzv_backend = f"etcd-{api}"
        self.rdzv_endpoint = f"{h.addr(members[0])}:2379"

    def start_all(self, timeout: float = 120.0) -> None:
        """Start host 0, then the other nodes of the job; once their ranks run, the spares
        (which then find the job full)."""
        if self.rdzv_backend == "c10d":
            self.start(0).wait_log(r"SMP pid \d+ ready", timeout)
        else:
            self.start(0)
        for i in range(1, self.nnodes):
            self.start(i)
        for i in range(self.nnodes):
            self.agents[i].wait_log(r"generation 0: started ranks", timeout)
        for i in range(self.nnodes, self.hosts.n):
            self.start(i).wait_log(r"SPARE: the job has all its nodes", timeout)

    def wait_step(self, i: int, step: int, timeout: float = 120.0) -> None:
        """Wait until host ``i``'s rank logged ``step``."""
        self.agents[i].wait_log(rf"step {step} loss", timeout)


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
        import pytest  # only tests call this; the benchmarks run without pytest

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
