"""The benchmark suite: every bench script in one run; docs/benchmarks.md, its summary and plots.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e ".[plot]"``):

    python bench/run.py --quick          # small sizes, few repeats (a few minutes)
    python bench/run.py                  # 0.5 and 2 GiB states, full repeats (~40 min)
    python -m bench --smoke --out /tmp/bench.md    # seconds: does the suite start
    python bench/run.py --quick --parts snapshot,overhead --no-plots

It runs, one after the other on this machine, the parts below (each is also a script of its
own; the suite calls its ``run()`` with the arguments of the chosen profile, shown in every
section):

* ``snapshot`` (``bench/snapshot.py``): stall per snapshot, background copy and restore, ftmem
  against torch.save, dcp.save and a tuned dcp.async_save; memory per node on the way
  (``bench/memory.py``'s section);
* ``overhead`` (``bench/overhead.py``): end-to-end training overhead of the example, 2 ranks,
  a snapshot every step, every 10 steps, none, and dcp.save every 10 steps;
* ``recovery`` (``bench/recovery.py``): failure to resumed incl. lost work, ftmem-launch
  against torchrun + dcp.load;
* ``ec-protect`` (``bench/ec_protect.py``): erasure-coded protect and rebuild between nodes;
* ``ec-overhead`` (``bench/ec_overhead.py``): training overhead of EC protection, 3 nodes;
* ``flush`` (``bench/flush.py``): flush to disk against dcp.save;
* ``datapath`` (``bench/datapath.py``): CPU-seconds per snapshotted GiB (rank + SMP) against a
  memcpy, stall, time to safe, restore, skips, and dcp.async_save's CPU, one run on one state;
* ``gpu`` (``bench/gpu_datapath.py``): a CUDA state's snapshot (stall, D2H, restore H2D);
  "skipped: no CUDA" without a GPU.

Each part's section of ``--out`` is rewritten as soon as the part ends; then the top
"Summary" section (every goal of issue 6, met or missed and why, and the headline figures)
and the PNG plots in ``--img-dir`` (default: ``img/`` next to ``--out``). A part that fails is
reported in the summary, and the others still run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from bench import (
        _plots,
        _report,
        datapath,
        ec_overhead,
        ec_protect,
        flush,
        gpu_datapath,
        memory,
        overhead,
        recovery,
        snapshot,
    )
    from bench import _summary as summary
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _plots  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    import _summary as summary  # type: ignore[no-redef]
    import datapath  # type: ignore[no-redef]
    import ec_overhead  # type: ignore[no-redef]
    import ec_protect  # type: ignore[no-redef]
    import flush  # type: ignore[no-redef]
    import gpu_datapath  # type: ignore[no-redef]
    import memory  # type: ignore[no-redef]
    import overhead  # type: ignore[no-redef]
    import recovery  # type: ignore[no-redef]
    import snapshot  # type: ignore[no-redef]

logger = logging.getLogger("bench.run")

PARTS = (
    "snapshot",
    "overhead",
    "recovery",
    "ec-protect",
    "ec-overhead",
    "flush",
    "datapath",
    "gpu",
)
MODULES: dict[str, Any] = {
    "snapshot": snapshot,
    "overhead": overhead,
    "recovery": recovery,
    "ec-protect": ec_protect,
    "ec-overhead": ec_overhead,
    "flush": flush,
    "datapath": datapath,
    "gpu": gpu_datapath,
}
SCRIPTS = {
    "snapshot": "snapshot.py",
    "overhead": "overhead.py",
    "recovery": "recovery.py",
    "ec-protect": "ec_protect.py",
    "ec-overhead": "ec_overhead.py",
    "flush": "flush.py",
    "datapath": "datapath.py",
    "gpu": "gpu_datapath.py",
}

# Arguments of each part per profile. "smoke" runs only the snapshot part by default.
PROFILES: dict[str, dict[str, list[str]]] = {
    "smoke": {
        "snapshot": [
            *("--sizes", "0.02", "--repeats", "1", "--fwd-bwd-s", "0.05"),
            *("--simulate", "sleep", "--e2e-rounds", "0", "--skip-sync-staging"),
        ],
        "overhead": ["--cycles", "1", "--interval", "2", "--d-model", "32", "--vocab", "64"],
        "recovery": ["--repeats", "1", "--no-reference", "--steps", "6", "--fail-at-step", "3"],
        "ec-protect": ["--size-mib", "8", "--repeats", "1", "--cases", "3:1"],
        "ec-overhead": ["--configs", "off,on", "--steps", "6", "--repeats", "1"],
        "flush": ["--sizes", "0.02", "--repeats", "1", "--train-repeats", "0"],
        "datapath": ["--smoke"],
        "gpu": ["--smoke"],
    },
    "quick": {
        "snapshot": [
            *("--sizes", "0.125,0.25", "--repeats", "3", "--fwd-bwd-s", "0.3"),
            *("--e2e-rounds", "0", "--skip-sync-staging"),
        ],
        "overhead": ["--quick"],
        "recovery": ["--repeats", "1", "--no-reference"],
        "ec-protect": ["--size-mib", "64", "--repeats", "2", "--cases", "3:1"],
        "ec-overhead": ["--configs", "off,on", "--steps", "16", "--repeats", "1"],
        "flush": ["--sizes", "0.25", "--repeats", "2", "--train-repeats", "0"],
        "datapath": ["--quick"],
        "gpu": ["--quick"],
    },
    "full": {
        "snapshot": ["--sizes", "0.5,2", "--repeats", "5", "--e2e-rounds", "0"],
        "overhead": [],
        "recovery": ["--repeats", "3"],
        "ec-protect": ["--size-mib", "1024", "--repeats", "3"],
        "ec-overhead": ["--repeats", "3"],
        "flush": ["--sizes", "0.5,2", "--repeats", "3", "--train-repeats", "3"],
        "datapath": [],
        "gpu": [],
    },
}
# The parts each profile runs unless --parts says otherwise. --quick leaves out ec-overhead:
# its 3-node jobs take a minute and a half on their own here.
PROFILE_PARTS: dict[str, tuple[str, ...]] = {
    "smoke": ("snapshot",),
    "quick": tuple(p for p in PARTS if p != "ec-overhead"),
    "full": PARTS,
}
# --repeats N sets these flags of each part.
REPEAT_FLAGS = {
    "snapshot": "--repeats",
    "overhead": "--cycles",
    "recovery": "--repeats",
    "ec-protect": "--repeats",
    "ec-overhead": "--repeats",
    "flush": "--repeats",
    "datapath": "--repeats",
    "gpu": "--repeats",
}
PLOTS = ("bench-stall.png", "bench-overhead.png", "bench-recovery.png")


@dataclass
class PartRun:
    """One part of the suite: its arguments, outcome (None if it crashed) and wall time."""

    name: str
    argv: list[str]
    outcome: _report.Outcome | None = None
    error: str = ""
    seconds: float = 0.0


@dataclass
class SuiteRun:
    """Everything the summary needs."""

    profile: str
    command: str
    parts: dict[str, PartRun] = field(default_factory=dict)
    plots: dict[str, Path] = field(default_factory=dict)
    plot_note: str = ""
    seconds: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    """1-minute load average at the start and at the end."""
    peak_load: float = 0.0
    """The highest 1-minute load average seen between the parts."""

    def data(self, name: str) -> Any:
        """The data of part ``name`` if it ran and returned some, else None."""
        part = self.parts.get(name)
        return part.outcome.data if part is not None and part.outcome is not None else None


def _part_argv(name: str, args: argparse.Namespace) -> list[str]:
    argv = list(PROFILES[args.profile][name])
    if args.repeats is not None:
        argv += [REPEAT_FLAGS[name], str(args.repeats)]
    if args.sizes and name in ("snapshot", "flush"):
        argv += ["--sizes", args.sizes]
    if args.disk_dir and name in ("snapshot", "flush", "datapath"):
        argv += ["--disk-dir", str(args.disk_dir)]
    for extra in args.extra:
        part, _, text = extra.partition("=")
        if part == name:
            argv += shlex.split(text)
    return [*argv, "--out", str(args.out), "--no-write"]


def _shown_argv(argv: list[str]) -> list[str]:
    """A part's arguments without the suite's own output flags."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a != "--no-write":
            out.append(a)
    return out


def run_part(name: str, argv: list[str], suite_command: str) -> PartRun:
    """Run one part; a crash is caught and reported, not raised."""
    part = PartRun(name=name, argv=argv)
    module = MODULES[name]
    shown = _report.shown_command(SCRIPTS[name], _shown_argv(argv))
    command = f"{suite_command}\n# this part alone: {shown}"
    t0 = time.monotonic()
    try:
        part.outcome = module.run(argv, command=command)
    except (Exception, SystemExit) as exc:  # argparse errors are SystemExit
        part.error = f"{type(exc).__name__}: {exc}"
        logger.error("part %s failed:\n%s", name, traceback.format_exc())
    part.seconds = time.monotonic() - t0
    return part


def _write(path: Path, outcome: _report.Outcome) -> None:
    _report.write_section(path, outcome.name, outcome.section, after=outcome.after)


def _memory_outcome(part: PartRun, suite_command: str) -> _report.Outcome | None:
    """The memory section, from the snapshot part's readings."""
    results = part.outcome.data if part.outcome is not None else None
    readings = [r.memory for r in results or [] if r.memory is not None]
    if not readings:
        return None
    shown = _report.shown_command(SCRIPTS["snapshot"], _shown_argv(part.argv))
    section = memory.render(readings, command=f"{suite_command}\n# measured by: {shown}")
    return _report.Outcome(
        name=memory.SECTION,
        section=section,
        args=argparse.Namespace(),
        data=readings,
        after="snapshot",
    )


def draw_plots(suite: SuiteRun, img_dir: Path) -> None:
    """Draw every plot the measured data allows into ``img_dir`` (records them in ``suite``)."""
    if not _plots.available():
        suite.plot_note = "matplotlib is not installed (`pip install -e '.[plot]'`): no plots"
        return
    img_dir.mkdir(parents=True, exist_ok=True)
    makers: list[tuple[str, Callable[[SuiteRun, Path], bool]]] = [
        ("bench-stall.png", summary.plot_stall),
        ("bench-overhead.png", summary.plot_overhead),
        ("bench-recovery.png", summary.plot_recovery),
    ]
    for file, make in makers:
        path = img_dir / file
        try:
            if make(suite, path):
                suite.plots[file] = path
        except Exception:  # a plot must not lose the figures
            logger.error("plot %s failed:\n%s", file, traceback.format_exc())


def get_args_parser() -> argparse.ArgumentParser:
    """The suite's command line."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes, few repeats (minutes)")
    size.add_argument(
        "--smoke", action="store_true", help="tiny: the snapshot part only, unless --parts"
    )
    p.add_argument(
        "--parts",
        default=None,
        help="comma-separated subset of: " + ", ".join(PARTS) + "; or 'all' (default: the "
        "profile's: all, but --quick leaves out ec-overhead and --smoke runs snapshot only)",
    )
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    p.add_argument("--sizes", default=None, help="state sizes in GiB for snapshot and flush")
    p.add_argument("--repeats", type=int, default=None, help="repeats (overhead: cycles) per part")
    p.add_argument("--disk-dir", type=Path, default=None, help="a disk directory (not tmpfs)")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="PART=ARGS",
        help="more arguments for one part, e.g. --extra 'overhead=--cycles 20' (repeatable)",
    )
    p.add_argument("--out", type=Path, default=_report.DEFAULT_OUT, help="the Markdown file")
    p.add_argument("--img-dir", type=Path, default=None, help="PNGs (default: img/ by --out)")
    p.add_argument("--no-plots", action="store_true", help="do not draw the PNGs")
    p.add_argument("--no-write", action="store_true", help="print the sections only")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the suite; 0 if every part ran without failure."""
    argv = sys.argv[1:] if argv is None else argv
    p = get_args_parser()
    args = p.parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    default_parts = PROFILE_PARTS[args.profile]
    chosen = args.parts or ",".join(default_parts)
    parts = [x.strip() for x in (",".join(PARTS) if chosen == "all" else chosen).split(",")]
    parts = [x for x in parts if x]
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    unknown = (set(parts) | skip) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    parts = [x for x in PARTS if x in parts and x not in skip]
    args.out = args.out.absolute()
    img_dir = (args.img_dir or args.out.parent / "img").absolute()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    suite = SuiteRun(
        profile=args.profile,
        command=" ".join(["python bench/run.py", *(shlex.quote(a) for a in argv)]),
    )
    suite.load = (_report.load_average(), 0.0)
    t0 = time.monotonic()
    for name in parts:
        logger.info("part %s: starting (%.0f s into the suite)", name, time.monotonic() - t0)
        part = run_part(name, _part_argv(name, args), suite.command)
        suite.parts[name] = part
        logger.info("part %s: %s in %.0f s", name, part.error or "done", part.seconds)
        suite.peak_load = max(suite.peak_load, _report.load_average())
        outcomes = [part.outcome] if part.outcome is not None else []
        if name == "snapshot":
            mem = _memory_outcome(part, suite.command)
            outcomes += [mem] if mem is not None else []
        for outcome in outcomes:
            if args.no_write:
                print(outcome.section)
            else:
                _write(args.out, outcome)
    suite.seconds = time.monotonic() - t0
    suite.load = (suite.load[0], _report.load_average())
    if not args.no_plots:
        draw_plots(suite, img_dir)
    section = summary.render(suite, args.out)
    print(section)
    if not args.no_write:
        _report.write_section(args.out, summary.SECTION, section, after="title")
        print(f"# wrote {args.out} ({suite.seconds / 60:.1f} min)", file=sys.stderr)
    failed = [p.name for p in suite.parts.values() if p.error or not p.outcome or not p.outcome.ok]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
