"""Training-loop overhead of erasure-coded protection across nodes: protection on vs off.

    python bench/ec_overhead.py                  # 3 repeats of (no ftmem, off, on)
    python bench/ec_overhead.py --quick          # 1 repeat, fewer steps (a smoke test)
    python bench/ec_overhead.py --repeats 5 --steps 120 --no-write

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec_overhead.py

from bench import _launch, _results
from ftmem.observe.timeline import read_events
from ftmem.testing.harness import launch_args

PART = "ec-overhead"
REPO = _launch.REPO
EXAMPLE = _launch.EXAMPLE
CONFIGS = ("no ftmem", "off", "on")
FINAL_RE = re.compile(r"\[rank (\d+)\] final step (\d+)")  # the example's closing line


# ------------------------------------------------------------------------------ one run


@dataclass
class RunResult(_launch.JobRun):
    """One job of the nodes in one configuration."""

    final_steps: dict[int, int] = field(default_factory=dict)
    # Per node (index), from the last STATUS poll:
    status_rounds: dict[int, int] = field(default_factory=dict)
    status_other: dict[int, dict[str, int]] = field(default_factory=dict)
    protected_step: dict[int, int | None] = field(default_factory=dict)
    own_bytes: dict[int, int] = field(default_factory=dict)
    parity_bytes: dict[int, int] = field(default_factory=dict)
    sent_bytes: dict[int, int] = field(default_factory=dict)
    last_protect_s: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)
    smp_cpu_s: dict[int, float] = field(default_factory=dict)
    polls: int = 0
    # Per node, from the SMP's event log:
    log_rounds: dict[int, list[float]] = field(default_factory=dict)
    log_commits: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def script_args(args: argparse.Namespace) -> list[str]:
    """The example's arguments (model, steps, snapshot cadence), the same in every config."""
    cadence = _launch.flags(save_every=1, log_every=args.steps)
    return [
        _launch.example(),
        *_launch.flags(steps=args.steps),
        *_launch.model_flags(args),
        *cadence,
    ]


def config_args(config: str) -> tuple[list[str], list[str]]:
    """(launcher flags, extra example flags) of one configuration."""
    if config == "no ftmem":
        return ["--ftmem-ec-parity", "0"], ["--no-ftmem"]
    if config == "off":
        return ["--ftmem-ec-parity", "0"], []
    return ["--ftmem-ec-parity", "1", "--ftmem-ec-interval", "0"], []


def agent_args(
    i: int, nodes: int, port: int, rid: str, run_dir: Path, config: str, args: argparse.Namespace
) -> list[str]:
    """One agent's arguments: node ``i`` of ``nodes``, rendezvous at ``port`` (node 0 hosts)."""
    flags, extra = config_args(config)
    return launch_args(
        nnodes=nodes,
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_id=rid,
        is_host=i == 0,
        node=f"n{i}",
        run_dir=run_dir,
        monitor_interval=None,  # the launcher's default, as these runs always had
        flags=["--ftmem-peer-host", "127.0.0.1", *flags],
        script=[*script_args(args), *extra],
    )


def run_once(config: str, repeat: int, args: argparse.Namespace, tmp_root: Path) -> RunResult:
    """One job of ``args.nodes`` agents x 1 rank; bounded by ``args.run_timeout``."""
    res = RunResult(config, repeat, load_start=os.getloadavg()[0])
    rid = "eo" + uuid.uuid4().hex[:10]
    tmp = Path(tempfile.mkdtemp(prefix=f"{config.replace(' ', '')}{repeat}-", dir=tmp_root))
    run_dirs = [tmp / f"n{i}" for i in range(args.nodes)]
    port = _launch.free_port()
    env = _launch.job_env()
    agents: list[_launch.Agent] = []
    poller = _launch.StatusPoller(run_dirs)
    t0 = time.monotonic()
    try:
        for i in range(args.nodes):
            a = agent_args(i, args.nodes, port, rid, run_dirs[i], config, args)
            agents.append(_launch.Agent(a, tmp / f"agent-n{i}.log", env))
            if i == 0:
                agents[0].wait_log(r"SMP pid \d+ ready", args.start_timeout)
            else:
                time.sleep(0.5)  # join order = node order in the first round
        _launch.wait_all(
            list(agents),
            timeout=args.run_timeout - (time.monotonic() - t0),
            poller=poller if config != "no ftmem" else None,
            poll_s=args.poll,
        )
        res.wall_s = time.monotonic() - t0
        codes = [a.popen.returncode for a in agents]
        text = "\n".join(a.text() for a in agents)
        res.read_step_times(text)
        for r, v in FINAL_RE.findall(text):
            res.final_steps[int(r)] = int(v)
        if any(codes) or len(res.rank_median) != args.nodes:
            res.error = f"exit codes {codes}, step times of ranks {sorted(res.rank_median)}"
            for a in agents:
                res.notes.append(f"{a.log_path.name} tail: " + a.text()[-1500:])
        else:
            res.ok = True
    except (TimeoutError, RuntimeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        poller.close()
        for a in agents:
            a.stop()
    res.polls = poller.polls
    for i, st in poller.last.items():
        ex = st.get("exchange") or {}
        if ex.get("enabled"):
            c = ex.get("counters") or {}
            res.status_rounds[i] = int(c.get("protected", 0))
            res.status_other[i] = {k: int(v) for k, v in c.items() if k != "protected"}
            res.protected_step[i] = ex.get("protected_step")
            res.own_bytes[i] = int(ex.get("own_bytes") or 0)
            res.parity_bytes[i] = int(ex.get("parity_bytes") or 0)
            res.sent_bytes[i] = int(ex.get("sent_bytes") or 0)
            res.last_protect_s[i] = float(ex.get("last_protect_s") or 0.0)
        for r, rs in (st.get("ranks") or {}).items():
            res.skipped[int(r)] = int(rs.get("skipped") or 0)
            res.slots[int(r)] = len(rs.get("slots") or [])
    res.smp_cpu_s = dict(poller.cpu)
    for i, rd in enumerate(run_dirs):
        events = read_events([rd]).events
        res.log_rounds[i] = [float(e.fields["seconds"]) for e in events if e.event == "protected"]
        res.log_commits[i] = sum(e.event == "committed" for e in events)
    _launch.clean_up(res, rid, tmp, args.keep_logs)
    return res


@dataclass(kw_only=True)
class EcOverheadResult(_results.PartResult):
    """The EC overhead part's results: every run, in the order run."""

    nodes: int
    steps: int
    example_args: list[str]
    runs: list[RunResult] = field(default_factory=list)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = _results.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="1 repeat and fewer steps")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 60; quick 30)")
    p.add_argument("--nodes", type=int, default=3, help="agents (nodes), one rank each")
    _launch.add_model_args(p)
    _launch.add_job_args(p, run_timeout=300.0)
    p.add_argument("--start-timeout", type=float, default=120.0, help="node 0's SMP start (s)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="subset of: " + ", ".join(CONFIGS))
    return p


def run(argv: list[str]) -> EcOverheadResult:
    """Parse ``argv`` and run every configuration ``--repeats`` times, in turn."""
    p = get_args_parser()
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.steps = args.steps or (30 if args.quick else 60)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not set(configs) <= set(CONFIGS):
        p.error(f"--configs: unknown {sorted(set(configs) - set(CONFIGS))}")
    cfg = {"nodes": args.nodes, "steps": args.steps, "example_args": script_args(args)}
    res = EcOverheadResult(argv=argv, machine=_results.machine(), **cfg)
    tmp_root = Path(tempfile.mkdtemp(prefix="ecov-", dir="/tmp"))
    try:
        for rep in range(args.repeats):
            res.runs += [run_once(c, rep, args, tmp_root) for c in configs]
    finally:
        if not args.keep_logs:
            shutil.rmtree(tmp_root, ignore_errors=True)
    res.errors = [f"{r.config} #{r.repeat}: {r.error}" for r in res.runs if not r.ok]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    sys.exit(_results.script_main(PART, run))
