"""Processes a test starts itself (ranks without a launcher, CLIs): each in a session of its
own, so that the whole group can be killed after the test (the ``procs`` fixture)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests._support import workload

REPO = Path(__file__).resolve().parents[2]
"""The repository checkout the tests run from."""
WORKLOAD = Path(workload.SCRIPT)
"""The script the tests train: the test workload, :mod:`tests._support.workload.train`."""


class Procs:
    """Processes a test started; each in its own session so the whole group can be killed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        """Start ``args`` in a new session in the checkout, stdout and stderr to ``log``."""
        f = open(log, "w")  # closed with the process
        p = subprocess.Popen(
            args,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=REPO,
        )
        f.close()
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        """SIGKILL the group of every process still running, then reap each (bounded)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


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
