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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec_overhead.py

from bench import _figures as fg
from bench import _launch, _render, _results
from bench._stats import finite, fmt, median, stat
from ftmem.observe.timeline import read_events
from tests._support.launcher import launch_args

PART = "ec-overhead"
CONFIGS = ("no ftmem", "off", "on", "on curve", "on workers")
FINAL_RE = re.compile(r"\[rank (\d+)\] final step (\d+)")  # the example's closing line
EC_OFF = ["--ftmem-ec-parity", "0"]
EC_ON = ["--ftmem-ec-parity", "1", "--ftmem-ec-interval", "0"]
CONFIG_ARGS = {  # config: (launcher flags, extra example flags)
    "no ftmem": (EC_OFF, ["--no-ftmem"]),
    "off": (EC_OFF, []),
    "on": (EC_ON, []),
    "on curve": ([*EC_ON, "--ftmem-ec-encrypt"], []),
    "on workers": ([*EC_ON, "--ftmem-ec-encode-workers", "1"], []),
}


@dataclass
class RunResult(_launch.JobRun):
    """One job of the nodes in one configuration; per node (index) unless said otherwise."""

    final_steps: dict[int, int] = field(default_factory=dict)  # Per rank.
    # From the last STATUS poll of each SMP:
    status_rounds: dict[int, int] = field(default_factory=dict)
    status_other: dict[int, dict[str, int]] = field(default_factory=dict)
    protected_step: dict[int, int | None] = field(default_factory=dict)
    own_bytes: dict[int, int] = field(default_factory=dict)
    parity_bytes: dict[int, int] = field(default_factory=dict)
    sent_bytes: dict[int, int] = field(default_factory=dict)
    last_protect_s: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, int] = field(default_factory=dict)  # Per rank.
    skip_reasons: dict[str, int] = field(default_factory=dict)  # Every rank's, by reason.
    slots: dict[int, int] = field(default_factory=dict)  # Per rank.
    smp_cpu_s: dict[int, float] = field(default_factory=dict)
    polls: int = 0
    # From the SMP's event log: each protection round's seconds, snapshots committed.
    log_rounds: dict[int, list[float]] = field(default_factory=dict)
    log_commits: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def read_status(self, poller: _launch.StatusPoller) -> None:
        """The figures of each SMP's last STATUS, and its CPU seconds."""
        for i, status in poller.last.items():
            ex = status.get("protection") or {}
            if ex.get("enabled"):
                c = ex.get("counters") or {}
                self.status_rounds[i] = int(c.get("protected", 0))
                self.status_other[i] = {k: int(v) for k, v in c.items() if k != "protected"}
                self.protected_step[i] = ex.get("protected_step")
                for key in ("own_bytes", "parity_bytes", "sent_bytes"):
                    getattr(self, key)[i] = int(ex.get(key) or 0)
                self.last_protect_s[i] = float(ex.get("last_protect_s") or 0.0)
            for r, rs in (status.get("ranks") or {}).items():
                self.skipped[int(r)] = int(rs.get("skipped") or 0)
                for why, n in (rs.get("skips") or {}).items():
                    self.skip_reasons[str(why)] = self.skip_reasons.get(str(why), 0) + int(n)
                self.slots[int(r)] = len(rs.get("slots") or [])
        self.smp_cpu_s = dict(poller.cpu)
        self.polls = poller.polls


def script_args(args: argparse.Namespace) -> list[str]:
    """The example's arguments (model, steps, a snapshot every step), the same in every config."""
    cadence = _launch.flags(save_every=1, log_every=args.steps)
    steps = _launch.flags(steps=args.steps)
    return [_launch.example(), *steps, *_launch.model_flags(args), *cadence]


def run_once(config: str, repeat: int, args: argparse.Namespace, tmp_root: Path) -> RunResult:
    """One job of ``args.nodes`` agents x 1 rank, node 0 hosting the rendezvous; bounded by
    ``args.run_timeout``."""
    res = RunResult(config, repeat, load_start=os.getloadavg()[0])
    rid = "eo" + uuid.uuid4().hex[:10]
    tmp = Path(tempfile.mkdtemp(prefix=f"{config.replace(' ', '')}{repeat}-", dir=tmp_root))
    run_dirs = [tmp / f"n{i}" for i in range(args.nodes)]
    port = _launch.free_port()
    rdzv = {"nnodes": args.nodes, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": rid}
    flags, extra = CONFIG_ARGS[config]
    flags, script = ["--ftmem-peer-host", "127.0.0.1", *flags], [*script_args(args), *extra]
    env = _launch.job_env()
    agents: list[_launch.Agent] = []
    poller = _launch.StatusPoller(run_dirs)
    t0 = time.monotonic()
    try:
        for i, run_dir in enumerate(run_dirs):
            node = {"is_host": i == 0, "node": f"n{i}", "run_dir": run_dir}
            # monitor_interval=None: the launcher's default, as these runs always had.
            a = launch_args(**rdzv, **node, monitor_interval=None, flags=flags, script=script)
            agents.append(_launch.Agent(a, tmp / f"agent-n{i}.log", env))
            if i == 0:
                agents[0].wait_log(r"SMP pid \d+ ready", args.start_timeout)
            else:
                time.sleep(0.5)  # join order = node order in the first round
        left = args.run_timeout - (time.monotonic() - t0)
        polled = poller if config != "no ftmem" else None
        _launch.wait_all(list(agents), timeout=left, poller=polled, poll_s=args.poll)
        res.wall_s = time.monotonic() - t0
        codes = [a.popen.returncode for a in agents]
        text = "\n".join(a.text() for a in agents)
        res.read_step_times(text)
        res.final_steps = {int(r): int(v) for r, v in FINAL_RE.findall(text)}
        if any(codes) or len(res.rank_median) != args.nodes:
            res.error = f"exit codes {codes}, step times of ranks {sorted(res.rank_median)}"
            res.notes += [f"{a.log_path.name} tail: " + a.text()[-1500:] for a in agents]
        else:
            res.ok = True
    except (TimeoutError, RuntimeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        poller.close()
        for a in agents:
            a.stop()
    res.read_status(poller)
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


def _config_columns(r: Doc) -> list[Any]:
    """The columns of the per-configuration table, a row being a (config, its ok runs) pair."""

    def vs(a: str, c: str) -> str:
        return "1" if c == a else stat(fg.pair_ratios(r["runs"], a, c), ".3f")

    def ftmem(get: Any, spec: str = ".0f", unit: str = "") -> Any:  # "-" for the no-ftmem runs
        return lambda cx: "-" if cx[0] == "no ftmem" else fg.over(get, spec, unit)(cx)

    def node_median(key: str) -> Any:
        return lambda x: median(x[key].values())

    return [
        ("config", lambda cx: cx[0]),
        ("step time", fg.over(fg.job_step, ".4f", " s")),
        ("vs off (per pair)", lambda cx: vs("off", cx[0]) if cx[0] != "no ftmem" else "-"),
        ("vs no ftmem (per pair)", lambda cx: vs("no ftmem", cx[0])),
        ("SMP CPU per node", ftmem(node_median("smp_cpu_s"), ".1f", " s")),
        ("snapshots committed per node (events)", ftmem(node_median("log_commits"))),
        ("skipped (all ranks, STATUS)", ftmem(lambda x: sum(x["skipped"].values()))),
        ("why (all runs)", lambda cx: "-" if cx[0] == "no ftmem" else _reasons(cx[1])),
    ]


def _reasons(runs: list[Doc]) -> str:
    """Skips summed over the runs, by the SMP's reason."""
    total: dict[str, int] = {}
    for x in runs:
        for why, n in (x.get("skip_reasons") or {}).items():
            total[why] = total.get(why, 0) + n
    return "; ".join(f"{why}: {n}" for why, n in sorted(total.items())) or "-"


def _rounds(x: Doc) -> str:
    """Protection rounds of each node: from STATUS / from the events."""
    rounds = [f"{x['status_rounds'].get(k, '-')}/{len(v)}" for k, v in x["log_rounds"].items()]
    return ", ".join(rounds) or "-"


EC_RUNS = [
    ("repeat", lambda x: x["repeat"]),
    ("config", lambda x: x["config"]),
    ("load", lambda x: fmt(x["load_start"])),
    ("median step (ranks)", fg.ranks("rank_median")),
    ("mean step (ranks)", fg.ranks("rank_mean")),
    ("rounds status/events per node", _rounds),
    ("SMP CPU s per node", lambda x: fg.ranks("smp_cpu_s", ".1f")(x) or "-"),
    ("wall", lambda x: f"{x['wall_s']:.0f} s"),
    ("status", lambda x: x["error"] or "ok"),
]


def _protection(on: list[Doc]) -> list[list[str]]:
    """Key-value rows of the protection figures of the 'on' runs (node 0, every round)."""
    first = [{k: v.get("0", v.get(0)) for k, v in x.items() if isinstance(v, dict)} for x in on]
    rounds = [t for x in on for v in x["log_rounds"].values() for t in v]
    status = [f["status_rounds"] for f in first]
    events = [len(f["log_rounds"] or []) for f in first]
    return [
        ["rounds done (STATUS `counters.protected`, node 0, last poll)", stat(status, ".0f")],
        ["rounds done (SMP events, node 0)", stat(events, ".0f")],
        ["time per round (every round of every node)", stat(rounds, ".3f", " s")],
        ["own bytes per node", fg.mib(finite(f["own_bytes"] for f in first))],
        ["parity bytes held per node", fg.mib(finite(f["parity_bytes"] for f in first))],
        ["peer bytes sent per node (whole run)", fg.mib(finite(f["sent_bytes"] for f in first))],
    ]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``ec-overhead``: per configuration, protection counters, every run."""
    out = [
        f"- job: {r['nodes']} `ftmem-launch` agents x 1 rank on 127.0.0.1, `{' '.join(r['example_args'])}`; "
        "configs: no ftmem (`--no-ftmem`), off (`--ftmem-ec-parity 0`), on (`--ftmem-ec-parity 1 --ftmem-ec-interval 0`: "
        "snapshot bytes on the tagged data channel), on curve (the same with `--ftmem-ec-encrypt`: CURVE for everything), "
        "on workers (tagged, `--ftmem-ec-encode-workers 1`: one encode process per SMP)",
        "",
    ]
    ok = [x for x in r["runs"] if x["ok"]]
    by = {c: xs for c in CONFIGS if (xs := [x for x in ok if x["config"] == c])}
    out += fg.rows(_config_columns(r), by.items())
    for c in ("on", "on curve", "on workers"):
        if on := by.get(c):
            out += fg.kv(
                _protection(on), (f"protection ('{c}' runs)", "median (min-max) over runs")
            )
    return {"ec-overhead": [*out, *fg.rows(EC_RUNS, r["runs"])]}


def goals(r: Doc | None) -> list[fg.Goal]:
    """Step time with erasure-coded protection on against off (adjacent runs)."""
    g = "step time, EC protection on / off"
    rat = fg.pair_ratios(r["runs"], "off", "on") if r else []
    if not rat:
        return [fg.Goal(PART, g, fg.STRADDLE)]
    src = f"ec-overhead, {len(rat)} pairs"
    return [fg.Goal(PART, g, fg.STRADDLE, stat(rat, ".3f"), fg.straddles(rat), src)]


if __name__ == "__main__":
    sys.exit(_render.script_main(PART, run))
