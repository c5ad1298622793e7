"""What the parts read of processes: CPU seconds and memory (``bench/flush.py`` keeps its own
page-fault and peak-memory readers)."""

from __future__ import annotations

import contextlib

import psutil


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
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1]) * 1024
    return out
