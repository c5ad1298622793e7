"""``ftmem plan``: a first-order goodput model of ftmem against periodic disk checkpoints.

A model, stated as one (Young 1974, Daly 2006; docs/benchmarks.md, "Goodput model", states
it and what it leaves out), not a measurement of any cluster. The job's MTBF is
``M = node MTBF / nodes``; ``goodput = 1 - waste``, clipped to [0, 1]:

- **ftmem** snapshots every step: waste ``F + (R + s / 2) / M`` (``F`` the snapshots' share
  of a step, ``R`` the recovery, ``s`` the step time);
- **disk** checkpoints every ``T`` s, each blocking training for ``C`` s: waste
  ``C / T + (restart + L + T / 2) / M``, smallest at ``T = sqrt(2 C M)``, where it is
  ``sqrt(2 C / M) + (restart + L) / M``.

The defaults are figures of the kind this repository's benches measure (:data:`SOURCES`);
the node MTBF has none.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

HOUR_S = 3600.0
CLUSTER_GPUS = tuple(2**i for i in range(3, 15))
"""Cluster sizes of the plot: 8 to 16384 GPUs."""
SOURCES = {
    "snapshot_overhead": "train_gpt.py end to end, snapshot every step: +4.5% per step "
    "(0.5 GiB state, 2 CPU cores shared by training and the copy)",
    "step_s": "the same run's median step time without snapshots, 1.5415 s",
    "recovery_s": "ftmem-launch rank death -> all ranks stepping 6.58 s (bench/recovery.py) "
    "+ ftmem.load in place of 0.52 GiB 0.069 s",
    "disk_save_s": "dcp.save to local disk + fsync, 0.52 GiB: 0.4542 s",
    "disk_load_s": "dcp.load in place (page cache), 0.52 GiB: 0.2658 s",
    "restart_s": "torchrun + DCP rank death -> all ranks stepping 6.10 s minus its own "
    "dcp.load 0.334 s",
}
"""Where each default comes from (docs/benchmarks.md)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanInputs:
    """The model's inputs (seconds unless stated); the defaults' sources: :data:`SOURCES`."""

    node_mtbf_s: float
    """Mean time between failures of one node."""
    nodes: int
    """Nodes of the job; any node's failure stops it."""
    gpus_per_node: int = 8
    """Only used to label cluster sizes in GPUs."""
    snapshot_overhead: float = 0.045
    """ftmem: fraction of each step's time the snapshot costs."""
    recovery_s: float = 6.65
    """ftmem: failure -> all ranks stepping again, restore from memory included."""
    step_s: float = 1.54
    """Time of one training step (ftmem loses half of one per failure)."""
    disk_save_s: float = 0.45
    """Disk: seconds one checkpoint blocks training (Young/Daly's C)."""
    disk_load_s: float = 0.27
    """Disk: seconds to reload a checkpoint after the restart."""
    restart_s: float = 5.77
    """Disk: failure -> ranks restarted and ready to load (detection, stop, spawn, import)."""
    disk_interval_s: float | None = None
    """Disk: checkpoint every this many seconds instead of the Young/Daly interval."""

    def __post_init__(self) -> None:
        if not self.node_mtbf_s > 0:
            raise ValueError("the node MTBF must be > 0")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes and GPUs per node must be >= 1")
        if not 0 <= self.snapshot_overhead < 1:
            raise ValueError("the snapshot overhead is a fraction in [0, 1)")
        for name in ("recovery_s", "step_s", "disk_save_s", "disk_load_s", "restart_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if self.disk_interval_s is not None and not self.disk_interval_s > 0:
            raise ValueError("the disk interval must be > 0")

    @property
    def job_mtbf_s(self) -> float:
        """The job's MTBF: node MTBF / nodes."""
        return job_mtbf(self.node_mtbf_s, self.nodes)


@dataclass(frozen=True, slots=True)
class Estimate:
    """One system's figures under the model."""

    system: str
    interval_s: float
    """Time between checkpoints (ftmem: one step)."""
    overhead: float
    """Fraction of time spent checkpointing, failures or not."""
    recovery_s: float
    """Per failure: restart and reload."""
    rework_s: float
    """Per failure: work redone on average."""
    failure_waste: float
    """Fraction of time lost to failures: (recovery + rework) / job MTBF."""
    goodput: float
    """1 - overhead - failure waste, clipped to [0, 1]."""

    @property
    def lost_per_failure_s(self) -> float:
        """Recovery plus rework."""
        return self.recovery_s + self.rework_s


def job_mtbf(node_mtbf_s: float, nodes: int) -> float:
    """The job's MTBF when any of ``nodes`` nodes failing stops it (pure)."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return node_mtbf_s / nodes


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval ``sqrt(2 C M)`` (Young/Daly; pure)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("need cost >= 0 and MTBF > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def disk_waste(interval_s: float, cost_s: float, recovery_s: float, mtbf_s: float) -> float:
    """Waste of checkpointing every ``interval_s``: ``C/T + (recovery + T/2) / M`` (pure)."""
    if interval_s <= 0:
        raise ValueError("interval must be > 0")
    return cost_s / interval_s + (recovery_s + interval_s / 2.0) / mtbf_s


def _goodput(waste: float) -> float:
    return min(1.0, max(0.0, 1.0 - waste))


def ftmem_estimate(p: PlanInputs) -> Estimate:
    """ftmem with a snapshot every step (pure)."""
    m = p.job_mtbf_s
    rework = p.step_s / 2.0
    failure = (p.recovery_s + rework) / m
    return Estimate(
        system=f"ftmem, every step (overhead {p.snapshot_overhead:.2%})",
        interval_s=p.step_s,
        overhead=p.snapshot_overhead,
        recovery_s=p.recovery_s,
        rework_s=rework,
        failure_waste=failure,
        goodput=_goodput(p.snapshot_overhead + failure),
    )


def disk_estimate(p: PlanInputs) -> Estimate:
    """Periodic disk checkpoints at the Young/Daly interval, or ``p.disk_interval_s`` (pure)."""
    m, c = p.job_mtbf_s, p.disk_save_s
    recovery = p.restart_s + p.disk_load_s
    if p.disk_interval_s is not None:
        t = p.disk_interval_s
        overhead = c / t
        name = f"disk, every {t:g} s"
    else:
        t = young_daly_interval(c, m) if math.isfinite(m) else math.inf
        # C / T and T / (2 M) in closed form: both sqrt(C / (2 M)), finite for any M.
        overhead = math.sqrt(c / (2.0 * m))
        name = "disk, Young/Daly interval"
    rework_waste = overhead if p.disk_interval_s is None else t / (2.0 * m)
    failure = recovery / m + rework_waste
    return Estimate(
        system=name,
        interval_s=t,
        overhead=overhead,
        recovery_s=recovery,
        rework_s=t / 2.0,
        failure_waste=failure,
        goodput=_goodput(overhead + failure),
    )


def break_even_overhead(p: PlanInputs) -> float:
    """The snapshot overhead below which ftmem's goodput beats the disk's (>= 0; pure)."""
    d, f = disk_estimate(p), ftmem_estimate(p)
    return max(0.0, d.overhead + d.failure_waste - f.failure_waste)


def sweep(
    p: PlanInputs, gpus: Sequence[int] = CLUSTER_GPUS
) -> list[tuple[int, Estimate, Estimate]]:
    """``(GPUs, ftmem, disk)`` for each cluster size in ``gpus`` (whole nodes; pure)."""
    out = []
    for g in gpus:
        q = replace(p, nodes=max(1, math.ceil(g / p.gpus_per_node)))
        out.append((g, ftmem_estimate(q), disk_estimate(q)))
    return out


def _dur(s: float) -> str:
    if not math.isfinite(s):
        return "never"
    if s >= 2 * HOUR_S:
        return f"{s / HOUR_S:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s"


def format_table(p: PlanInputs, overheads: Sequence[float]) -> str:
    """The text ``ftmem plan`` prints: cluster, one row per system, break-even, inputs."""
    m = p.job_mtbf_s
    rows = [ftmem_estimate(replace(p, snapshot_overhead=f)) for f in overheads]
    rows.append(disk_estimate(p))
    lines = [
        "ftmem plan: a goodput MODEL (first order, Young/Daly), fed by figures measured in "
        "docs/benchmarks.md; not a measurement",
        f"cluster: {p.nodes} node{'s' if p.nodes > 1 else ''} x {p.gpus_per_node} GPUs = "
        f"{p.nodes * p.gpus_per_node} GPUs; "
        f"node MTBF {p.node_mtbf_s / HOUR_S:g} h -> job MTBF {_dur(m)} "
        f"({86400 / m:.3g} failures per day)",
        "",
    ]
    head = (
        "system",
        "checkpoint every",
        "overhead",
        "lost per failure",
        "failure waste",
        "goodput",
    )
    table = [head] + [
        (
            e.system,
            _dur(e.interval_s),
            f"{e.overhead:.3%}",
            f"{_dur(e.lost_per_failure_s)} (recovery {e.recovery_s:.2f} s + redone "
            f"{_dur(e.rework_s)})",
            f"{e.failure_waste:.3%}",
            f"{e.goodput:.3%}",
        )
        for e in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for i, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        f"break-even: ftmem's goodput is the higher one while its snapshot overhead is below "
        f"{break_even_overhead(p):.3%} of the step time",
    ]
    worst = rows[-1]
    if worst.interval_s > m / 2 or max(e.lost_per_failure_s for e in rows) > m / 10:
        lines.append(
            "note: interval or recovery is not small against the job MTBF: the first-order model "
            "is rough here"
        )
    lines += ["", "inputs (defaults measured in docs/benchmarks.md, 2-core CPU machine):"]
    defaults = PlanInputs(node_mtbf_s=1.0, nodes=1)
    for f in fields(PlanInputs):
        if f.name in SOURCES:
            value = getattr(p, f.name)
            given = value != getattr(defaults, f.name)
            if f.name == "snapshot_overhead":
                given = any(o != defaults.snapshot_overhead for o in overheads)
                value = ", ".join(f"{o:g}" for o in overheads)
            lines.append(f"  {f.name} = {value}: " + ("given" if given else SOURCES[f.name]))
    return "\n".join(lines)


def draw(p: PlanInputs, overheads: Sequence[float], out: Path) -> None:
    """Plot goodput against cluster size (8 to 16384 GPUs) for each system into ``out``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'ftmem[plot]'``).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    styles = ["-", "--", "-.", ":"]
    for i, f in enumerate(overheads):
        pts = sweep(replace(p, snapshot_overhead=f))
        ax.plot(
            [g for g, _, _ in pts],
            [100 * e.goodput for _, e, _ in pts],
            color="tab:blue",
            linestyle=styles[i % len(styles)],
            marker="o",
            markersize=3,
            label=f"ftmem, snapshot every step, overhead {f:.2%}",
        )
    pts = sweep(p)
    ax.plot(
        [g for g, _, _ in pts],
        [100 * d.goodput for _, _, d in pts],
        color="tab:orange",
        marker="s",
        markersize=3,
        label="disk (dcp.save)" + disk_estimate(p).system.removeprefix("disk"),
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(CLUSTER_GPUS), [str(g) for g in CLUSTER_GPUS], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel(f"GPUs ({p.gpus_per_node} per node)")
    ax.set_ylabel("goodput (% of wall time kept)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(
        f"Goodput model: node MTBF {p.node_mtbf_s / HOUR_S:g} h; ftmem recovery "
        f"{p.recovery_s:g} s; disk C={p.disk_save_s:g} s, restart+reload "
        f"{p.restart_s + p.disk_load_s:g} s",
        fontsize=9,
    )
    fig.savefig(out, dpi=110)


def add_parser(sub: Any) -> None:
    """Add the ``plan`` subcommand to the ``ftmem`` parser's subparsers."""
    d = PlanInputs(node_mtbf_s=1.0, nodes=1)
    a = sub.add_parser(
        "plan",
        help="goodput model: ftmem vs periodic disk checkpoints (Young/Daly)",
        description="A first-order goodput model (see docs/benchmarks.md, 'Goodput model'); "
        "defaults are figures measured in docs/benchmarks.md.",
    )
    a.add_argument(
        "--mtbf-hours", type=float, required=True, metavar="H", help="MTBF of one node, in hours"
    )
    a.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes in the job")
    a.add_argument(
        "--gpus-per-node",
        type=int,
        default=d.gpus_per_node,
        metavar="G",
        help="default: %(default)s",
    )
    a.add_argument(
        "--snapshot-overhead",
        type=float,
        nargs="+",
        default=[d.snapshot_overhead],
        metavar="F",
        help="ftmem's cost as a fraction of the step time (default: %(default)s); several "
        "values: one row and one curve each",
    )
    for flag, default, what in (
        ("--recovery-s", d.recovery_s, "ftmem: failure -> all ranks stepping again"),
        ("--step-s", d.step_s, "step time (ftmem loses half a step per failure)"),
        ("--disk-save-s", d.disk_save_s, "disk: seconds a checkpoint blocks training (C)"),
        ("--disk-load-s", d.disk_load_s, "disk: reload after the restart"),
        ("--restart-s", d.restart_s, "disk: failure -> ranks restarted, ready to load"),
    ):
        a.add_argument(flag, type=float, default=default, metavar="S", help=f"{what} ({default})")
    a.add_argument(
        "--disk-interval-s",
        type=float,
        default=None,
        metavar="T",
        help="disk: checkpoint every T s instead of at the Young/Daly interval sqrt(2 C M)",
    )
    a.add_argument(
        "--plot", type=Path, default=None, metavar="PNG", help="draw goodput vs 8..16384 GPUs"
    )


def run(args: argparse.Namespace) -> int:
    """Handle ``ftmem plan``; return the exit code."""
    try:
        p = PlanInputs(
            node_mtbf_s=args.mtbf_hours * HOUR_S,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            snapshot_overhead=args.snapshot_overhead[0],
            recovery_s=args.recovery_s,
            step_s=args.step_s,
            disk_save_s=args.disk_save_s,
            disk_load_s=args.disk_load_s,
            restart_s=args.restart_s,
            disk_interval_s=args.disk_interval_s,
        )
        for f in args.snapshot_overhead:
            replace(p, snapshot_overhead=f)  # validates every value
    except ValueError as exc:
        print(f"ftmem plan: {exc}", file=sys.stderr)
        return 2
    print(format_table(p, args.snapshot_overhead))
    if args.plot is not None:
        try:
            draw(p, args.snapshot_overhead, args.plot)
        except ImportError as exc:
            print(
                f"ftmem plan: --plot needs matplotlib ({exc}): pip install 'ftmem[plot]'",
                file=sys.stderr,
            )
            return 2
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
