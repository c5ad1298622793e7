"""Ranks: how they are spawned (exec shim with a parent-death signal) and their ftmem env.

elastic's ``start_processes`` spawns the ranks (each in its own session); ftmem-launch only
wraps the command so that every rank dies with its agent (``_exec_shim.py`` sets
``PR_SET_PDEATHSIG`` and then execs the real command, keeping the pid), and adds the
``FTMEM_*`` variables the ftmem client reads.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftmem.config import ENV_EXPECTED_STEP, ENV_GENERATION, ENV_NODE, ENV_RUN_DIR, ENV_RUN_ID
from ftmem.launch.config import ENV_AGENT_PID

SHIM_PATH = Path(__file__).with_name("_exec_shim.py")


def wrap_entrypoint(
    entrypoint: Callable[..., Any] | str, args: list[str]
) -> tuple[Callable[..., Any] | str, list[str]]:
    """Return ``(entrypoint, args)`` that run the same command through the exec shim.

    Function entrypoints (``--run-path``) run in multiprocessing children and are left as
    they are (no parent-death signal for them; documented).
    """
    if not isinstance(entrypoint, str):
        return entrypoint, args
    return sys.executable, ["-S", str(SHIM_PATH), entrypoint, *args]


def rank_env(
    *, run_dir: Path, run_id: str, node: str, generation: int, expected_step: int | None = None
) -> dict[str, str]:
    """The ``FTMEM_*`` variables every rank of this node gets.

    ``expected_step`` is the newest step all of this node's ranks had committed before the
    failure that caused this restart ("" on the first start or if none): a restore that
    finds nothing although a step was expected means snapshots were lost (e.g. the SMP).
    """
    return {
        ENV_RUN_DIR: str(run_dir),
        ENV_RUN_ID: run_id,
        ENV_NODE: node,
        ENV_GENERATION: str(generation),
        ENV_EXPECTED_STEP: "" if expected_step is None else str(expected_step),
        ENV_AGENT_PID: str(os.getpid()),
    }


def kill_rank(pid: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    """Send ``sig`` to a rank's process group (it leads its own session); False if gone."""
    try:
        os.killpg(pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False


def describe_exit(exitcode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` for a process exit code (negative: signal)."""
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def proc_state(pid: int) -> str | None:
    """The one-letter state in ``/proc/<pid>/stat`` (``T``: stopped, ``D``: uninterruptible)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return None


def assign_slots(previous: list[int | None]) -> list[int]:
    """Give each node (by group rank) a slot: its block of global ranks (pure).

    ``previous[i]`` is the slot the node with group rank ``i`` held in the previous round
    (None for a new node). A node keeps its slot if it still exists (< the node count) and
    no node with a lower group rank kept it; the other nodes take the free slots in order.
    So survivors keep their global ranks and a replacement takes the lost node's ranks.
    """
    n = len(previous)
    slots: list[int | None] = [None] * n
    taken: set[int] = set()
    for i, prev in enumerate(previous):
        if prev is not None and 0 <= prev < n and prev not in taken:
            slots[i] = prev
            taken.add(prev)
    free = iter(s for s in range(n) if s not in taken)
    return [s if s is not None else next(free) for s in slots]
