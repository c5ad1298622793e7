"""Hang detection and progress bookkeeping from the SMP's status.

:class:`StatusPoller` (one named thread) asks the node's SMP for its status every
``interval``; the agent's main thread reads the newest answer and asks the pure functions
here for verdicts: :func:`find_hangs` (which rank stopped making progress),
:func:`all_resumed` (have the restarted ranks stepped again) and :class:`NoProgressGuard`
(a restart loop that never commits a newer step).

A rank's progress counts only if it was reported by *this* incarnation of the rank (the
SMP's pid for the rank matches, and the report is newer than the spawn), so the previous
generation's timestamps never make a freshly started rank look hung, and start-up and
``ftmem.load`` never count as a hang: the hang clock starts at a rank's first save or
heartbeat (``--ftmem-first-progress-timeout`` optionally bounds the time before it).
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

    Args:
        procs: the node's running ranks.
        progress: the SMP's view, by global rank.
        now: ``time.time()`` when ``progress`` was fetched.
        hang_timeout: idle time after the first report that counts as a hang (0: off).
        first_progress_timeout: time from spawn to the first report (0: off).
        rejoin_timeout: time from the hand-over of a new generation to a kept rank's first
            report in it (0: off; else it overrides ``first_progress_timeout`` for them).
    """
    hung: list[HangVerdict] = []
    for proc in procs:
        entry = progress.get(proc.rank)
        last = current_progress(proc, entry)
        step = entry.last_progress_step if entry is not None else None
        if last is not None:
            idle = now - last
            if hang_timeout > timedelta(0) and idle > hang_timeout.total_seconds():
                hung.append(
                    HangVerdict(proc.rank, proc.pid, idle, step, f"no progress for {idle:.1f} s")
                )
        elif proc.kept and rejoin_timeout > timedelta(0):
            idle = now - proc.start_time
            if idle > rejoin_timeout.total_seconds():
                hung.append(
                    HangVerdict(proc.rank, proc.pid, idle, None, f"did not rejoin in {idle:.1f} s")
                )
        elif first_progress_timeout > timedelta(0):
            idle = now - proc.start_time
            if idle > first_progress_timeout.total_seconds():
                hung.append(
                    HangVerdict(
                        proc.rank, proc.pid, idle, None, f"no first progress in {idle:.1f} s"
                    )
                )
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
        self._seen = False

    def on_failure(self, committed: int | None) -> bool:
        """Record a failure with the newest committed step; True means stop restarting."""
        step = -1 if committed is None else committed
        if not self._seen:
            self._seen = True
            self._best = step
            return False
        assert self._best is not None
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
        self._lock = threading.Lock()
        self._latest: tuple[float, dict[int, RankProgress]] | None = None
        self._protection: tuple[float, ProtectionStatus] | None = None
        self._status: tuple[float, SmpStatus] | None = None
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
        with self._lock:
            return self._latest

    def protection(self) -> tuple[float, ProtectionStatus] | None:
        """The newest protection status as ``(time fetched, status)``, or None (not fetched yet,
        or the SMP's document was malformed)."""
        with self._lock:
            return self._protection

    def status(self) -> tuple[float, SmpStatus] | None:
        """The newest status, whole, with when it was fetched (metrics)."""
        with self._lock:
            return self._status

    def set_fast(self, fast: bool) -> None:
        """Poll every 0.1 s (while a recovery is timed) instead of every ``interval``."""
        if fast:
            self._fast.set()
        else:
            self._fast.clear()

    def forget(self) -> None:
        """Drop the cached answer (after the SMP was replaced)."""
        with self._lock:
            self._latest = None
            self._protection = None
            self._status = None

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
        exchange = status.protection
        now = time.time()
        with self._lock:
            self._latest = (now, progress)
            self._protection = None if exchange is None else (now, exchange)
            self._status = (now, status)
        return progress

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fetch()
            except Exception:
                log.exception("status poll failed")
            wait = self._interval.total_seconds()
            self._stop.wait(min(wait, _FAST_POLL_S) if self._fast.is_set() else wait)
