"""Where the tests find the checkout and the workload, and the Python stacks of processes a
test started (for its failure report)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests._support import workload

REPO = Path(__file__).resolve().parents[2]
"""The repository checkout the tests run from."""
WORKLOAD = Path(workload.SCRIPT)
"""The script the tests train: the test workload, :mod:`tests._support.workload.train`."""


def python_stacks(pids: list[int], limit: int = 12, timeout: float = 20.0) -> str:
    """The Python stacks of up to ``limit`` of ``pids`` as ``py-spy dump`` prints them, each
    after the process's state and wait channel from ``/proc``, for a test's failure message
    when a wait runs out ("" without py-spy; a failed dump says why). A process whose dump
    shows no Python thread (e.g. a child stuck in its fork before the interpreter resumed)
    gets its native stacks from ``gdb`` where installed. Each dump briefly stops the process
    it reads."""
    import shutil

    spy = shutil.which("py-spy")
    if spy is None or not pids:
        return ""
    out = []
    for pid in pids[:limit]:
        text = _run([spy, "dump", "--native", "--pid", str(pid)], timeout)
        gdb = shutil.which("gdb")
        if "Thread " not in text and gdb is not None:
            bt = _run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"], timeout)
            text += "\nnative stacks (gdb):\n" + "\n".join(
                line for line in bt.splitlines() if line.startswith(("#", "Thread "))
            )
        lines = text.splitlines()
        if len(lines) > 60:
            lines = [*lines[:60], f"... {len(lines) - 60} more lines"]
        out.append(f"--- pid {pid} ({_proc_state(pid)}):\n" + "\n".join(lines))
    if len(pids) > limit:
        out.append(f"--- and {len(pids) - limit} more processes: {pids[limit:]}")
    return "\n".join(out)


def _run(args: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no dump: {exc}"
    return (done.stdout.strip() + "\n" + done.stderr.strip()).strip()


def _proc_state(pid: int) -> str:
    """``state S, wchan do_select, ppid 123`` from /proc (what a process waits in)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
    except (OSError, ValueError):
        return "gone"
    return f"state {fields[0]}, wchan {wchan}, ppid {fields[1]}"
