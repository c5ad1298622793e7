"""Exec shim: ``python _exec_shim.py CMD ARGS...`` sets PR_SET_PDEATHSIG, then execs CMD.

It runs between the agent and each rank (the pid stays the same across the exec), so that a
SIGKILLed agent takes its ranks with it: the kernel sends SIGKILL to the rank when the
agent's thread that spawned it dies. The death signal survives ``execve`` (except for
set-user-id programs). Standard library only: it runs before the user's interpreter.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

PR_SET_PDEATHSIG = 1
ENV_AGENT_PID = "FTMEM_AGENT_PID"


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(parent: int | None) -> None:
    """Set the death signal; exit at once (status 137) if ``parent`` is given and no longer
    our parent: it died between fork and prctl, so nobody would kill us later."""
    set_pdeathsig()
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def main(argv: list[str]) -> None:
    """Set the death signal, check that the agent is still our parent, exec ``argv``."""
    if not argv:
        sys.stderr.write("usage: _exec_shim.py CMD [ARGS...]\n")
        raise SystemExit(2)
    agent = os.environ.get(ENV_AGENT_PID)
    die_with_parent(int(agent) if agent is not None else None)
    cmd = argv[0]
    path = cmd if os.sep in cmd else (shutil.which(cmd) or cmd)
    os.execv(path, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
