"""Hang detection and progress bookkeeping from the SMP's status.

:class:`StatusPoller` (one thread) asks the node's SMP for its status every ``interval``; the
agent's main thread reads the newest answer and asks the pure functions here for verdicts:
:func:`find_hangs`, :func:`all_resumed` and :class:`NoProgressGuard` (a restart loop that
never commits a newer step).

A rank's progress counts only if *this* incarnation of the rank reported it (the SMP's pid
for the rank matches, and the report is newer than the spawn): the previous generation's
times never make a fresh rank look hung, and the hang clock starts at a rank's first save or
heartbeat (``--ftmem-first-progress-timeout`` bounds the time before it).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from ftmem.events import EventLog as EventLog  # re-exported: agent.py, report.py
from ftmem.protocol.status import ProtectionStatus, RankProgress, SmpStatus

log = logging.getLogger(__name__)

_FAST_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class RankProcess:
    """A rank as the agent started it."""

    rank: int
    pid: int
    start_time: float
    """``time.time()`` just before it was spawned (or, if ``kept``, handed its new generation)."""
    kept: bool = False
    """A survivor of the previous generation that rejoins this one in process."""


@dataclass(frozen=True, slots=True)
class HangVerdict:
    """A rank judged hung: who, since when, and why."""

    rank: int
    pid: int
    idle_s: float
    last_step: int | None
    reason: str


def current_progress(proc: RankProcess, progress: RankProgress | None) -> float | None:
    """Return the time of ``proc``'s last progress report, or None if it has reported none.

    A report counts only if it is newer than the spawn and (when the SMP knows the pid)
    came from this very process.
    """
    if progress is None or progress.last_progress_time is None:
        return None
    if progress.pid is not None and progress.pid != proc.pid:
        return None
    if progress.last_progress_time < proc.start_time:
        return None
    return progress.last_progress_time


def find_hangs(
    procs: list[RankProcess],
    progress: dict[int, RankProgress],
    now: float,
    hang_timeout: timedelta,
    first_progress_timeout: timedelta = timedelta(0),
    rejoin_timeout: timedelta = timedelta(0),
) -> list[HangVerdict]:
    """Return the ranks that made no progress for too long, stalest first (pure).

    ``progress`` is the SMP's view by global rank, fetched at ``now``. A rank that reported is
    judged by ``hang_timeout`` (idle since its last report); a kept rank that has not, by
    ``rejoin_timeout`` when set (since its hand-over); any other by ``first_progress_timeout``
    (since its spawn). 0 turns each off.
    """
    hung: list[HangVerdict] = []
    for proc in procs:
        entry = progress.get(proc.rank)
        last = current_progress(proc, entry)
        if last is not None:
            limit, since, why = hang_timeout, last, "no progress for"
        elif proc.kept and rejoin_timeout > timedelta(0):
            limit, since, why = rejoin_timeout, proc.start_time, "did not rejoin in"
        else:
            limit, since, why = first_progress_timeout, proc.start_time, "no first progress in"
        idle = now - since
        if limit > timedelta(0) and idle > limit.total_seconds():
            step = entry.last_progress_step if entry is not None and last is not None else None
            hung.append(HangVerdict(proc.rank, proc.pid, idle, step, f"{why} {idle:.1f} s"))
    hung.sort(key=lambda v: -v.idle_s)
    return hung


def all_resumed(procs: list[RankProcess], progress: dict[int, RankProgress]) -> bool:
    """True once every rank in ``procs`` has reported progress since its start (pure)."""
    return bool(procs) and all(current_progress(p, progress.get(p.rank)) is not None for p in procs)


def min_committed(ranks: list[int], progress: dict[int, RankProgress]) -> int | None:
    """The newest step every one of ``ranks`` has committed (None if any has none)."""
    steps = [progress[r].newest_committed if r in progress else None for r in ranks]
    if not steps or any(s is None for s in steps):
        return None
    return min(s for s in steps if s is not None)


class NoProgressGuard:
    """Counts restarts in a row that did not lead to a newer committed step."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """Stop after this many such restarts (0: never)."""
        self.streak = 0
        self._best: int | None = None
        """The newest committed step at a failure (-1: none), None before the first."""

    def on_failure(self, committed: int | None) -> bool:
        """Record a failure with the newest committed step; True means stop restarting."""
        step = -1 if committed is None else committed
        if self._best is None:
            self._best = step
            return False
        if step > self._best:
            self._best = step
            self.streak = 0
        else:
            self.streak += 1
        return self.limit > 0 and self.streak >= self.limit

    @property
    def best(self) -> int | None:
        """The newest committed step seen at a failure (None: none yet)."""
        return None if self._best is None or self._best < 0 else self._best


class StatusPoller:
    """A thread that fetches the SMP status every ``interval`` and keeps the newest one.

    Resource handling: ``start()`` starts the thread, ``close()`` stops it (sentinel event,
    bounded join) and is idempotent. Each request opens its own ``SmpClient`` in this
    thread, so no socket is shared with the agent's thread. Error handling: a failed
    request is logged (once per outage) and leaves the last good answer in place.
    """

    def __init__(self, run_dir: Path, interval: timedelta, request_timeout: timedelta) -> None:
        self._run_dir = run_dir
        self._interval = interval
        self._timeout = request_timeout
        self._stop = threading.Event()
        self._newest: tuple[float, SmpStatus, dict[int, RankProgress]] | None = None
        """(time fetched, status, its progress by rank) of the newest answer: one tuple,
        replaced whole, so readers on other threads need no lock."""
        self._thread: threading.Thread | None = None
        self._failing = False
        self._fast = threading.Event()

    def start(self) -> None:
        """Start polling (no-op if running)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="ftmem-status-poller", daemon=True)
        self._thread.start()

    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop the thread; wait at most ``timeout``."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout.total_seconds())
        if thread.is_alive():
            log.warning("status poller thread did not stop within %s", timeout)

    def latest(self) -> tuple[float, dict[int, RankProgress]] | None:
        """The newest answer as ``(time fetched, progress by rank)``, or None."""
        newest = self._newest
        return None if newest is None else (newest[0], newest[2])

    def protection(self) -> tuple[float, ProtectionStatus] | None:
        """The newest protection status as ``(time fetched, status)``, or None (not fetched yet,
        or the SMP's document was malformed)."""
        newest = self._newest
        if newest is None or newest[1].protection is None:
            return None
        return newest[0], newest[1].protection

    def status(self) -> tuple[float, SmpStatus] | None:
        """The newest status, whole, with when it was fetched (metrics)."""
        newest = self._newest
        return None if newest is None else (newest[0], newest[1])

    def set_fast(self, fast: bool) -> None:
        """Poll every 0.1 s (while a recovery is timed) instead of every ``interval``."""
        if fast:
            self._fast.set()
        else:
            self._fast.clear()

    def forget(self) -> None:
        """Drop the cached answer (after the SMP was replaced)."""
        self._newest = None

    def fetch(self) -> dict[int, RankProgress] | None:
        """Ask the SMP now (from the calling thread); None if it does not answer."""
        from ftmem.errors import FtmemError
        from ftmem.protocol.smp_client import SmpClient

        try:
            with SmpClient(self._run_dir, timeout=self._timeout) as client:
                status = client.status()
        except (FtmemError, OSError) as exc:
            if not self._failing:
                log.warning("SMP status unavailable: %s", exc)
            self._failing = True
            return None
        if self._failing:
            log.info("SMP status available again")
        self._failing = False
        progress = dict(status.ranks)
        self._newest = (time.time(), status, progress)
        return progress

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fetch()
            except Exception:
                log.exception("status poll failed")
            wait = self._interval.total_seconds()
            self._stop.wait(min(wait, _FAST_POLL_S) if self._fast.is_set() else wait)
