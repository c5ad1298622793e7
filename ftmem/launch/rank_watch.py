"""The agent's watch over its node's rank processes: stopped ranks and hung ranks.

elastic notices ranks that exit; it does not notice a rank that stops (SIGSTOP: it cannot
act on the SIGTERM elastic sends the survivors, so a restart would stall) or one that hangs.
:class:`RankWatch` SIGKILLs both, so that elastic's own failure handling takes over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from ftmem.launch.monitor import EventLog, HangVerdict, RankProcess, current_progress, find_hangs
from ftmem.launch.workers import is_gone, kill_rank, proc_state
from ftmem.protocol.status import RankProgress

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RankWatch:
    """The node's current ranks, and the hung ranks it killed in this generation."""

    node: str
    events: EventLog
    hang_timeout: timedelta
    first_progress_timeout: timedelta
    rejoin_timeout: timedelta = timedelta(0)
    procs: list[RankProcess] = field(default_factory=list, init=False)
    """The ranks of the current generation."""
    hang_killed: dict[int, HangVerdict] = field(default_factory=dict, init=False)
    """pid -> why it was killed as hung (in this generation)."""

    def started(self, procs: list[RankProcess]) -> None:
        """A new generation's ranks started: watch them (no hang killed yet)."""
        self.procs = procs
        self.hang_killed.clear()

    def kill_stopped_peers(self) -> bool:
        """Once a rank has exited, SIGKILL the node's stopped (``T``) ranks (elastic is about
        to SIGTERM them and wait); True if one exited."""
        if any(is_gone(p.pid) for p in self.procs):
            self.kill_stopped("while a peer exited")
            return True
        return False

    def kill_stopped(self, why: str) -> None:
        """SIGKILL the node's stopped (``T``) ranks: they cannot act on SIGTERM."""
        for proc in self.procs:
            if proc_state(proc.pid) == "T":
                log.warning(
                    "[%s/%d] pid %d is stopped (SIGSTOP?) %s; SIGKILL",
                    self.node,
                    proc.rank,
                    proc.pid,
                    why,
                )
                kill_rank(proc.pid)

    def check_hangs(self, progress: dict[int, RankProgress], fetched: float) -> None:
        """SIGKILL the ranks that made no progress for too long (once per generation).

        ``progress``: the SMP's view by global rank, fetched at ``fetched`` (``time.time()``).
        """
        if self.hang_killed:
            return
        # A rank that already exited (e.g. finished while its peers still work) is not hung.
        running = [p for p in self.procs if not is_gone(p.pid)]
        hangs = find_hangs(
            running,
            progress,
            fetched,
            self.hang_timeout,
            self.first_progress_timeout,
            self.rejoin_timeout,
        )
        if hangs:
            self._kill_hung(hangs + self._stopped_besides(running, hangs, progress, fetched))

    def _stopped_besides(
        self,
        running: list[RankProcess],
        hangs: list[HangVerdict],
        progress: dict[int, RankProgress],
        fetched: float,
    ) -> list[HangVerdict]:
        """The stopped (``T``/``D``) ranks not yet judged hung, the likely cause of the hang:
        a peer blocked in a collective may cross the timeout before the rank that stopped
        mid-step does."""
        judged = {h.pid for h in hangs}
        extra: list[HangVerdict] = []
        for proc in running:
            if proc.pid in judged or proc_state(proc.pid) not in ("T", "D"):
                continue
            entry = progress.get(proc.rank)
            last = current_progress(proc, entry)
            idle = fetched - (last if last is not None else proc.start_time)
            step = entry.last_progress_step if entry is not None else None
            extra.append(
                HangVerdict(proc.rank, proc.pid, idle, step, f"no progress for {idle:.1f} s")
            )
        return extra

    def _kill_hung(self, hangs: list[HangVerdict]) -> None:
        """SIGKILL the hung ranks (a stopped one ignores the SIGTERM elastic would send).

        A hung rank's peers block in collectives and stop reporting too. If some ranks are
        stopped (``T``) or in uninterruptible sleep (``D``), only those (the likely cause) are
        killed: the others' collectives then fail, and elastic stops them or, under
        ``ftmem.run``, they rejoin in process. Otherwise every idle rank is killed.
        """
        states = {h.pid: proc_state(h.pid) for h in hangs}
        hangs = sorted(hangs, key=lambda h: (states[h.pid] not in ("T", "D"), -h.idle_s))
        if states[hangs[0].pid] in ("T", "D"):
            hangs = [h for h in hangs if states[h.pid] in ("T", "D")]
        verdict = hangs[0]
        for h in hangs:
            self.hang_killed[h.pid] = h
        others = ", ".join(f"rank {h.rank} idle {h.idle_s:.1f} s" for h in hangs[1:])
        state = states[verdict.pid]
        log.error(
            "[%s/%d] HANG: %s (last step %s%s); SIGKILL pid %d%s",
            self.node,
            verdict.rank,
            verdict.reason,
            verdict.last_step,
            f", process state {state}" if state in ("T", "D") else "",
            verdict.pid,
            f" and the other idle ranks ({others})" if others else "",
        )
        for h in hangs:
            kill_rank(h.pid)
        self.events.write(
            "hang",
            rank=verdict.rank,
            pid=verdict.pid,
            idle_s=round(verdict.idle_s, 3),
            last_step=verdict.last_step,
            process_state=state,
            killed=[h.rank for h in hangs],
        )
