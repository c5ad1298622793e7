"""The ``ftmem timeline`` command (:func:`add_parser`, :func:`run`) and its picture: the marks
of a run (:mod:`ftmem.observe.timeline`) drawn with matplotlib (the ``plot`` extra), one lane
per node, the step on the y axis and the seconds since the run's first event on the x axis.
matplotlib is imported inside :func:`draw`, so importing this module does not need it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ftmem.observe.timeline import (
    Mark,
    finite_number,
    format_summary,
    marks_of,
    read_events,
    since_filter,
)

_STYLE: dict[str, tuple[str, str]] = {
    # category: (color, marker)
    "commit": ("tab:blue", "."),
    "protected": ("tab:purple", "s"),
    "flushed": ("tab:brown", "D"),
    "restore": ("tab:cyan", "v"),
}


_LEGEND = {"commit": "committed (per rank)", "restore": "restored / rebuilt"}
_VLINE: dict[str, dict[str, Any]] = {
    "detection": {"color": "tab:orange", "linestyle": "--", "linewidth": 1},
    "start": {"color": "tab:gray", "linestyle": ":", "linewidth": 1.2},
    "resume": {"color": "tab:green", "linewidth": 1.2},
    "stop": {"color": "black", "linewidth": 1.2},
}
"""The vertical line of each category drawn as one (``restart`` as ``start``)."""
_LINES: list[tuple[set[str], str, dict[str, Any]]] = [
    ({"failure"}, "failure", {"color": "tab:red", "marker": "X", "linestyle": ""}),
    ({"detection"}, "detected", _VLINE["detection"]),
    ({"start", "restart"}, "ranks (re)started", _VLINE["start"]),
    ({"resume"}, "resumed (shaded: detection to resume)", _VLINE["resume"]),
    ({"stop"}, "stopped (no progress)", _VLINE["stop"]),
]


def draw(marks: Sequence[Mark], t0: float, out: Path, title: str = "") -> None:
    """Plot ``marks`` into ``out`` (PNG), one lane per node.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'ftmem[plot]'``).
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    nodes = sorted({m.node for m in marks})
    fig = Figure(figsize=(11, 1.6 + 2.8 * max(1, len(nodes))), layout="constrained")
    axes = fig.subplots(max(1, len(nodes)), 1, sharex=True, squeeze=False)[:, 0]
    for ax, node in zip(axes, nodes, strict=False):
        _draw_lane(ax, [m for m in marks if m.node == node], t0)
        ax.set_ylabel(f"{node}\nstep")
        ax.grid(True, alpha=0.25)
    axes[-1].set_xlabel("seconds since the run's first event")
    present = {m.category for m in marks}
    legend = [
        Line2D([], [], color=c, marker=mk, linestyle="", label=_LEGEND.get(cat, cat))
        for cat, (c, mk) in _STYLE.items()
        if cat in present
    ] + [Line2D([], [], label=label, **style) for cats, label, style in _LINES if present & cats]
    fig.legend(handles=legend, loc="outside lower center", fontsize=8, ncols=5, frameon=False)
    fig.suptitle(title or "ftmem timeline")
    fig.savefig(out, dpi=110)


def _draw_lane(ax: Any, marks: list[Mark], t0: float) -> None:
    steps = [m.step for m in marks if m.step is not None]
    top = max(steps, default=1) * 1.08 + 1
    for cat, (color, marker) in _STYLE.items():
        pts = [(m.time - t0, m.step) for m in marks if m.category == cat and m.step is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            size = 10 if cat == "commit" else 34
            ax.scatter(xs, ys, s=size, color=color, marker=marker, zorder=3)
    failures = 0
    for m in marks:
        x = m.time - t0
        vline = _VLINE.get("start" if m.category == "restart" else m.category)
        if vline is not None:
            ax.axvline(x, **vline)
        if m.category == "failure":
            ax.scatter([x], [top], color="tab:red", marker="X", s=70, zorder=4)
            ax.annotate(
                m.label[:70],
                (x, top),
                textcoords="offset points",
                xytext=(4, -12 - 10 * (failures % 3)),  # staggered: failures come in bursts
                fontsize=7,
            )
            failures += 1
        elif m.category == "detection" and m.start is not None and m.start < m.time - 0.05:
            ax.axvspan(m.start - t0, x, color="tab:orange", alpha=0.08)  # a hang: idle till then
        elif m.category == "resume" and m.start is not None:
            _draw_recovery(ax, m, m.start - t0, x, top)
    restored: set[int | None] = set()
    for m in marks:
        if m.category == "restore" and m.step not in restored:
            restored.add(m.step)
            ax.annotate(
                m.label.split(" from ")[0].replace(f"rank {m.rank} ", ""),
                (m.time - t0, m.step or 0),
                textcoords="offset points",
                xytext=(-6, -12),
                ha="right",
                fontsize=7,
                color="tab:cyan",
            )
    ax.set_ylim(bottom=0, top=top * 1.1)


def _draw_recovery(ax: Any, m: Mark, detected: float, resumed: float, top: float) -> None:
    """Shade detection -> resume, split at the spawn of the new ranks when it is known."""
    spawn = finite_number(m.data.get("detect_to_spawn_s"))
    phases = [(detected, resumed, "tab:red", f"{resumed - detected:.1f} s to resume")]
    if spawn is not None and 0 <= spawn <= resumed - detected:
        mid = detected + spawn
        phases = [
            (detected, mid, "tab:red", f"stop + spawn {spawn:.2f} s"),
            (mid, resumed, "tab:olive", f"start, load, 1st step {resumed - mid:.2f} s"),
        ]
    for i, (a, b, color, text) in enumerate(phases):
        ax.axvspan(a, b, color=color, alpha=0.1)
        ax.annotate(
            text,
            (a, top * (0.8 - 0.08 * i)),
            textcoords="offset points",
            xytext=(3, 0),
            fontsize=7,
            color=color,
        )
    ax.annotate(
        f"resumed at step {m.step} ({resumed - detected:.2f} s after detection)",
        (resumed, top * 0.3),
        textcoords="offset points",
        xytext=(-4, 0),
        ha="right",
        fontsize=7,
        color="tab:green",
    )


def add_parser(sub: Any) -> None:
    """Add the ``timeline`` subcommand to the ``ftmem`` parser's subparsers."""
    t = sub.add_parser("timeline", help="draw (or summarize) a run from its event logs")
    t.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        metavar="RUN_DIR",
        help="run directory of each node (holding events.jsonl / smp-events.jsonl), or a file",
    )
    t.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (matplotlib)")
    t.add_argument("--text", action="store_true", help="print a text summary (no matplotlib)")
    t.add_argument(
        "--since",
        type=float,
        default=None,
        help="only events S seconds or more after the first event (negative: the last -S s)",
    )
    t.add_argument("--title", default="", help="title of the picture")


def run(args: argparse.Namespace) -> int:
    """Handle ``ftmem timeline``; return the exit code."""
    loaded = read_events(args.run_dirs)
    if not loaded.events:
        print(
            f"ftmem timeline: no events in {', '.join(map(str, args.run_dirs))} "
            f"({loaded.malformed} malformed line(s))",
            file=sys.stderr,
        )
        return 1
    t0 = loaded.events[0].time
    marks = since_filter(marks_of(loaded.events), t0, args.since)
    if args.text or args.output is None:
        print(format_summary(loaded, marks, t0))
    if args.output is not None:
        try:
            draw(marks, t0, args.output, args.title)
        except ImportError as exc:
            print(
                f"ftmem timeline: drawing needs matplotlib ({exc}): "
                "pip install 'ftmem[plot]' (or use --text)",
                file=sys.stderr,
            )
            return 2
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
