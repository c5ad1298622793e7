"""Machine-loss benchmark: a machine lost *silently* -> every rank stepping again, on namespace hosts.

    sudo python bench/machine_loss.py                 # 2 repeats per system and case (~25 min)
    python bench/machine_loss.py --repeats 1 --cases spare --no-write

Every run is on network-namespace hosts (:mod:`tests._support.hosts`: own address, host name
and /dev/shm each, a private bridge), 1 rank of the test workload per machine
(``tests/_support/workload/train.py``, the test-sized model, a 0.1 s step delay). A machine is
lost **silently**, as after a power cut: its link goes down first, then every process of it
is SIGKILLed, so no FIN or RST reaches its peers. The loss comes after step
``--fail-at-step`` of the lost machine's rank, once every standby rank is warm. Three cases:

- **spare**: 3 machines + a 4th waiting; machine 2 lost. ftmem-launch: the fourth waits as a
  hot spare. torchrun + DCP: a replacement torchrun is started on the fourth machine the
  moment machine 2 is lost (an operator who reacts at once: torchrun's best case).
- **shrink**: 4 machines, ``--nnodes 3:4``, no spare; machine 3 lost. Both may go on with 3
  (ftmem reshards from memory, torchrun's ranks ``dcp.load`` the newest checkpoint at 3).
- **store**: 3 machines + a 4th, the rendezvous on a 3-member etcd cluster with a member on
  each training machine, every agent given machine 0's member; machine 0 lost (that member,
  global rank 0, the ranks' store). ftmem-launch: ``etcd-v3``, the spare waiting. torchrun +
  DCP: ``etcd-v2`` (torch's only etcd backend, python-etcd: ``pip install 'ftmem[etcd]'``) on
  the same kind of cluster with the v2 API on, a replacement started at once.

ftmem-launch runs erasure coding m=1 with a key file and its defaults otherwise (failure
detector 1 s); torchrun runs torch's defaults (keep-alive 5 s x 3, c10d or etcd-v2) with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without which its restarts break), the example's
loop and ``dcp.save`` every ``--dcp-every`` steps to a directory all hosts share.

Measured: loss -> every rank logged a step again (each rank's first step line after the loss,
the latest of them; the hosts share one clock; a run that does not recover within
``--give-up`` seconds is reported as such), and the steps done again. For ftmem, the phases
from the survivors' event logs: **detect** (-> the first ``declared_lost``), **rendezvous**
(-> the last node's new round formed: ranks stopped, the round re-formed), **sync + rebuild**
(-> the last node's ranks started: the peer mesh, the lost snapshot rebuilt, for a shrink the
old mesh and the guest), **start -> stepping** (standby -> rank, ``ftmem.load``, the first
step). Written to docs/benchmarks.md (section ``bench:machine-loss``) with the machine's load.
Not part of ``bench/run.py`` (it needs root for the namespaces); it renders its own section.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/machine_loss.py

from bench import _launch, _render
from ftmem.observe.timeline import read_events
from tests._support.hosts import Hosts, unavailable
from tests._support.launcher import AgentProcess, agent_env
from tests._support.machines import RDZV_PORT, Machines

EXAMPLE = _launch.EXAMPLE
REPO = _launch.REPO
TINY = (
    "--d-model 32 --n-layers 1 --n-heads 2 --vocab 64 --seq-len 16 --batch-size 2 --log-every 1"
).split()
FTMEM = "ftmem-launch"
DCP = "torchrun + DCP"
SYSTEMS = (FTMEM, DCP)
CASES = {
    "spare": "a training machine lost, a hot spare waiting",
    "shrink": "no spare, `--nnodes 3:4`: the job goes on with 3",
    "store": "the machine of the etcd member every agent was given (and global rank 0)",
}
LOST = {"spare": 2, "shrink": 3, "store": 0}
"""The machine lost in each case."""
_STEP = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank (\d+)\] \S+ INFO: step (\d+) loss"
)
_RESUMED = re.compile(r"\[rank (\d+)\] resumed from step (\d+)")
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "machine-loss"


@dataclass
class Run:
    """One run of one system."""

    system: str
    case: str = "spare"
    lost_s: float | None = None
    """Kill -> every rank stepping again."""
    redone: int | None = None
    """Steps trained again after the restart."""
    phases: dict[str, float] = field(default_factory=dict)


def _steps(text: str) -> list[tuple[float, int, int]]:
    """(time, rank, step) of every step line in a log."""
    out = []
    for stamp, rank, step in _STEP.findall(text):
        t = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        out.append((t, int(rank), int(step)))
    return out


def _measure(run: Run, texts: list[str], killed: float, ranks: int) -> None:
    lines = [x for text in texts for x in _steps(text)]
    before = max((s for t, _, s in lines if t <= killed), default=None)
    after: dict[int, float] = {}
    for t, rank, _ in sorted(lines):
        if t > killed and rank not in after:
            after[rank] = t
    resumed = [int(s) for text in texts for _, s in _RESUMED.findall(text)]
    if len(after) == ranks:
        run.lost_s = round(max(after.values()) - killed, 3)
    if before is not None and resumed and run.lost_s is not None:
        run.redone = before - max(resumed)


def _lose(hosts: Hosts, i: int) -> float:
    """Lose machine ``i`` silently: its link first, then every process. Returns the time."""
    lost = time.time()
    hosts.cut(i)
    hosts.kill(i)
    return lost


def _ftmem_phases(run: Run, run_dirs: list[Path], lost: float) -> None:
    """The phases of a recovery from the survivors' event logs (module docstring)."""
    events = [e for e in read_events(run_dirs).events if e.time > lost]
    declared = [e.time for e in events if e.event in ("declared_lost", "machine_lost")]

    def last_state(state: str) -> float | None:
        firsts: dict[str, float] = {}
        for e in events:
            if e.event == "state" and e.fields.get("state") == state:
                firsts.setdefault(e.node, e.time)
        return max(firsts.values()) if firsts else None

    marks = [
        ("detect", min(declared, default=None)),
        ("rendezvous", last_state("syncing")),
        ("sync + rebuild", last_state("started")),
        ("start -> stepping", lost + run.lost_s if run.lost_s is not None else None),
    ]
    prev = lost
    for name, t in marks:
        if t is None:
            break
        run.phases[name] = round(t - prev, 3)
        prev = t


def _ready(agents: list[AgentProcess], timeout: float) -> None:
    """Every agent's standby rank is warm (a loss before that is a cold start: another case)."""
    for agent in agents:
        agent.wait_log(r"standby pid \d+ for local rank 0 ready", timeout)


def run_ftmem(workdir: Path, args: argparse.Namespace, case: str) -> Run:
    """ftmem-launch in ``case``; one machine lost silently."""
    run = Run(FTMEM, case)
    script = [str(EXAMPLE), "--steps", str(args.steps), "--step-delay", "0.1", *TINY]
    env = agent_env({"PET_FTMEM_STANDBY": "1"}, pythonpath=[REPO])
    lose = LOST[case]
    nnodes, min_nodes = (4, 3) if case == "shrink" else (3, None)
    with Hosts(4, shm_size="512m") as hosts:
        rid = "ml" + uuid.uuid4().hex[:8]
        m = Machines(hosts, workdir, rid, nnodes, script, env, cwd=REPO, min_nodes=min_nodes)
        if case == "store":
            m.use_etcd([0, 1, 2])
        m.start_all()
        _ready(list(m.agents.values()), 300)
        m.agents[lose].wait_log(rf"step {args.fail_at_step} loss", 300)
        lost = _lose(hosts, lose)
        survivors = [i for i in range(4) if i != lose]
        for i in survivors:
            m.agents[i].wait(args.give_up)
        _measure(run, [m.agents[i].text() for i in survivors], lost, 3)
        _ftmem_phases(run, [m.run_dir(i) for i in survivors], lost)
    return run


def run_dcp(workdir: Path, args: argparse.Namespace, case: str) -> Run:
    """torchrun + DCP in ``case``; one machine lost silently (a replacement started at once
    where a spare would wait)."""
    run = Run(DCP, case)
    ckpt = workdir / "ckpt"
    env = agent_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, pythonpath=[REPO])
    rid = "mld" + uuid.uuid4().hex[:8]
    lose = LOST[case]
    nnodes = "3:4" if case == "shrink" else "3"
    with Hosts(4, shm_size="512m") as hosts:
        backend, endpoint = "c10d", f"{hosts.addr(0)}:{RDZV_PORT}"
        if case == "store":
            m = Machines(hosts, workdir, rid, 3, [], env, cwd=REPO)
            m.use_etcd([0, 1, 2], api="v2")
            backend, endpoint = m.rdzv_backend, m.rdzv_endpoint

        def start(i: int) -> AgentProcess:
            conf = f"is_host={int(i == 0)}" if backend == "c10d" else "read_timeout=60"
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3",
                "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                "--rdzv-id", rid, "--rdzv-conf", conf,
                "--monitor-interval", "0.1",
                str(REPO / "bench" / "recovery.py"), "--_dcp-worker",
                "--ckpt-dir", str(ckpt), "--ckpt-every", str(args.dcp_every), "--",
                "--steps", str(args.steps), "--step-delay", "0.1", *TINY,
            ]  # fmt: skip
            return AgentProcess(hosts.command(i, cmd), workdir / f"dcp-h{i}.log", env, cwd=REPO)

        first = range(4) if case == "shrink" else range(3)
        jobs = {0: start(0)}
        time.sleep(1.0)
        jobs.update({i: start(i) for i in first if i != 0})
        jobs[lose].wait_log(rf"step {args.fail_at_step} loss", 300)
        lost = _lose(hosts, lose)
        if case != "shrink":
            jobs[3] = start(3)
        survivors = [i for i in range(4) if i != lose]
        deadline = time.monotonic() + args.give_up
        for i in survivors:
            try:
                jobs[i].wait(max(1.0, deadline - time.monotonic()))
            except Exception:  # did not end in time: measured as far as it got
                pass
        _measure(run, [jobs[i].text() for i in survivors], lost, 3)
    return run


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} (1 min) / {five:.1f} (5 min), {os.cpu_count()} vCPUs"


def result_rows(runs: list[Run], systems: Sequence[str]) -> list[str]:
    """One table row per system: recovery time (median, min-max), steps redone, runs."""
    rows = []
    for system in systems:
        mine = [r for r in runs if r.system == system]
        lost = [r.lost_s for r in mine if r.lost_s is not None]
        redone = sorted({r.redone for r in mine if r.redone is not None})
        cell = (
            f"{statistics.median(lost):.2f} ({min(lost):.2f}-{max(lost):.2f})"
            if lost
            else "did not recover"
        )
        rows.append(f"| {system} | {cell} | {', '.join(map(str, redone)) or '-'} | {len(mine)} |")
    return rows


def _case_block(case: str, runs: list[Run], when: str, load: str, give_up: float) -> list[str]:
    """The lines of one case, between markers of their own (a later run of some cases
    replaces only theirs)."""
    lines = [
        f"<!-- case:{case} -->",
        f"**{case}**: {CASES[case]} ({when}; {load}; not recovered: not stepping within "
        f"{give_up:.0f} s).",
        "",
        "| system | machine lost -> all ranks stepping (s) | steps done again | runs |",
        "|---|---|---|---|",
        *result_rows(runs, SYSTEMS),
    ]
    phases = [r.phases for r in runs if r.system == FTMEM and r.phases]
    if phases:
        names = list(phases[0])
        lines += [
            "",
            "ftmem-launch, phases (median s): "
            + ", ".join(
                f"{n} {statistics.median(p[n] for p in phases if n in p):.2f}" for n in names
            )
            + ".",
        ]
    return [*lines, "<!-- /case -->"]


def _kept_blocks(cases: list[str]) -> dict[str, str]:
    """The blocks of the cases not run now, from the section docs/benchmarks.md has."""
    start, end = _render.markers(SECTION)
    text = DOC.read_text() if DOC.exists() else ""
    section = text[text.find(start) : text.find(end)] if start in text else ""
    found = re.findall(r"(<!-- case:(\w+) -->.*?<!-- /case -->)", section, flags=re.S)
    return {case: block for block, case in found if case in CASES and case not in cases}


def render(runs: list[Run], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md (the cases not run now kept as they were)."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    kept = _kept_blocks(args.cases)
    lines = [
        start,
        "## A machine lost silently: ftmem-launch vs torchrun + DCP",
        "",
        f"`python bench/machine_loss.py --repeats {args.repeats}`: namespace machines x 1 "
        f"rank, the lost machine's link cut, then its processes killed, after step "
        f"{args.fail_at_step} of {args.steps}; DCP every {args.dcp_every} steps. Loss -> every "
        "rank stepping again (median, min-max), and the steps trained again.",
    ]
    for case in CASES:
        mine = [r for r in runs if r.case == case]
        if mine:
            lines += ["", *_case_block(case, mine, when, load, args.give_up)]
        elif case in kept:
            lines += ["", kept[case]]
    lines += [
        "",
        "Phases: detect (loss -> a survivor's failure detector declared it, with a second "
        "observer's agreement, and published it), rendezvous (-> the last node's new round "
        "formed: ranks stopped, rendezvous re-joined), sync + rebuild (-> the last node's ranks "
        "started: the peer mesh synced, the lost snapshot rebuilt), start -> stepping (standby "
        "-> rank, `ftmem.load`, the first step).",
        end,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write it to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fail-at-step", type=int, default=110)
    p.add_argument("--dcp-every", type=int, default=20)
    p.add_argument("--give-up", type=float, default=240.0, help="per run (s)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep each run's logs")
    args = p.parse_args(argv)
    # SIGTERM unwinds like an exception, so that every host (namespaces, mounts) is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why:
        print(f"machine_loss: {why}", file=sys.stderr)
        return 2
    runs: list[Run] = []
    loads = []
    for rep in range(args.repeats):
        for case in args.cases:
            for system in args.systems:  # alternating, so all see the same machine
                workdir = Path(tempfile.mkdtemp(prefix="ml-", dir="/tmp"))
                loads.append(_load())
                run = run_ftmem if system == FTMEM else run_dcp
                r = run(workdir, args, case)
                print(f"[{rep}] {case} {system}: lost {r.lost_s} s, redone {r.redone}, {r.phases}")
                runs.append(r)
                if args.keep:
                    print(f"logs kept in {workdir}")
                else:
                    shutil.rmtree(workdir, ignore_errors=True)
    text = render(runs, args, f"{loads[0]} at the start, {_load()} at the end")
    print(text)
    if not args.no_write:
        _render.write_section(DOC, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
