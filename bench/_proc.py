"""What the parts read of processes: CPU, page faults, memory, peak memory; and the time of
each phase of ``export_dcp`` (timing wrappers around its calls, for ``bench/flush.py``).
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil


def cpu_self() -> float:
    """CPU seconds (user + system) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``, all its threads, the children it reaped
    and its live descendants; 0.0 if it is gone. Resolution: the kernel's clock tick."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        kids = proc.children(recursive=True)
    except psutil.Error:
        return 0.0
    for kid in kids:
        with contextlib.suppress(psutil.Error):
            total += sum(kid.cpu_times()[:2])
    return float(total)


def proc_memory(pid: int) -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``RssShmem`` of ``pid`` in bytes (0 if unknown)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "RssShmem"), 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def minflt(pid: int | None) -> int:
    """Minor page faults of process ``pid`` so far (all its threads; /proc/<pid>/stat)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[7])  # field 10 of stat(5): minflt
    except (OSError, IndexError, ValueError):
        return 0


def dir_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class PhaseTimer:
    """Wraps export_dcp's calls (module attributes) to time its phases; restores them on exit."""

    def __init__(self) -> None:
        self.find = 0.0
        self.dcp = 0.0
        self.dcp_cpu = 0.0
        self.dcp_faults = 0
        self.manifest = 0.0

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        import torch.distributed.checkpoint.state_dict_saver as saver

        import ftmem.tiers.export as export

        orig_manifest, orig_save = export.write_manifest, saver.save

        def manifest(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_manifest(*a, **k)
            finally:
                self.manifest += time.perf_counter() - t0

        def save(*a: Any, **k: Any) -> Any:
            t0, c0, f0 = time.perf_counter(), cpu_self(), minflt(os.getpid())
            try:
                return orig_save(*a, **k)
            finally:
                self.dcp += time.perf_counter() - t0
                self.dcp_cpu += cpu_self() - c0
                self.dcp_faults += minflt(os.getpid()) - f0

        export.write_manifest = manifest  # type: ignore[assignment]
        saver.save = save  # type: ignore[assignment]  # export_dcp imports it at call time
        try:
            yield
        finally:
            export.write_manifest = orig_manifest  # type: ignore[assignment]
            saver.save = orig_save  # type: ignore[assignment]


def worker_proc(smp_pid: int) -> psutil.Process | None:
    """The SMP's flush worker (``python -m ftmem.tiers.flush_worker``), if it runs."""
    try:
        for c in psutil.Process(smp_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ftmem.tiers.flush_worker" in " ".join(c.cmdline()):
                    return c
    except psutil.Error:
        pass
    return None


def proc_cpu(p: psutil.Process | None) -> float:
    """CPU seconds (user + system) of ``p``; NaN if unknown."""
    if p is None:
        return float("nan")
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


class RssSampler:
    """Samples a process's anonymous resident memory (``RssAnon``) in a thread; keeps the peak.

    Anonymous memory leaves out the slot's shared-memory mapping, so the peak above the start
    is what the write allocated (buffers, copies of tensors).
    """

    def __init__(self, pid: int | None, interval: float = 0.02, base: int | None = None) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = self._read()
        self.start = self.peak if base is None else base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _read(self) -> int:
        return 0 if self.pid is None else proc_memory(self.pid)["RssAnon"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._read())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, self._read())

    @property
    def added(self) -> int:
        """Peak minus the value at the start, or ``base`` if given (bytes)."""
        return max(0, self.peak - self.start)
