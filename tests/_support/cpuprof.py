"""Opt-in pytest plugin: the CPU each test used, its processes and every process they started.

The suite is CPU-bound on a small machine (its wall time is about its CPU time over the
cores), so what a test costs is its CPU, not its wall time, and a test's daemons, ranks and
namespace hosts are not children pytest waits for. Each pytest(-xdist) process moves itself
into a control group of its own; every process a test starts inherits it, so the group's CPU
counter, read before and after each test, is that test's CPU (a process left running by an
earlier test is counted too). Needs root and cgroup v1 ``cpuacct`` or cgroup v2.

Use: ``python -m pytest -p tests._support.cpuprof`` (with ``FTMEM_CPUPROF_DIR``, default
``/tmp/ftmem-cpuprof``): one ``cpu-<worker>.tsv`` per worker, a line per test: node id, wall
seconds, CPU seconds, and the machine's idle CPU seconds meanwhile (all cores). The groups are
removed at the end when empty.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

_V1 = Path("/sys/fs/cgroup/cpuacct")
_V2 = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
_group: Path | None = None
"""This process's control group (set at its first test)."""
_table: IO[str] | None = None


def _group_dir(name: str) -> Path:
    """A new control group ``name`` under ftmem-cpuprof (v1 cpuacct, else v2)."""
    root = (
        _V1
        if (_V1 / "cpuacct.usage").exists()
        else next(p for p in _V2 if (p / "cpu.stat").exists())
    )
    d = root / "ftmem-cpuprof" / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def _usage_s(d: Path) -> float:
    """CPU seconds used by the processes of group ``d`` (and its past members)."""
    if (d / "cpuacct.usage").exists():
        return int((d / "cpuacct.usage").read_text()) / 1e9
    for line in (d / "cpu.stat").read_text().splitlines():
        key, value = line.split()
        if key == "usage_usec":
            return int(value) / 1e6
    raise RuntimeError(f"no usage_usec in {d / 'cpu.stat'}")


def _idle_s() -> float:
    """Idle CPU seconds of the whole machine since boot (all cores)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[4]) / os.sysconf("SC_CLK_TCK")


def _open() -> None:
    """Moves this pytest process into a control group of its own and opens its table (at
    its first test: pytest-xdist's controller runs none)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    d = _group_dir(f"{worker}-{os.getpid()}")
    (d / "cgroup.procs").write_text(str(os.getpid()))
    out = Path(os.environ.get("FTMEM_CPUPROF_DIR", "/tmp/ftmem-cpuprof"))
    out.mkdir(parents=True, exist_ok=True)
    global _group, _table
    _group, _table = d, open(out / f"cpu-{worker}.tsv", "a", buffering=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    """Writes the test's wall, CPU and idle seconds (setup and teardown included)."""
    if _group is None:
        _open()
    assert _group is not None and _table is not None
    t0, cpu0, idle0 = time.monotonic(), _usage_s(_group), _idle_s()
    yield
    wall, cpu, idle = time.monotonic() - t0, _usage_s(_group) - cpu0, _idle_s() - idle0
    _table.write(f"{item.nodeid}\t{wall:.1f}\t{cpu:.1f}\t{idle:.1f}\n")


def pytest_unconfigure(config: object) -> None:
    """Leaves the group (back to the root's) and removes it if nothing else is in it."""
    if _table is not None:
        _table.close()
    if _group is not None:
        with contextlib.suppress(OSError):
            (_group.parents[1] / "cgroup.procs").write_text(str(os.getpid()))
            _group.rmdir()
