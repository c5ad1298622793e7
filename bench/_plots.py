"""PNG plots of a suite run (matplotlib, the ``plot`` extra), drawn by ``bench/run.py``.

:func:`draw_all` reduces the parts' results JSON to series; each ``plot_*`` function draws one
figure with the Agg backend and writes it to ``path``. matplotlib is imported inside the
functions, so importing this module does not need it.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _stats as st
from bench.snapshot import figure

logger = logging.getLogger("bench.plots")


@dataclass(frozen=True, slots=True)
class Series:
    """One line or bar of a plot: a median per x, with its min and max."""

    label: str
    x: tuple[float, ...]
    median: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    color: str | None = None
    bold: bool = False  # Drawn thicker (ftmem's own figures).


def available() -> bool:
    """True if matplotlib can be imported."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _errorbars(s: Series) -> list[list[float]]:
    return [
        [max(0.0, m - lo) for m, lo in zip(s.median, s.low, strict=True)],
        [max(0.0, hi - m) for m, hi in zip(s.median, s.high, strict=True)],
    ]


def _lines(ax: Any, series: Sequence[Series], goal: float | None, goal_label: str) -> None:
    markers = "os^vDP*X"
    for i, s in enumerate(series):
        w = {"markersize": 8, "linewidth": 3.0, "zorder": 3} if s.bold else {"markersize": 6}
        w = {"linewidth": 1.5, "zorder": 2, **w}
        kw = {"marker": markers[i % len(markers)], "capsize": 4, "color": s.color, **w}
        ax.errorbar(s.x, s.median, yerr=_errorbars(s), label=s.label, **kw)
    if goal is not None:
        ax.axhline(goal, color="black", linestyle="--", linewidth=1.2, label=goal_label)
    ax.set_yscale("log")
    ax.set_xlabel("state size (GiB: params + AdamW moments, fp32)")
    ax.grid(True, which="both", alpha=0.3)
    xs = sorted({x for s in series for x in s.x})
    ax.set_xticks(xs, [f"{x:.2f}" for x in xs])
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)


def plot_stall(
    stall: Sequence[Series], restore: Sequence[Series], path: Path, *, title: str
) -> None:
    """Two panels: stall per snapshot and restore, in s/GiB (log scale), vs state size."""
    fig = _figure(12.0, 6.0)
    left, right = fig.subplots(1, 2)
    _lines(left, stall, 0.01, "goal: ftmem stall <= 0.01 s/GiB")
    left.set_ylabel("training-loop stall per snapshot (s/GiB)")
    left.set_title("Stall per snapshot (lower is better)")
    _lines(right, restore, 0.1, "goal: ftmem restore <= 0.1 s/GiB")
    right.set_ylabel("restore in place (s/GiB)")
    right.set_title("Restore (lower is better)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path)


def plot_overhead(
    labels: Sequence[str], wall: Series, cpu: Series | None, path: Path, *, goal: float, title: str
) -> None:
    """Bars of the overhead (%) of each configuration against training without snapshots.

    ``wall`` (and ``cpu``, the rank's CPU time) hold one median/min/max per label, in %.
    """
    fig = _figure(10.0, 5.6)
    ax = fig.subplots()
    n = len(labels)
    width = 0.38 if cpu is not None else 0.6
    xs = list(range(n))
    groups = [(wall, "wall time per step")]
    if cpu is not None:
        groups.append((cpu, "CPU time of the rank per step"))
    for g, (s, name) in enumerate(groups):
        off = (g - (len(groups) - 1) / 2) * width
        pos = [x + off for x in xs]
        bars = ax.bar(pos, s.median, width, yerr=_errorbars(s), capsize=4, label=name)
        for rect, value, high in zip(bars, s.median, s.high, strict=True):
            if value != value:
                continue
            xy = (rect.get_x() + rect.get_width() / 2, max(value, high, 0.0))
            box = {"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"}
            kw = {"textcoords": "offset points", "ha": "center", "fontsize": 8, "bbox": box}
            ax.annotate(f"{value:+.1f}%", xy, xytext=(0, 4), **kw)
    ax.axhline(goal, color="black", linestyle="--", linewidth=1.2, label=f"goal: +{goal:g}%")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xticks(xs, [label.replace(" (", "\n(") for label in labels], fontsize=9)
    ax.set_xlabel("snapshot interval (configuration)")
    ax.set_ylabel("overhead vs no snapshots (%), median and min-max")
    top = max([h for g, _ in groups for h in g.high if h == h] + [goal])
    bottom = min([lo for g, _ in groups for lo in g.low if lo == lo] + [0.0])
    ax.set_ylim(bottom - 0.08 * (top - bottom), top + 0.15 * (top - bottom))
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.savefig(path)


def plot_recovery(
    systems: Sequence[str], phases: Sequence[tuple[str, Sequence[float]]], path: Path, *, title: str
) -> None:
    """Horizontal stacked bars: each system's time from rank death to stepping, then lost work.

    ``phases``: (phase name, seconds per system), in time order; NaN counts as 0.
    """
    fig = _figure(12.0, 3.6)
    ax = fig.subplots()
    ys = list(range(len(systems)))
    left = [0.0] * len(systems)
    colors = ["#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c", "#c44e52"]
    for i, (name, secs) in enumerate(phases):
        vals = [0.0 if v != v else max(0.0, v) for v in secs]
        hatch = "//" if name.startswith("work lost") else None
        color = colors[i % len(colors)]
        bars = ax.barh(ys, vals, left=left, color=color, edgecolor="white", hatch=hatch, label=name)
        for rect, v in zip(bars, vals, strict=True):
            if v >= 0.6:
                xy = (rect.get_x() + v / 2, rect.get_y() + rect.get_height() / 2)
                ax.text(*xy, f"{v:.1f}", ha="center", va="center", fontsize=8, color="black")
        left = [a + b for a, b in zip(left, vals, strict=True)]
    for y, total in zip(ys, left, strict=True):
        ax.text(total, y, f"  {total:.1f} s", va="center", fontsize=9)
    ax.set_yticks(ys, systems)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.15 if left and max(left) > 0 else 1)
    ax.set_xlabel("seconds from the rank's death (medians over the runs)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path)


# ------------------------------------------------------------------------------ from results

_ASYNC = "dcp.async_save (async staging)"
STALL_SERIES = (
    ("torch.save", "disk+fsync", "torch.save (disk, fsync)", "#1f77b4"),
    ("dcp.save", "disk+fsync", "dcp.save (disk, fsync)", "#ff7f0e"),
    (_ASYNC, "blocking", "dcp.async_save, tuned: blocking call", "#2ca02c"),
    (_ASYNC, "stall with fence", "dcp.async_save, tuned: + staging wait", "#8c564b"),
    ("ftmem", "stall (save + fence)", "ftmem: save + fence", "#d62728"),
)
RESTORE_SERIES = (
    ("torch.load", "+ load_state_dict (/dev/shm)", "torch.load + load_state_dict", "#1f77b4"),
    ("dcp.load", "in place (/dev/shm)", "dcp.load in place", "#ff7f0e"),
    ("ftmem", "load in place", "ftmem.load in place", "#d62728"),
)


def _size_series(
    sizes: list[dict[str, Any]], system: str, metric: str, label: str, color: str
) -> Series | None:
    pts = []
    for s in sorted(sizes, key=lambda s: s["nbytes"]):
        v = st.per_gib(figure(s, system, metric), s["nbytes"])
        if v:
            pts.append((s["nbytes"] / st.GiB, st.median(v) or 0.0, min(v), max(v)))
    if not pts:
        return None
    x, med, lo, hi = (tuple(p[i] for p in pts) for i in range(4))
    return Series(label, x, med, lo, hi, color=color, bold=system == "ftmem")


def stall_from(doc: dict[str, Any], path: Path) -> bool:
    """Stall and restore per GiB against the state size (snapshot part); False if no data."""
    sizes = [s for s in doc["result"]["sizes"] if s["figures"]]
    stall = [x for row in STALL_SERIES if (x := _size_series(sizes, *row))]
    restore = [x for row in RESTORE_SERIES if (x := _size_series(sizes, *row))]
    if not stall:
        return False
    title = "Median and min-max over the repeats of one run; the state is params + AdamW moments"
    plot_stall(stall, restore, path, title=title + ", fp32")
    return True


def overhead_from(doc: dict[str, Any], path: Path) -> bool:
    """Overhead (%) of each configuration against none (overhead part); False if no data."""
    r = doc["result"]
    labels = [c for c in r["ratio"] if c != "none"]
    if not labels:
        return False

    def series(ratios: dict[str, list[float]], name: str) -> Series:
        vals = [[(x - 1) * 100 for x in ratios.get(c) or [float("nan")]] for c in labels]
        med = tuple(st.median(v) or float("nan") for v in vals)
        lo, hi = tuple(min(v) for v in vals), tuple(max(v) for v in vals)
        return Series(name, tuple(range(len(labels))), med, lo, hi)

    cpu = series(r["cpu_ratio"], "cpu") if r["cpu_ratio"] else None
    title = f"the GPT test workload, {r['nproc']} ranks, {r['params_m'] * 12:.0f} MB of state per rank; {r['method']}"
    plot_overhead(labels, series(r["ratio"], "wall"), cpu, path, goal=3.0, title=title)
    return True


def recovery_from(doc: dict[str, Any], path: Path) -> bool:
    """Recovery time line per system with the re-done work (recovery part); False if no data."""
    r = doc["result"]
    systems = [s for s in r["systems"] if any(x["system"] == s for x in r["runs"])]
    if len(systems) < 2:
        return False
    runs = {s: [x for x in r["runs"] if x["system"] == s] for s in systems}
    phases = [
        (k, [st.median(x["phases"].get(k) for x in runs[s]) or 0.0 for s in systems])
        for k in r["phase_names"]
    ]

    def lost(xs: list[dict[str, Any]]) -> float:
        ok = [x for x in xs if x["steps_lost"] is not None and x["step_time_s"]]
        return st.median(x["steps_lost"] * x["step_time_s"] for x in ok) or 0.0

    phases.append(("work lost (steps re-done)", [lost(runs[s]) for s in systems]))
    title = "Rank 1 SIGKILLed after a step: time until all ranks step again, plus re-done steps"
    plot_recovery([s.replace(" (", "\n(") for s in systems], phases, path, title=title)
    return True


_STALL_CAPTION = "Stall per snapshot and restore per GiB against the state size"
_OVERHEAD_CAPTION = "Training overhead against the snapshot interval"
PLOTS = (
    ("bench-stall.png", "snapshot", stall_from, _STALL_CAPTION),
    ("bench-overhead.png", "overhead", overhead_from, _OVERHEAD_CAPTION),
    ("bench-recovery.png", "recovery", recovery_from, "Failure to resumed: where the time goes"),
)


def draw_all(
    docs: dict[str, dict[str, Any]], img_dir: Path, rel_to: Path
) -> tuple[dict[str, str], str]:
    """Draw every plot the results allow; ({path relative to ``rel_to``: caption}, note)."""
    if not available():
        return {}, "matplotlib is not installed (`pip install -e '.[plot]'`): no plots"
    img_dir.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, str] = {}
    for file, part, make, caption in PLOTS:
        try:
            if part in docs and make(docs[part], img_dir / file):
                drawn[os.path.relpath(img_dir / file, rel_to)] = caption
        except Exception:  # a plot must not lose the figures
            logger.error("plot %s failed:\n%s", file, traceback.format_exc())
    return drawn, ""
