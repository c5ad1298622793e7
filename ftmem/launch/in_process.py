"""Ranks that survive a restart: the agent's side of ``ftmem.run`` (in-process restart).

A rank under :func:`ftmem.run` says so at its hello to the SMP. When another rank fails, the
agent takes such a rank's process out of elastic's ``SubprocessContext`` before elastic stops
the others (:meth:`InProcessRestarts.detach`), goes through elastic's restart as usual, and
when elastic asks for that local rank's process again gives the same one back
(:meth:`InProcessRestarts.adopt`, through the handler-factory swap standby ranks use) after
writing it a :class:`~ftmem.protocol.rejoin.RejoinOrder` with the environment a new process
would have had. The rank tore its process group down when its collective failed; it joins
the new group, restores from its SMP and trains on.

Kept (:meth:`InProcessRestarts.keepable`): alive, not stopped, not killed as hung, under
``ftmem.run`` (this very pid's hello said so), and stepped in the current generation: a rank
that fails while the others rejoin makes the next restart cold for every rank that had not
stepped again. A restart caused by the node's SMP side is cold for every rank, and so is a
rank whose global rank changed. A kept rank without progress within
``--ftmem-rejoin-timeout`` is SIGKILLed by the rank watch: an ordinary failure.

Every call comes from the agent's main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path
from typing import Any

from ftmem.launch.elastic_compat import detach_handlers, live_handlers
from ftmem.launch.monitor import RankProcess, current_progress
from ftmem.launch.workers import proc_state
from ftmem.protocol.rejoin import RejoinOrder, write_order
from ftmem.protocol.status import RankProgress

log = logging.getLogger(__name__)


class InProcessRestarts:
    """The node's ranks kept alive across the restart in progress.

    Resource handling: the detached handlers are this object's until :meth:`adopt` gives
    them back to elastic; :meth:`discard` SIGKILLs (and reaps) those left, and the agent
    calls it on every path that does not restart (and at shutdown).
    """

    def __init__(self, node: str, run_dir: Path) -> None:
        self._node = node
        self._run_dir = run_dir
        self._detached: dict[int, tuple[int, Any]] = {}
        """Local rank -> (its global rank, elastic's SubprocessHandler)."""
        self._generation = -1
        self._ftmem_env: dict[str, str] = {}
        self.adopted: dict[int, int] = {}
        """Global rank -> pid of the ranks kept in the newest start."""

    def keepable(
        self,
        pcontext: Any,
        global_ranks: dict[int, int],
        procs: list[RankProcess],
        progress: dict[int, RankProgress],
        hang_killed: set[int],
    ) -> list[int]:
        """The local ranks of ``pcontext`` that may rejoin the next generation in process
        (module docstring); ``global_ranks`` maps local to global ranks, ``progress`` is the
        SMP's newest view and ``hang_killed`` the pids killed as hung."""
        by_rank = {p.rank: p for p in procs}
        keep = []
        for local_rank, handler in live_handlers(pcontext).items():
            pid = int(handler.proc.pid)
            rank = global_ranks.get(local_rank)
            proc = by_rank.get(rank) if rank is not None else None
            entry = progress.get(rank) if rank is not None else None
            if (
                proc is None
                or entry is None
                or handler.proc.poll() is not None
                or pid in hang_killed
                or proc_state(pid) in (None, "T", "D", "Z", "X")
            ):
                continue
            if entry.in_process and entry.pid == pid and current_progress(proc, entry) is not None:
                keep.append(local_rank)
        return keep

    def detach(self, pcontext: Any, local_ranks: list[int], global_ranks: dict[int, int]) -> None:
        """Take ``local_ranks`` out of elastic's hands (see the module docstring)."""
        taken = detach_handlers(pcontext, local_ranks)
        for local_rank, handler in taken.items():
            self._detached[local_rank] = (global_ranks[local_rank], handler)
        if taken:
            log.info(
                "[%s] keeping ranks %s (pids %s) alive: they rejoin in process",
                self._node,
                [global_ranks[lr] for lr in taken],
                [int(h.proc.pid) for h in taken.values()],
            )

    def begin_generation(self, generation: int, ftmem_env: dict[str, str]) -> None:
        """The next start is of ``generation``; kept ranks get ``ftmem_env`` with their own."""
        self._generation = generation
        self._ftmem_env = dict(ftmem_env)
        self.adopted = {}

    def adopt(self, local_rank: int, env: dict[str, str], stdout: Any, stderr: Any) -> Any | None:
        """elastic wants a process for ``local_rank`` with ``env``: the kept one (handed its
        rejoin order), or None (start one: nothing kept, it died, or its rank changed)."""
        entry = self._detached.pop(local_rank, None)
        if entry is None:
            return None
        old_rank, handler = entry
        pid = int(handler.proc.pid)
        rank = int(env.get("RANK", "-1"))
        why = None
        if handler.proc.poll() is not None:
            why = f"it exited ({handler.proc.returncode})"
        elif rank != old_rank:
            why = f"its global rank changed {old_rank} -> {rank}"
        if why is None:
            _note_in_new_logs(handler, pid, stdout, stderr)
            order = RejoinOrder(
                generation=max(self._generation, 0),
                rank=rank,
                env={**self._ftmem_env, **{k: str(v) for k, v in env.items()}},
                agent_pid=os.getpid(),
                stdout=os.path.abspath(stdout) if stdout else "",
                stderr=os.path.abspath(stderr) if stderr else "",
            )
            try:
                write_order(self._run_dir, order)
            except OSError as exc:
                why = f"its rejoin order could not be written ({exc})"
        if why is not None:
            log.warning(
                "[%s/%d] kept pid %d cannot rejoin in process: %s; cold start",
                self._node,
                old_rank,
                pid,
                why,
            )
            _kill(handler)
            return None
        self.adopted[rank] = pid
        return handler

    def discard(self, why: str) -> None:
        """SIGKILL and reap every rank still held (no restart follows, or it was not asked
        for again)."""
        for local_rank, (rank, handler) in list(self._detached.items()):
            log.warning(
                "[%s/%d] kept pid %d is not rejoining (%s); SIGKILL",
                self._node,
                rank,
                handler.proc.pid,
                why,
            )
            _kill(handler)
            del self._detached[local_rank]


def _kill(handler: Any) -> None:
    """SIGKILL a handler's process group and reap it (bounded); close its log files."""
    with contextlib.suppress(OSError):
        handler.close(death_sig=signal.SIGKILL)
    with contextlib.suppress(Exception):
        handler.proc.wait(5)


def _note_in_new_logs(handler: Any, pid: int, stdout: Any, stderr: Any) -> None:
    """Start this generation's per-rank log files (elastic made up their names; the rank
    reopens its stdout and stderr onto them when it reads its order) with a line that says
    where its output went before."""
    olds = (getattr(handler, "_stdout", None), getattr(handler, "_stderr", None))
    for new, old in zip((stdout, stderr), olds, strict=True):
        if not new:
            continue
        where = getattr(old, "name", "the previous generation's log")
        with contextlib.suppress(OSError), open(new, "w") as f:
            f.write(f"[ftmem] pid {pid} rejoins in process; its earlier output is in {where}\n")
