"""Small process helpers shared by the SMP and its clients."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists (a zombie counts as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
