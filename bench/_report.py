"""Report helpers shared by the bench scripts: marked sections of docs/benchmarks.md, statistics
formatted as ``median (min-max)``, and the facts about the machine a run is on.

Every script writes its tables between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->`` and leaves the rest of the file alone (other scripts' sections and
hand-written text), reading the file right before it replaces it.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"
_TITLE = "# Benchmarks"


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of section ``name``."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def _insert_at(text: str, name: str, after: str | None) -> int:
    """Where a section that is not in ``text`` yet goes.

    After section ``after`` if it is there (``after="title"``: right below the ``# Benchmarks``
    title), else after the last marked section, else at the end. Hand-written text after the
    last marked section (e.g. a model appended by hand) stays after it.
    """
    if after == "title":
        i = text.find(_TITLE)
        if i != -1:
            eol = text.find("\n", i)
            return len(text) if eol == -1 else eol + 1
        return 0
    if after is not None:
        end = markers(after)[1]
        i = text.find(end)
        if i != -1:
            return i + len(end)
    last = text.rfind(":end -->")
    if last != -1 and text.rfind("<!-- bench:", 0, last) != -1:
        return last + len(":end -->")
    return len(text)


def write_section(path: Path, name: str, section: str, *, after: str | None = None) -> None:
    """Put ``section`` (which holds its own markers) into ``path`` in place of section ``name``.

    If the markers are not in the file yet, the section is inserted (see :func:`_insert_at`).
    The file is read right before it is replaced (write to a temporary file, then rename), so
    sections written meanwhile by other scripts are kept.
    """
    start_mark, end_mark = markers(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else _TITLE + "\n"
    body = section.strip("\n")
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end > start:
        new = text[:start] + body + text[end + len(end_mark) :]
    else:
        at = _insert_at(text, name, after)
        head, tail = text[:at].rstrip("\n"), text[at:].lstrip("\n")
        new = head + "\n\n" + body + "\n" + ("\n" + tail if tail else "")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(new)
    os.replace(tmp, path)


def finite(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers (not None, not NaN)."""
    return [float(v) for v in values if v is not None and not math.isnan(float(v))]


def median(values: Iterable[float | None]) -> float:
    """The median of the finite values, NaN if there are none."""
    vals = finite(values)
    return statistics.median(vals) if vals else float("nan")


def stat(values: Iterable[float | None], fmt: str = ".2f", unit: str = "") -> str:
    """``median (min-max)`` of the finite values (the median alone for one value; ``-``: none)."""
    vals = finite(values)
    if not vals:
        return "-"
    med = format(statistics.median(vals), fmt)
    lo, hi = format(min(vals), fmt), format(max(vals), fmt)
    if lo == hi:  # one value, or a range that does not show at this precision
        return f"{med}{unit}"
    return f"{med}{unit} ({lo}-{hi})"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo and the number of logical cores."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def fs_type(path: str | Path) -> tuple[str, str]:
    """(file system type, mount point) of the file system holding ``path``."""
    best = ("", "?")
    real = os.path.realpath(path)
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best[0]):
            best = (mp, part.fstype)
    return best[1], best[0]


def version_of(package: str) -> str:
    """The installed version of ``package``, or ``not installed``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def utc_now() -> str:
    """The current time as ``YYYY-MM-DD HH:MM UTC``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_facts(disk_root: str | Path | None = None) -> list[str]:
    """Bullet lines (without the bullet) describing the machine and the software versions."""
    mem = psutil.virtual_memory().total / 2**30
    out = [
        f"date: {utc_now()}",
        f"CPU: {cpu_model()}; memory {mem:.1f} GiB",
        f"Python {platform.python_version()}, torch {version_of('torch')}, "
        f"pyzmq {version_of('pyzmq')}, pyeclib {version_of('pyeclib')}, "
        f"Linux {platform.release()}",
    ]
    if disk_root is not None:
        fstype, mount = fs_type(disk_root)
        out.append(f"disk dir {disk_root}: {fstype} at {mount}; /dev/shm: {fs_type('/dev/shm')[0]}")
    return out


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


@dataclass(kw_only=True, slots=True)
class Outcome:
    """What one bench script measured in one run, and its rendered section."""

    name: str
    """The section's name (its markers are ``<!-- bench:NAME:start/end -->``)."""
    section: str
    """The Markdown section, markers included."""
    args: argparse.Namespace
    """The script's parsed arguments (``out``, ``no_write``, sizes, repeats...)."""
    data: Any = None
    """The script's own results, for the suite's summary and plots."""
    ok: bool = True
    """False if a measurement failed (the section says which)."""
    after: str | None = None
    """Where the section goes when the file does not have it yet (see :func:`write_section`)."""


def finish(outcome: Outcome) -> int:
    """Print the section, write it into ``args.out`` unless ``args.no_write``; the exit code."""
    print(outcome.section)
    if not getattr(outcome.args, "no_write", False):
        out = Path(outcome.args.out)
        write_section(out, outcome.name, outcome.section, after=outcome.after)
        print(f"# wrote {out}", file=sys.stderr)
    return 0 if outcome.ok else 1


def shown_command(script: str, argv: list[str]) -> str:
    """``python bench/SCRIPT ARGV`` with the arguments shell-quoted."""
    return " ".join(["python", f"bench/{script}", *(shlex.quote(a) for a in argv)])


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--out`` (the Markdown file) and ``--no-write`` (print only), as every script has."""
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print only, leave --out alone")


def generated_by(script: str, command: str) -> list[str]:
    """The lines that open a section: which script made it, and the command that ran."""
    return [
        f"Generated by `bench/{script}` (alone or within `bench/run.py`: see the command); "
        "every figure below was measured in this run.",
        "",
        "```",
        command,
        "```",
        "",
    ]
