"""Machine-loss benchmark: a machine killed -> every rank stepping again, on namespace hosts.

    sudo python bench/machine_loss.py                 # 2 repeats per system (~10 min)
    python bench/machine_loss.py --repeats 1 --no-write

Both systems run 3 machines x 1 rank of the test workload (``ftmem/testing/workload/train.py``,
the test-sized model, a 0.1 s step delay) on network-namespace hosts (:mod:`ftmem.testing.hosts`: own address,
host name and /dev/shm each, a private bridge); host 0 serves the c10d rendezvous store;
host 2 is killed (every process SIGKILLed, its /dev/shm wiped) after step ``--fail-at-step``
(late enough that the standby ranks are warm).

- **ftmem-launch + hot spare**: a fourth machine waits as a spare (SMP, warm standby);
  erasure coding m=1 with a key file, ftmem's defaults otherwise (keep-alive 1 s x 5).
- **torchrun + DCP, replacement by hand**: ``torchrun`` with the c10d rendezvous (torch's
  defaults, keep-alive 5 s x 3; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which
  restarts break) running the example's loop with ``dcp.save`` every ``--dcp-every`` steps to
  a directory all hosts share; the replacement torchrun is started on the fourth machine the
  moment host 2 is killed (an operator who reacts at once: torchrun's best case).

Measured: kill -> every rank logged a step again (each rank's first step line after the kill,
the latest of them; the hosts share one clock), and the steps done again (the newest step
logged before the kill minus the step training resumed from). For ftmem, the spare's phases
from its event log: until the rendezvous round with the spare formed, the peer sync (the
rebuild of the lost machine's snapshot), the start of the ranks, the first step. Written to
docs/benchmarks.md (section ``bench:machine-loss``) with the machine's load. Not part of
``bench/run.py`` (it needs root for the namespaces); it renders its own section.
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
from ftmem.testing.harness import AgentProcess, agent_env
from ftmem.testing.hosts import Hosts, unavailable
from ftmem.testing.machines import RDZV_PORT, Machines

EXAMPLE = _launch.EXAMPLE
REPO = _launch.REPO
TINY = (
    "--d-model 32 --n-layers 1 --n-heads 2 --vocab 64 --seq-len 16 --batch-size 2 --log-every 1"
).split()
FTMEM = "ftmem-launch + hot spare"
FTMEM3 = "ftmem-launch + hot spare, keep-alive 1 s x 3"
DCP = "torchrun + DCP, replacement by hand"
SYSTEMS = (FTMEM, FTMEM3, DCP)
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
    if before is not None and resumed:
        run.redone = before - max(resumed)


def run_ftmem(workdir: Path, steps: int, fail_at: int, system: str) -> Run:
    """ftmem-launch on 3 machines plus a spare; machine 2 killed."""
    run = Run(system)
    script = [str(EXAMPLE), "--steps", str(steps), "--step-delay", "0.1", *TINY]
    env = agent_env({"PET_FTMEM_STANDBY": "1"}, pythonpath=[REPO])
    conf = "keep_alive_max_attempt=3" if system == FTMEM3 else ""
    with Hosts(4, shm_size="512m") as hosts:
        rid = "ml" + uuid.uuid4().hex[:8]
        m = Machines(hosts, workdir, rid, 3, script, env, rdzv_conf=conf, cwd=REPO)
        m.start_all()
        m.agents[2].wait_log(rf"step {fail_at} loss", 300)
        killed = time.time()
        hosts.kill(2)
        for i in (0, 1, 3):
            m.agents[i].wait(600)
        texts = [m.agents[i].text() for i in range(4)]
        _measure(run, texts, killed, 3)
        states = {
            str(e.fields["state"]): e.time
            for e in read_events([m.run_dir(3)]).events
            if e.event == "state" and e.time > killed
        }
        detected = [
            e.time
            for e in read_events([m.run_dir(0), m.run_dir(1)]).events
            if e.event == "state" and e.fields.get("state") == "detected"
        ]
        marks = [
            ("detect", min(detected, default=None)),
            ("rendezvous", states.get("syncing")),
            ("sync + rebuild", states.get("started")),
            ("start -> stepping", killed + run.lost_s if run.lost_s is not None else None),
        ]
        prev = killed
        for name, t in marks:
            if t is None:
                break
            run.phases[name] = round(t - prev, 3)
            prev = t
    return run


def run_dcp(workdir: Path, steps: int, fail_at: int, dcp_every: int) -> Run:
    """torchrun + DCP on 3 machines; machine 2 killed, a replacement started at once."""
    run = Run(DCP)
    ckpt = workdir / "ckpt"
    env = agent_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, pythonpath=[REPO])
    rid = "mld" + uuid.uuid4().hex[:8]
    with Hosts(4, shm_size="512m") as hosts:

        def start(i: int) -> AgentProcess:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "3", "--nproc-per-node", "1", "--max-restarts", "3",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{RDZV_PORT}",
                "--rdzv-id", rid, "--rdzv-conf", f"is_host={int(i == 0)}",
                "--monitor-interval", "0.1",
                str(REPO / "bench" / "recovery.py"), "--_dcp-worker",
                "--ckpt-dir", str(ckpt), "--ckpt-every", str(dcp_every), "--",
                "--steps", str(steps), "--step-delay", "0.1", *TINY,
            ]  # fmt: skip
            return AgentProcess(hosts.command(i, cmd), workdir / f"dcp-h{i}.log", env, cwd=REPO)

        jobs = {0: start(0)}
        time.sleep(1.0)
        jobs.update({i: start(i) for i in (1, 2)})
        jobs[2].wait_log(rf"step {fail_at} loss", 300)
        killed = time.time()
        hosts.kill(2)
        jobs[3] = start(3)
        for i in (0, 1, 3):
            jobs[i].wait(600)
        _measure(run, [j.text() for j in jobs.values()], killed, 3)
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


def render(runs: list[Run], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    lines = [
        start,
        "## A machine lost: ftmem-launch with a hot spare vs torchrun + DCP",
        "",
        f"`python bench/machine_loss.py --repeats {args.repeats}` ({when}; {load}; "
        f"3 namespace machines x 1 rank, step {args.fail_at_step} of {args.steps}, "
        f"DCP every {args.dcp_every} steps). Kill of machine 2 -> every rank stepping again "
        "(median, min-max), and the steps trained again.",
        "",
        "| system | machine lost -> all ranks stepping (s) | steps done again | runs |",
        "|---|---|---|---|",
    ]
    lines += result_rows(runs, SYSTEMS)
    for system in (FTMEM, FTMEM3):
        phases = [r.phases for r in runs if r.system == system and r.phases]
        if not phases:
            continue
        names = list(phases[0])
        lines += [
            "",
            f"{system}, phases (median s): "
            + ", ".join(
                f"{n} {statistics.median(p[n] for p in phases if n in p):.2f}" for n in names
            )
            + " (detect: kill -> a survivor's `detected`; rendezvous: -> the spare's round"
            " formed, mostly waiting out the keep-alive bound; sync + rebuild: the peer mesh"
            " syncs and the spare's SMP rebuilds the lost snapshot; start -> stepping: the"
            " standby becomes rank 2, `ftmem.load`, the first step).",
        ]
    lines.append(end)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write it to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fail-at-step", type=int, default=110)
    p.add_argument("--dcp-every", type=int, default=20)
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
        for system in SYSTEMS:  # alternating, so all see the same machine
            workdir = Path(tempfile.mkdtemp(prefix="ml-", dir="/tmp"))
            loads.append(_load())
            if system != DCP:
                r = run_ftmem(workdir, args.steps, args.fail_at_step, system)
            else:
                r = run_dcp(workdir, args.steps, args.fail_at_step, args.dcp_every)
            print(f"[{rep}] {system}: lost {r.lost_s} s, redone {r.redone}, {r.phases}")
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
