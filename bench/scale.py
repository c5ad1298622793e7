"""The control plane at scale: per-node costs of N SMPs and of N full-stack hosts as N grows.

    sudo python bench/scale.py --json scale.json   # 16, 32, 64 SMPs; 4, 8, 16 hosts (~15 min)
    python bench/scale.py --smps 8,16 --hosts "" --rounds 3 --no-write

**N SMPs.** Each node is one real SMP process (torch-free) on this machine, meshed over CURVE/TCP on
loopback; the launcher's part (bind every SMP with its key pair, then start them all) and the
ranks' part (begin, write the slot file, commit) are played by this process through the SMP's
own protocol (``tests/_support/smp_mesh.py``), one rank per node, ``--payload-kib`` each,
erasure coding ``m`` = ``--parity`` in groups of at most 8 nodes (the SMP's cap).

Measured for each N, in this order:

- **start**: every SMP started, one after the other (each waits for the previous one's ready
  file); **bind**: PEER_BIND to every SMP, one after the other from this process (each
  agent binds its own SMP, in parallel, in a job); **start the mesh**: PEER_START to all at
  once, until the last one answers (its group synced).
- **rounds**: every rank commits step s (sequentially, from this process), then the time until
  every SMP reports s protected (``lag``, from the last commit), the bytes each SMP sent
  for it (``sent_bytes`` of the protection status) and each SMP's CPU per round (with the
  commits and status requests it served).
- **CPU per SMP** (user + system, the SMP and its encode workers): all N SMPs share this
  machine's cores, so a wall time that grows with N while the CPU per SMP stays flat is the
  machine's, not the design's.
- **idle**: over ``--idle-s`` seconds with nothing committed, each SMP's CPU (user + system,
  all its threads and encode workers), then its threads, socket descriptors, established TCP
  connections and RSS.
- **rebuild**: node 1 is lost (SMP SIGKILLed, its shared memory removed); a fresh SMP takes its
  place and the next generation's start returns once it rebuilt node 1's snapshot from its
  group; the rebuilt bytes are checked against what was committed.

**Full stack.** N network-namespace hosts (``tests/_support/hosts.py``, root), each an
``ftmem-launch`` agent (c10d rendezvous on host 0, erasure coding m=1, ``--ftmem-standby 0``),
its SMP and one rank of the test workload (0.3 s step delay). Measured: launch -> every rank
stepping and -> every node protected, and the CPU each host's processes used until then; from the agents' event logs the rendezvous (first
``joining`` -> last ``syncing``), the round itself (last ``joining`` -> last ``syncing``) and
the mesh (last ``syncing`` -> last ``started``); over ``--window-s`` of training, the packets
into host 0's store port and the failure detector's datagrams into each host (``iptables``
counters in their namespaces), and each agent's and SMP's
CPU, then each agent's threads, socket descriptors and RSS; last, host N-1 is lost silently
(its link down, then its processes killed) and the time to the first ``declared_lost``;
``--losses`` times, a replacement machine (a fresh agent on the lost host, its link back up)
taking the lost one's place before the next loss (each loss a different host, never host 0).

Per-node figures are medians over the N nodes (max in brackets). Written to
docs/benchmarks.md (section ``bench:scale``) with the machine's load; docs/scale.md reads
it and models larger jobs from it (``bench/scale_model.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/scale.py

from bench import _render
from ftmem.observe.timeline import read_events
from ftmem.protocol.smp_client import SmpClient
from tests._support.hosts import Hosts, unavailable
from tests._support.launcher import TINY, WORKLOAD, agent_env, remove_shm
from tests._support.machines import RDZV_PORT, Machines
from tests._support.smp_mesh import Cluster

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "scale"


@dataclass
class PerNode:
    """One figure over the N SMPs: its median and its max."""

    median: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> PerNode:
        """The median and max of ``values``."""
        return cls(statistics.median(values), max(values))


@dataclass
class ScaleRow:
    """The figures of one N (module docstring)."""

    n: int
    start_s: float
    bind_s: float
    sync_s: float
    sync_cpu_ms: PerNode | None = None
    lag_s: list[float] = field(default_factory=list)
    round_cpu_ms: PerNode | None = None
    sent_kib_per_round: PerNode | None = None
    idle_cpu_pct: PerNode | None = None
    threads: PerNode | None = None
    sockets: PerNode | None = None
    tcp: PerNode | None = None
    rss_mib: PerNode | None = None
    rebuild_bind_s: float | None = None
    rebuild_sync_s: float | None = None
    rebuild_own_s: float | None = None
    rebuilt_ok: bool = False


def _payload(rank: int, step: int, size: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{rank}-{step}".encode()) * (size // 16)


def _family(pid: int) -> list[psutil.Process]:
    """The SMP and its children (encode workers)."""
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_s(pid: int) -> float:
    total = 0.0
    for p in _family(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _host_cpu_s(hosts: Hosts, i: int) -> float:
    """CPU-seconds (user + system) of every process on host ``i`` so far, the children they
    reaped included."""
    total = 0.0
    for pid in hosts.pids(i):
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def _cpu_ms(pids: list[int], before: list[float], per: int = 1) -> PerNode:
    """Each SMP's CPU since ``before`` (its :func:`_cpu_s`), in ms, divided by ``per``."""
    return PerNode.of([1000 * (_cpu_s(p) - b) / per for p, b in zip(pids, before, strict=True)])


def _sockets(pid: int) -> int:
    try:
        return sum(
            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            for fd in os.listdir(f"/proc/{pid}/fd")
        )
    except OSError:
        return 0


def measure(n: int, parity: int, rounds: int, size: int, idle_s: float, base: Path) -> ScaleRow:
    """Run one cluster of ``n`` SMPs through the steps of the module docstring."""
    run_id = "sc" + uuid.uuid4().hex[:8]
    (base / f"n{n}").mkdir()
    t0 = time.monotonic()
    cluster = Cluster(base / f"n{n}", run_id, n, parity)
    try:
        start_s = time.monotonic() - t0
        pids = [nd.proc.pid for nd in cluster.nodes if nd.proc is not None]
        cpu0 = [_cpu_s(p) for p in pids]
        cluster.generation()
        row = ScaleRow(n, start_s, cluster.timing["bind_s"], cluster.timing["start_s"])
        row.sync_cpu_ms = _cpu_ms(pids, cpu0)
        cpu0 = [_cpu_s(p) for p in pids]
        sent: list[float] = []
        for step in range(1, rounds + 1):
            before = [nd.protection().sent_bytes for nd in cluster.nodes]
            for nd in cluster.nodes:
                assert nd.commit(nd.index, step, _payload(nd.index, step, size))
            t_commit = time.monotonic()
            cluster.wait(f"step {step} protected", lambda s=step: cluster.protected(s), 120)
            row.lag_s.append(time.monotonic() - t_commit)
            after = [nd.protection().sent_bytes for nd in cluster.nodes]
            sent += [(a - b) / 1024 for a, b in zip(after, before, strict=True)]
        row.sent_kib_per_round = PerNode.of(sent)
        row.round_cpu_ms = _cpu_ms(pids, cpu0, rounds)
        cpu0 = [_cpu_s(p) for p in pids]
        w0 = time.monotonic()
        time.sleep(idle_s)
        cpu1 = [_cpu_s(p) for p in pids]
        wall = time.monotonic() - w0
        row.idle_cpu_pct = PerNode.of(
            [100 * (b - a) / wall for a, b in zip(cpu0, cpu1, strict=True)]
        )
        procs = [psutil.Process(p) for p in pids]
        row.threads = PerNode.of([float(p.num_threads()) for p in procs])
        row.sockets = PerNode.of([float(_sockets(p.pid)) for p in procs])
        row.tcp = PerNode.of([float(len(p.net_connections("tcp"))) for p in procs])
        row.rss_mib = PerNode.of([p.memory_info().rss / 2**20 for p in procs])
        lost = cluster.nodes[1]
        lost.lose()
        lost.committed.clear()
        lost.start()
        cluster.generation()
        row.rebuild_bind_s = cluster.timing["bind_s"]
        row.rebuild_sync_s = cluster.timing["start_s"]
        row.rebuild_own_s = lost.protection().last_rebuild_s
        row.rebuilt_ok = lost.read(1, rounds) == _payload(1, rounds, size)
        return row
    finally:
        cluster.close()
        remove_shm(run_id)


# ------------------------------------------------------------------------------ full stack


@dataclass
class StackRow:
    """The figures of one N of namespace hosts (module docstring, "Full stack")."""

    n: int
    stepping_s: float = 0.0
    protected_s: float | None = None
    rendezvous_s: float | None = None
    round_s: float | None = None
    mesh_s: float | None = None
    store_packets_per_s: float = 0.0
    agent_cpu_pct: PerNode | None = None
    smp_cpu_pct: PerNode | None = None
    agent_threads: PerNode | None = None
    agent_sockets: PerNode | None = None
    agent_rss_mib: PerNode | None = None
    heartbeats_per_s: PerNode | None = None
    """Failure-detector datagrams into each host per second while training."""
    heartbeat_bytes_per_s: PerNode | None = None
    form_cpu_s: PerNode | None = None
    """CPU-seconds each host's processes used from launch until every node was protected."""
    detect_s: float | None = None
    """The median of ``detect_each_s``."""
    detect_each_s: list[float] = field(default_factory=list)
    """Silent loss -> first ``declared_lost`` or ``machine_lost``, one per loss."""


def _role(p: psutil.Process) -> str | None:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return None
    if "-m ftmem.launch" in cmd:
        return "agent"
    if "-m ftmem.smp" in cmd:
        return "smp"
    return None


_PROTO_NUMBERS = {"tcp": "6", "udp": "17"}
"""How ``iptables -n`` may print a rule's protocol."""


def _counted(hosts: Hosts, i: int, proto: str, port: int | None = None) -> tuple[int, int]:
    """Packets and bytes into host ``i`` that its ``proto`` (to ``port``) counter rule saw (an
    iptables rule in its namespace, inserted by :func:`_count`)."""
    out = subprocess.run(
        ["ip", "netns", "exec", hosts.netns(i), "iptables", "-nvxL", "INPUT"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        f = line.split()
        ported = "dpt:" in line  # the store port's rule, not the catch-all UDP one
        wanted = f"dpt:{port}" in line if port is not None else not ported
        if len(f) > 3 and f[3] in (proto, _PROTO_NUMBERS[proto]) and wanted:
            return int(f[0]), int(f[1])
    return 0, 0


def _count(hosts: Hosts, i: int, proto: str, port: int | None = None) -> None:
    """Insert the counter rule :func:`_counted` reads."""
    dport = ["--dport", str(port)] if port is not None else []
    subprocess.run(
        ["ip", "netns", "exec", hosts.netns(i), "iptables", "-I", "INPUT", "-p", proto,
         *dport, "-j", "ACCEPT"],
        check=True, timeout=30,
    )  # fmt: skip


def _first(events: list, name: str, **fields: object) -> dict[str, float]:
    """Each node's first event ``name`` (with ``fields``): node -> time."""
    out: dict[str, float] = {}
    for e in events:
        if e.event == name and all(e.fields.get(k) == v for k, v in fields.items()):
            out.setdefault(e.node, e.time)
    return out


def measure_stack(n: int, window_s: float, losses: int, workdir: Path) -> StackRow:
    """One job of ``n`` namespace hosts (module docstring, "Full stack")."""
    row = StackRow(n)
    script = [str(WORKLOAD), "--steps", "100000", "--step-delay", "0.3", *TINY]
    env = agent_env({}, pythonpath=[REPO])
    (workdir / f"h{n}").mkdir()
    with Hosts(n, shm_size="256m") as hosts:
        _count(hosts, 0, "tcp", RDZV_PORT)
        for i in range(n):
            _count(hosts, i, "udp")  # the failure detector's heartbeats (nothing else is UDP)
        m = Machines(
            hosts, workdir / f"h{n}", f"st{uuid.uuid4().hex[:8]}", n, script, env,
            extra=["--ftmem-standby", "0"], cwd=REPO,
        )  # fmt: skip
        launched = time.time()
        m.start_all(timeout=900)
        for i in range(n):
            m.wait_step(i, 1, timeout=900)
        row.stepping_s = time.time() - launched
        clients = [SmpClient(m.run_dir(i), timeout=timedelta(seconds=30)) for i in range(n)]
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                ex = [c.status().protection for c in clients]
                if all(x is not None and x.protected_step is not None for x in ex):
                    row.protected_s = time.time() - launched
                    break
                time.sleep(0.2)
        finally:
            for c in clients:
                c.close()
        row.form_cpu_s = PerNode.of([_host_cpu_s(hosts, i) for i in range(n)])
        events = read_events([m.run_dir(i) for i in range(n)]).events
        joining = _first(events, "state", state="joining")
        syncing = _first(events, "state", state="syncing")
        started = _first(events, "state", state="started")
        if joining and syncing:
            row.rendezvous_s = max(syncing.values()) - min(joining.values())
            row.round_s = max(syncing.values()) - max(joining.values())
        if syncing and started:
            row.mesh_s = max(started.values()) - max(syncing.values())
        procs = [psutil.Process(pid) for i in range(n) for pid in hosts.pids(i)]
        roles = {r: [p for p in procs if _role(p) == r] for r in ("agent", "smp")}
        cpu0 = {r: [_cpu_s(p.pid) for p in ps] for r, ps in roles.items()}
        pk0 = _counted(hosts, 0, "tcp", RDZV_PORT)[0]
        udp0 = [_counted(hosts, i, "udp") for i in range(n)]
        w0 = time.monotonic()
        time.sleep(window_s)
        wall = time.monotonic() - w0
        row.store_packets_per_s = (_counted(hosts, 0, "tcp", RDZV_PORT)[0] - pk0) / wall
        udp = [_counted(hosts, i, "udp") for i in range(n)]
        got = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(udp0, udp, strict=True)]
        row.heartbeats_per_s = PerNode.of([k / wall for k, _ in got])
        row.heartbeat_bytes_per_s = PerNode.of([nbytes / wall for _, nbytes in got])
        cpu = {
            r: PerNode.of(
                [100 * (_cpu_s(p.pid) - c) / wall for p, c in zip(ps, cpu0[r], strict=True)]
            )
            for r, ps in roles.items()
        }
        row.agent_cpu_pct, row.smp_cpu_pct = cpu["agent"], cpu["smp"]
        agents = roles["agent"]
        row.agent_threads = PerNode.of([float(p.num_threads()) for p in agents])
        row.agent_sockets = PerNode.of([float(_sockets(p.pid)) for p in agents])
        row.agent_rss_mib = PerNode.of([p.memory_info().rss / 2**20 for p in agents])
        for j in range(losses):
            victim = n - 1 - j % (n - 1)  # never host 0: it serves the rendezvous store
            watched = {
                i: len(re.findall(WATCHING, m.agents[i].text())) for i in range(n) if i != victim
            }
            row.detect_each_s.append(_lose(m, victim, n))
            if j + 1 < losses:
                _replace(m, victim, watched)
        if row.detect_each_s:
            row.detect_s = statistics.median(row.detect_each_s)
    return row


def _lose(m: Machines, victim: int, n: int) -> float:
    """Lose host ``victim`` silently (its link down, then its processes killed); the time
    until a survivor's event log names the loss."""
    lost = time.time()
    m.hosts.cut(victim)
    m.hosts.kill(victim)
    survivors = [m.run_dir(i) for i in range(n) if i != victim]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        found = [
            e.time for e in read_events(survivors).events
            if e.event in ("declared_lost", "machine_lost") and e.time > lost
        ]  # fmt: skip
        if found:
            return min(found) - lost
        time.sleep(0.2)
    raise RuntimeError(f"the loss of h{victim} was not declared within 180 s")


def _replace(m: Machines, victim: int, watched: dict[int, int]) -> None:
    """A replacement machine in the lost one's place: its link up, a fresh run directory, a
    new agent; returns once its rank steps and every agent's failure detector watches the new
    round (each survivor had logged ``watched[i]`` rounds), so that the next loss is measured
    like the first."""
    m.hosts.heal(victim)
    shutil.rmtree(m.run_dir(victim), ignore_errors=True)
    m.start(victim).wait_log(r"step \d+ loss", 900)
    m.agents[victim].wait_log(WATCHING, 300)
    for i, seen in watched.items():
        m.agents[i].wait_log(WATCHING, 300, count=seen + 1)


WATCHING = r"failure detector: generation \d+, watching"
"""The agent's log line when its failure detector starts watching a round."""


def render_stack(rows: list[StackRow], args: argparse.Namespace, load: str) -> list[str]:
    """The full-stack table of the section."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "",
        f"`python bench/scale.py --hosts {args.hosts} --window-s {args.window_s:g} --losses "
        f"{args.losses}` ({when}; "
        f"{load}): N network-namespace hosts, each an `ftmem-launch` agent (c10d rendezvous "
        "on host 0, erasure coding m=1, `--ftmem-standby 0`), its SMP and one rank of the test "
        "workload (0.3 s step delay); the agents' and SMPs' CPU over the window while training.",
        "",
        "| hosts | launch -> every rank stepping (s) | -> every node protected (s) | rendezvous "
        "(first joining -> last syncing, s) | the round (last joining -> last syncing, s) | "
        "mesh (last syncing -> last started, s) | store "
        "packets in per s | agent CPU (%) | SMP CPU (%) | agent threads | agent socket fds | "
        "agent RSS (MiB) | heartbeats in per host per s (bytes/s) | CPU per host to form the job (s) | silent loss -> declared (s; median (min-max) of the losses, each "
        "machine replaced before the next) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in rows:
        lines.append(
            f"| {r.n} | {r.stepping_s:.1f} | {f(r.protected_s, '{:.1f}')} | "
            f"{f(r.rendezvous_s)} | {f(r.round_s)} | {f(r.mesh_s)} | {r.store_packets_per_s:.1f} | "
            f"{_cell(r.agent_cpu_pct, '{:.1f}')} | {_cell(r.smp_cpu_pct, '{:.1f}')} | "
            f"{_cell(r.agent_threads)} | {_cell(r.agent_sockets)} | {_cell(r.agent_rss_mib)} | "
            f"{_cell(r.heartbeats_per_s, '{:.1f}')}; {_cell(r.heartbeat_bytes_per_s)} | "
            f"{_cell(r.form_cpu_s, '{:.1f}')} | {_spread(r.detect_each_s)} |"
        )
    return lines


def _spread(values: list[float]) -> str:
    """``median (min-max)`` of several measurements, or the one, or "-"."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _cell(v: PerNode | None, fmt: str = "{:.0f}") -> str:
    if v is None:
        return "-"
    return f"{fmt.format(v.median)} ({fmt.format(v.max)})"


def render(rows: list[ScaleRow], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    lines = [
        start,
        "## Scale: N SMPs on one machine (the control plane's per-node costs)",
        "",
        f"`python bench/scale.py --smps {args.smps} --rounds {args.rounds} --payload-kib "
        f"{args.payload_kib} --parity {args.parity}` ({when}; {load}; "
        f"{psutil.cpu_count()} vCPUs: every SMP of the job shares them). One rank per SMP, "
        "erasure coding in groups of at most 8; per-node figures are the median over the SMPs "
        "(max in brackets).",
        "",
        "| SMPs | start all (s) | bind all (s) | start the mesh (s) | its CPU per SMP (ms) | "
        "protect lag per round (s, median / max) | CPU per SMP per round (ms) | "
        "sent per node per round (KiB) | idle CPU per SMP (%) | threads | "
        "socket fds | TCP connections | RSS (MiB) | a lost node's generation: bind all / start "
        "the mesh / its rebuild (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lag = f"{statistics.median(r.lag_s):.2f} / {max(r.lag_s):.2f}"
        rebuilt = (
            f"{r.rebuild_bind_s or 0:.2f} / {r.rebuild_sync_s or 0:.2f} / {r.rebuild_own_s or 0:.2f}"
            + ("" if r.rebuilt_ok else " (WRONG BYTES)")
        )
        lines.append(
            f"| {r.n} | {r.start_s:.1f} | {r.bind_s:.2f} | {r.sync_s:.2f} | "
            f"{_cell(r.sync_cpu_ms)} | {lag} | {_cell(r.round_cpu_ms)} | "
            f"{_cell(r.sent_kib_per_round)} | {_cell(r.idle_cpu_pct, '{:.2f}')} | "
            f"{_cell(r.threads)} | {_cell(r.sockets)} | {_cell(r.tcp)} | "
            f"{_cell(r.rss_mib)} | {rebuilt} |"
        )
    lines.append(end)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run every N; print the section; write it (and the JSON) unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smps", default="16,32,64", help="SMP-level Ns, comma-separated ('': none)")
    p.add_argument("--hosts", default="4,8,16", help="full-stack Ns (namespace hosts; root)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--payload-kib", type=int, default=256)
    p.add_argument("--parity", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--window-s", type=float, default=10.0, help="full stack: the steady window")
    p.add_argument(
        "--losses",
        type=int,
        default=5,
        help="full stack: silent losses per N (each replaced)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    why = unavailable() if args.hosts else None
    if why:
        print(f"scale: no full-stack part: {why}", file=sys.stderr)
        args.hosts = ""
    base = Path(tempfile.mkdtemp(prefix="scale-", dir="/tmp"))
    load_start = f"{os.getloadavg()[0]:.1f}"
    rows: list[ScaleRow] = []
    stack: list[StackRow] = []
    try:
        for n in (int(x) for x in args.smps.split(",") if x):
            row = measure(n, args.parity, args.rounds, args.payload_kib * 1024, args.idle_s, base)
            print(json.dumps(asdict(row)), flush=True)
            rows.append(row)
        smp_load = f"1-minute load {load_start} at the start, {os.getloadavg()[0]:.1f} at the end"
        load_start = f"{os.getloadavg()[0]:.1f}"
        for n in (int(x) for x in args.hosts.split(",") if x):
            srow = measure_stack(n, args.window_s, args.losses, base)
            print(json.dumps(asdict(srow)), flush=True)
            stack.append(srow)
    except BaseException:
        print(f"scale: failed; the hosts' logs and run directories are kept in {base}")
        raise
    shutil.rmtree(base, ignore_errors=True)
    stack_load = f"1-minute load {load_start} at the start, {os.getloadavg()[0]:.1f} at the end"
    text = render(rows, args, smp_load)
    if stack:
        text = text.replace(
            _render.markers(SECTION)[1],
            "\n".join(render_stack(stack, args, stack_load)) + "\n" + _render.markers(SECTION)[1],
        )
    print(text)
    if args.json is not None:
        both = {"smps": [asdict(r) for r in rows], "hosts": [asdict(r) for r in stack]}
        args.json.write_text(json.dumps(both, indent=1))
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
