"""Shrink benchmark: a machine killed, no spare -> the job stepping again on the survivors.

    sudo python bench/shrink.py                 # 2 repeats per system (~5 min)
    python bench/shrink.py --repeats 1 --no-write

Both systems run 4 machines x 1 rank of the test workload (the test-sized model, a 0.1 s
step delay) on network-namespace hosts with ``--nnodes 3:4`` and the same rendezvous
``last_call_timeout`` (how long the survivors wait for a spare before going on with 3); host 3
is killed (every process SIGKILLed, its /dev/shm wiped) after step ``--fail-at-step``.

- **ftmem-launch, shrink from memory**: erasure coding m=1 with a key file, ftmem's defaults
  otherwise. The survivors rebuild the lost machine's protected step in a guest SMP and the 3
  ranks reshard it from memory through DCP (:mod:`ftmem.launch.reshape`).
- **torchrun + DCP reshard from disk**: ``torchrun`` (torch's keep-alive, 5 s x 3) running the
  workload's loop with ``dcp.save`` every ``--dcp-every`` steps to a directory all hosts
  share; after the kill elastic restarts the survivors with 3 ranks, which ``dcp.load`` the
  newest checkpoint at the new world size (stock DCP resharding).

Measured: kill -> every rank logged a step again, and the steps trained again; for ftmem the
phases from the event logs: detect (a survivor's ``detected``), rendezvous (the round of 3
formed: the keep-alive bound and the last call for a spare), rebuild (the old mesh, the
guest's rebuild and the new mesh, until the ranks start), reshard + first step. Written to
docs/benchmarks.md (section ``bench:shrink``) with the machine's load. Not part of
``bench/run.py`` (it needs root for the namespaces); it renders its own section.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/shrink.py

from bench import _render
from bench.machine_loss import EXAMPLE, REPO, TINY, Run, _load, _measure, result_rows
from ftmem.observe.timeline import read_events
from tests._support.hosts import Hosts, unavailable
from tests._support.launcher import AgentProcess, agent_env
from tests._support.machines import RDZV_PORT, Machines

FTMEM = "ftmem-launch, shrink from memory"
DCP = "torchrun + DCP, reshard from disk"
SYSTEMS = (FTMEM, DCP)
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "shrink"


def run_ftmem(workdir: Path, args: argparse.Namespace) -> Run:
    """ftmem-launch on 4 machines, ``--nnodes 3:4``, no spare; machine 3 killed."""
    run = Run(FTMEM)
    script = [str(EXAMPLE), "--steps", str(args.steps), "--step-delay", "0.1", *TINY]
    env = agent_env({"PET_FTMEM_STANDBY": "1"}, pythonpath=[REPO])
    conf = f"last_call_timeout={args.last_call:g}"
    with Hosts(4, shm_size="512m") as hosts:
        rid = "sh" + uuid.uuid4().hex[:8]
        m = Machines(hosts, workdir, rid, 4, script, env, rdzv_conf=conf, cwd=REPO, min_nodes=3)
        m.start_all()
        m.agents[3].wait_log(rf"step {args.fail_at_step} loss", 300)
        killed = time.time()
        hosts.kill(3)
        for i in range(3):
            m.agents[i].wait(600)
        _measure(run, [m.agents[i].text() for i in range(4)], killed, 3)
        events = read_events([m.run_dir(i) for i in range(3)]).events
        after = [e for e in events if e.time > killed]

        def when(name: str, state: str | None = None, pick: Any = max) -> float | None:
            """The last (``pick``) survivor's time of event ``name`` after the kill."""
            times = [
                e.time
                for e in after
                if e.event == name and (state is None or e.fields.get("state") == state)
            ]
            return pick(times) if times else None

        marks = [
            ("detect", when("state", "detected", min)),
            ("rendezvous + last call", when("reshape")),
            ("rebuild + meshes", when("state", "started")),
            ("reshard + first step", killed + run.lost_s if run.lost_s is not None else None),
        ]
        prev = killed
        for name, t in marks:
            if t is None:
                break
            run.phases[name] = round(t - prev, 3)
            prev = t
        rebuilt = [
            float(e.fields["seconds"])
            for e in after
            if e.event == "rebuilt_lost" and isinstance(e.fields.get("seconds"), int | float)
        ]
        if rebuilt:
            run.phases["of which: old mesh + guest rebuild"] = max(rebuilt)
    return run


def run_dcp(workdir: Path, args: argparse.Namespace) -> Run:
    """torchrun + DCP on 4 machines, ``--nnodes 3:4``; machine 3 killed, no replacement."""
    run = Run(DCP)
    ckpt = workdir / "ckpt"
    env = agent_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, pythonpath=[REPO])
    rid = "shd" + uuid.uuid4().hex[:8]
    with Hosts(4, shm_size="512m") as hosts:

        def start(i: int) -> AgentProcess:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "3:4", "--nproc-per-node", "1", "--max-restarts", "3",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{RDZV_PORT}",
                "--rdzv-id", rid,
                "--rdzv-conf", f"is_host={int(i == 0)},last_call_timeout={args.last_call:g}",
                "--monitor-interval", "0.1",
                str(REPO / "bench" / "recovery.py"), "--_dcp-worker",
                "--ckpt-dir", str(ckpt), "--ckpt-every", str(args.dcp_every), "--",
                "--steps", str(args.steps), "--step-delay", "0.1", *TINY,
            ]  # fmt: skip
            return AgentProcess(hosts.command(i, cmd), workdir / f"dcp-h{i}.log", env, cwd=REPO)

        jobs = {0: start(0)}
        time.sleep(1.0)
        jobs.update({i: start(i) for i in (1, 2, 3)})
        jobs[3].wait_log(rf"step {args.fail_at_step} loss", 300)
        killed = time.time()
        hosts.kill(3)
        for i in range(3):
            jobs[i].wait(600)
        _measure(run, [j.text() for j in jobs.values()], killed, 3)
    return run


def render(runs: list[Run], args: argparse.Namespace, load: str) -> str:
    """The section of docs/benchmarks.md."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    start, end = _render.markers(SECTION)
    lines = [
        start,
        "## No spare: shrinking onto the survivors, from memory vs from disk",
        "",
        f"`python bench/shrink.py --repeats {args.repeats}` ({when}; {load}; 4 namespace "
        f"machines x 1 rank, `--nnodes 3:4`, `last_call_timeout={args.last_call:g}`, machine 3 "
        f"killed at step {args.fail_at_step} of {args.steps}, DCP every {args.dcp_every} "
        "steps). Kill -> the 3 survivors' ranks stepping again (median, min-max), and the "
        "steps trained again.",
        "",
        "| system | machine lost -> 3 ranks stepping (s) | steps done again | runs |",
        "|---|---|---|---|",
    ]
    lines += result_rows(runs, SYSTEMS)
    phases = [r.phases for r in runs if r.system == FTMEM and r.phases]
    if phases:
        names = list(phases[0])
        lines += [
            "",
            f"{FTMEM}, phases (median s): "
            + ", ".join(
                f"{n} {statistics.median(p[n] for p in phases if n in p):.2f}" for n in names
            )
            + " (detect: kill -> a survivor's `detected`; rendezvous + last call: -> the "
            "round of 3 formed, the keep-alive bound and the wait for a spare; rebuild + "
            "meshes: the old mesh with the guest SMP, its rebuild, the new mesh, until the "
            "ranks start; reshard + first step: `ftmem.load` reshards from memory, one step).",
        ]
    lines.append(end)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table; write it to docs/benchmarks.md unless told not."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--fail-at-step", type=int, default=90)
    p.add_argument("--dcp-every", type=int, default=20)
    p.add_argument("--last-call", type=float, default=5.0, help="last_call_timeout (s)")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep each run's logs")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = unavailable()
    if why:
        print(f"shrink: {why}", file=sys.stderr)
        return 2
    runs: list[Run] = []
    loads = []
    for rep in range(args.repeats):
        for system in SYSTEMS:  # alternating, so both see the same machine
            workdir = Path(tempfile.mkdtemp(prefix="sh-", dir="/tmp"))
            loads.append(_load())
            r = run_ftmem(workdir, args) if system == FTMEM else run_dcp(workdir, args)
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
