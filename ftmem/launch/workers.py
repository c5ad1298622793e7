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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftmem.config import (
    ENV_CHECKFREE,
    ENV_EXPECTED_STEP,
    ENV_FLUSH_DIRS,
    ENV_GENERATION,
    ENV_NODE,
    ENV_REJOIN_TIMEOUT,
    ENV_RESHARD,
    ENV_RUN_DIR,
    ENV_RUN_ID,
)
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
    *,
    run_dir: Path,
    run_id: str,
    node: str,
    generation: int,
    expected_step: int | None = None,
    rejoin_timeout_s: float = 120.0,
    checkfree: bool = False,
    flush_dirs: Sequence[Path] = (),
    reshard: str = "",
) -> dict[str, str]:
    """The ``FTMEM_*`` variables every rank of this node gets, on top of elastic's.

    ``expected_step``: the newest step all of this node's ranks had committed before this
    restart's failure (a restore that then finds nothing means snapshots were lost).
    ``rejoin_timeout_s``: how long a rank under ``ftmem.run`` waits for its next generation.
    ``flush_dirs``: the disk tiers, nearest first. ``reshard``: the JSON
    :class:`~ftmem.protocol.rejoin.ReshardRequest` when the job's size changed, else "" (which
    also clears it for a rank that rejoins in process).
    """
    env = {
        ENV_REJOIN_TIMEOUT: f"{rejoin_timeout_s:g}",
        ENV_RUN_DIR: str(run_dir),
        ENV_RUN_ID: run_id,
        ENV_NODE: node,
        ENV_GENERATION: str(generation),
        ENV_EXPECTED_STEP: "" if expected_step is None else str(expected_step),
        ENV_AGENT_PID: str(os.getpid()),
        ENV_CHECKFREE: "1" if checkfree else "",
        ENV_RESHARD: reshard,
    }
    if flush_dirs:
        env[ENV_FLUSH_DIRS] = ":".join(str(d) for d in flush_dirs)
    return env


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


def is_gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie (``Z``/``X``) not reaped yet."""
    return proc_state(pid) in (None, "Z", "X")
