"""What every benchmark shares: the machine a run is on, results as JSON, the common CLI.

A measuring module's ``run(argv)`` returns a dataclass whose fields are plain data (numbers,
strings, lists and dicts of them, nested dataclasses), with a ``machine`` field
(:class:`Machine`), its ``argv`` and an ``errors`` list. :func:`to_json` writes it as
``{"part": NAME, "result": {...}}``; ``bench/_render.py`` turns such documents into the
sections of docs/benchmarks.md. No Markdown is made here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs" / "benchmarks.md"


def version_of(package: str) -> str:
    """The installed version of ``package``, or ``not installed``."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def fs_type(path: str | Path) -> tuple[str, str]:
    """(file system type, mount point) of the file system holding ``path``."""
    best = ("", "?")
    real = os.path.realpath(path)
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best[0]):
            best = (mp, part.fstype)
    return best[1], best[0]


@dataclass(kw_only=True)
class Machine:
    """The machine and software of a run, and its load (the machines here are shared)."""

    date: str
    cpu: str
    cores: int
    memory_gib: float
    versions: dict[str, str]  # Python, torch, pyzmq, pyeclib, xxhash, numpy, Linux.
    torch_threads: int
    load_start: float  # 1-minute load average when the part started.
    load_end: float = float("nan")
    seconds: float = 0.0  # Wall time of the part.
    disk: dict[str, str] = field(default_factory=dict)
    """The disk directory: ``dir``, ``fs``, ``mount``; and ``shm_fs`` (/dev/shm)."""
    t0: float = 0.0


@dataclass(kw_only=True)
class PartResult:
    """What every part's results hold: its arguments, the machine, the errors met."""

    argv: list[str]
    machine: Machine
    errors: list[str] = field(default_factory=list)


def machine(disk_dir: str | Path | None = None) -> Machine:
    """The facts of this machine now (call :func:`finish` when the part ends)."""
    import torch

    versions = {"python": platform.python_version(), "linux": platform.release()}
    for pkg in ("torch", "pyzmq", "pyeclib", "xxhash", "numpy"):
        versions[pkg] = version_of(pkg)
    m = Machine(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu_model(),
        cores=os.cpu_count() or 1,
        memory_gib=psutil.virtual_memory().total / 2**30,
        versions=versions,
        torch_threads=torch.get_num_threads(),
        load_start=os.getloadavg()[0],
        t0=time.monotonic(),
    )
    if disk_dir is not None:
        fs, mount = fs_type(disk_dir)
        m.disk = {"dir": str(disk_dir), "fs": fs, "mount": mount, "shm_fs": fs_type("/dev/shm")[0]}
    return m


def finish(m: Machine) -> Machine:
    """Record the load and the wall time at the end of the part."""
    m.load_end = os.getloadavg()[0]
    m.seconds = time.monotonic() - m.t0
    return m


def as_dict(result: Any) -> dict[str, Any]:
    """A result dataclass as plain data (NaN becomes None so the JSON stays standard)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        result = dataclasses.asdict(result)
    out: dict[str, Any] = clean(result)
    return out


def document(part: str, result: Any) -> dict[str, Any]:
    """The JSON document of one part's results."""
    return {"part": part, "result": as_dict(result)}


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` (tmp + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    """One part's JSON document."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or "part" not in doc or "result" not in doc:
        raise ValueError(f"{path}: not a bench results document")
    return doc


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--json FILE``, ``--out FILE`` (the Markdown file) and ``--no-write``."""
    p.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the Markdown file to update")
    p.add_argument("--no-write", action="store_true", help="print the section, leave --out alone")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: described by its docstring's first line, with the output
    flags (:func:`add_output_args`)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n", 1)[0])
    add_output_args(p)
    return p
