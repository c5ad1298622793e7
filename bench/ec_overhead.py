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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec_overhead.py

from bench import _launch, _results
from bench import _stats as st
from bench._figures import (
    STRADDLE,
    Goal,
    goal_rows,
    job_step,
    kv,
    mib,
    over,
    pair_ratios,
    ranks,
    rows,
    straddles,
)
from bench._stats import fmt, stat
from ftmem.observe.timeline import read_events
from ftmem.testing.harness import launch_args

PART = "ec-overhead"
REPO = _launch.REPO
EXAMPLE = _launch.EXAMPLE
CONFIGS = ("no ftmem", "off", "on", "on curve")
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
    skip_reasons: dict[str, int] = field(default_factory=dict)
    """Skipped snapshots of every rank, by the SMP's reason."""
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
    on = ["--ftmem-ec-parity", "1", "--ftmem-ec-interval", "0"]
    return ([*on, "--ftmem-ec-encrypt"] if config == "on curve" else on), []


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
    for i, status in poller.last.items():
        ex = status.get("exchange") or {}
        if ex.get("enabled"):
            c = ex.get("counters") or {}
            res.status_rounds[i] = int(c.get("protected", 0))
            res.status_other[i] = {k: int(v) for k, v in c.items() if k != "protected"}
            res.protected_step[i] = ex.get("protected_step")
            res.own_bytes[i] = int(ex.get("own_bytes") or 0)
            res.parity_bytes[i] = int(ex.get("parity_bytes") or 0)
            res.sent_bytes[i] = int(ex.get("sent_bytes") or 0)
            res.last_protect_s[i] = float(ex.get("last_protect_s") or 0.0)
        for r, rs in (status.get("ranks") or {}).items():
            res.skipped[int(r)] = int(rs.get("skipped") or 0)
            for why, n in (rs.get("skips") or {}).items():
                res.skip_reasons[str(why)] = res.skip_reasons.get(str(why), 0) + int(n)
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


# ------------------------------------------------------------------------------ the section

Doc = dict[str, Any]


def _ec_configgoal_rows(r: Doc) -> list[Any]:
    def ft(f: Callable[[Any], str]) -> Callable[[tuple[str, list[Doc]]], str]:
        return lambda cx: "-" if cx[0] == "no ftmem" else f(cx)

    def vs(a: str, c: str) -> str:
        return stat(pair_ratios(r["runs"], a, c), ".3f")

    def vs_off(c: str) -> str:
        return vs("off", c) if c.startswith("on") else ("1" if c == "off" else "-")

    def node_median(key: str) -> Callable[[Doc], float | None]:
        return lambda x: st.median(x[key].values())

    return [
        ("config", lambda cx: cx[0]),
        ("step time", over(job_step, ".4f", " s")),
        ("vs off (per pair)", lambda cx: vs_off(cx[0])),
        (
            "vs no ftmem (per pair)",
            lambda cx: "1" if cx[0] == "no ftmem" else vs("no ftmem", cx[0]),
        ),
        ("SMP CPU per node", ft(over(node_median("smp_cpu_s"), ".1f", " s"))),
        ("snapshots committed per node (events)", ft(over(node_median("log_commits"), ".0f"))),
        ("skipped (all ranks, STATUS)", ft(over(lambda x: sum(x["skipped"].values()), ".0f"))),
        ("why (all runs)", ft(lambda cx: _reasons(cx[1]))),
    ]


def _reasons(runs: list[Doc]) -> str:
    """Skips summed over the runs, by the SMP's reason."""
    total: dict[str, int] = {}
    for x in runs:
        for why, n in (x.get("skip_reasons") or {}).items():
            total[why] = total.get(why, 0) + n
    return "; ".join(f"{why}: {n}" for why, n in sorted(total.items())) or "-"


def _ec_rounds(x: Doc) -> str:
    rounds = [f"{x['status_rounds'].get(k, '-')}/{len(v)}" for k, v in x["log_rounds"].items()]
    return ", ".join(rounds) or "-"


EC_RUNS = [
    ("repeat", lambda x: x["repeat"]),
    ("config", lambda x: x["config"]),
    ("load", lambda x: fmt(x["load_start"])),
    ("median step (ranks)", lambda x: ranks("rank_median")(x)),
    ("mean step (ranks)", lambda x: ranks("rank_mean")(x)),
    ("rounds status/events per node", _ec_rounds),
    ("SMP CPU s per node", lambda x: ranks("smp_cpu_s", ".1f")(x) or "-"),
    ("wall", lambda x: f"{x['wall_s']:.0f} s"),
    ("status", lambda x: x["error"] or "ok"),
]


def _ec_protection(on: list[Doc]) -> list[list[str]]:
    first = [{k: v.get("0", v.get(0)) for k, v in x.items() if isinstance(v, dict)} for x in on]
    rounds = [t for x in on for v in x["log_rounds"].values() for t in v]
    status, events = (
        [f["status_rounds"] for f in first],
        [len(f["log_rounds"] or []) for f in first],
    )
    return [
        ["rounds done (STATUS `counters.protected`, node 0, last poll)", stat(status, ".0f")],
        ["rounds done (SMP events, node 0)", stat(events, ".0f")],
        ["time per round (every round of every node)", stat(rounds, ".3f", " s")],
        ["own bytes per node", mib(st.finite(f["own_bytes"] for f in first))],
        ["parity bytes held per node", mib(st.finite(f["parity_bytes"] for f in first))],
        ["peer bytes sent per node (whole run)", mib(st.finite(f["sent_bytes"] for f in first))],
    ]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``ec-overhead``: per configuration, protection counters, every run."""
    out = [
        f"- job: {r['nodes']} `ftmem-launch` agents x 1 rank on 127.0.0.1, `{' '.join(r['example_args'])}`; "
        "configs: no ftmem (`--no-ftmem`), off (`--ftmem-ec-parity 0`), on (`--ftmem-ec-parity 1 --ftmem-ec-interval 0`: "
        "snapshot bytes on the tagged data channel), on curve (the same with `--ftmem-ec-encrypt`: CURVE for everything)",
        "",
    ]
    ok = [x for x in r["runs"] if x["ok"]]
    by = {c: xs for c in CONFIGS if (xs := [x for x in ok if x["config"] == c])}
    out += rows(_ec_configgoal_rows(r), by.items())
    for c in ("on", "on curve"):
        if on := by.get(c):
            out += kv(
                _ec_protection(on), (f"protection ('{c}' runs)", "median (min-max) over runs")
            )
    return {"ec-overhead": [*out, *rows(EC_RUNS, r["runs"])]}


def goals(r: Doc | None) -> list[Goal]:
    """Step time with erasure-coded protection on against off (adjacent runs)."""

    p, g = "ec-overhead", "step time, EC protection on / off"
    rat = pair_ratios(r["runs"], "off", "on") if r else []
    if not rat:
        return [Goal(p, g, STRADDLE)]
    return goal_rows(
        p,
        [(g, STRADDLE)],
        [(st.stat(rat, ".3f"), straddles(rat))],
        f"ec-overhead, {len(rat)} pairs",
    )


if __name__ == "__main__":
    sys.exit(_results.script_main(PART, run))
