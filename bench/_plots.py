"""PNG plots of a suite run (matplotlib, the ``plot``/``bench`` extra), drawn by ``bench/run.py``.

Each function takes plain numbers (already reduced from a part's results by the suite), draws
one figure with the Agg backend and writes it to ``path``. matplotlib is imported inside the
functions, so importing this module does not need it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Series:
    """One line or bar of a plot: a median per x, with its min and max."""

    label: str
    x: tuple[float, ...]
    median: tuple[float, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    color: str | None = None
    bold: bool = False
    """Drawn thicker (ftmem's own figures)."""


def available() -> bool:
    """True if matplotlib can be imported."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    return fig


def _errorbars(s: Series) -> list[list[float]]:
    return [
        [max(0.0, m - lo) for m, lo in zip(s.median, s.low, strict=True)],
        [max(0.0, hi - m) for m, hi in zip(s.median, s.high, strict=True)],
    ]


def _lines(ax: Any, series: Sequence[Series], goal: float | None, goal_label: str) -> None:
    markers = "os^vDP*X"
    for i, s in enumerate(series):
        ax.errorbar(
            s.x,
            s.median,
            yerr=_errorbars(s),
            marker=markers[i % len(markers)],
            markersize=8 if s.bold else 6,
            capsize=4,
            linewidth=3.0 if s.bold else 1.5,
            color=s.color,
            label=s.label,
            zorder=3 if s.bold else 2,
        )
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
    labels: Sequence[str],
    wall: Series,
    cpu: Series | None,
    path: Path,
    *,
    goal: float,
    title: str,
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
            ax.annotate(
                f"{value:+.1f}%",
                (rect.get_x() + rect.get_width() / 2, max(value, high, 0.0)),
                xytext=(0, 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none"},
            )
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
    systems: Sequence[str],
    phases: Sequence[tuple[str, Sequence[float]]],
    path: Path,
    *,
    title: str,
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
        bars = ax.barh(
            ys,
            vals,
            left=left,
            color=colors[i % len(colors)],
            edgecolor="white",
            hatch=hatch,
            label=name,
        )
        for rect, v in zip(bars, vals, strict=True):
            if v >= 0.6:
                ax.text(
                    rect.get_x() + v / 2,
                    rect.get_y() + rect.get_height() / 2,
                    f"{v:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="black",
                )
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
