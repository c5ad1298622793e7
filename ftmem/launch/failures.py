"""What the ftmem-launch agent does when something on its node fails.

:class:`FailureAccounting` is a mixin of :class:`~ftmem.launch.agent.FtmemElasticAgent`: for
a failed rank (elastic's verdict), a dead SMP and a stopped exchange thread it finds the
newest committed step, applies the no-progress guard, logs one line, writes the event and
opens the :class:`~ftmem.launch.report.Recovery` that the agent closes when every rank
stepped again. It reads the agent's state (declared below) and elastic's restart count.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ftmem.events import EventLog
from ftmem.exchange.status import ExchangeState
from ftmem.launch.monitor import NoProgressGuard, StatusPoller, min_committed
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.report import Recovery, log_failure, log_last_failure, tail_lines
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.workers import describe_exit

log = logging.getLogger("ftmem.launch.agent")


class FailureAccounting:
    """Failure handling of the agent (see the module docstring); a mixin, no state of its own."""

    # The agent's state this mixin reads and sets (FtmemElasticAgent.__init__ makes it).
    _node: str
    _smp: SmpRunner
    _poller: StatusPoller
    _guard: NoProgressGuard
    _watch: RankWatch
    events: EventLog
    generation: int
    stop_reason: str | None
    _recovery: Recovery | None
    _detected_at: float | None
    _started_at: float
    _smp_failed: bool
    _exchange_failed: bool
    _last_failure: tuple[int | None, str, list[str]] | None
    # elastic's (SimpleElasticAgent / LocalElasticAgent):
    _worker_group: WorkerGroup
    _remaining_restarts: int
    _pcontext: Any

    def _committed_now(self, ranks: list[int]) -> int | None:
        progress = self._poller.fetch() if self._smp.is_alive() else None
        if progress is None:
            latest = self._poller.latest()
            progress = latest[1] if latest is not None else {}
        return min_committed(ranks, progress)

    def _on_failure(self, worker_group: WorkerGroup, result: RunResult) -> None:
        now = time.time()  # elastic has stopped the survivors by now
        detected = self._detected_at if self._detected_at is not None else now
        ranks = [w.global_rank for w in worker_group.workers]
        committed = self._committed_now(ranks)
        failures = sorted(result.failures.items(), key=lambda kv: kv[1].timestamp)
        root_rank, root = failures[0] if failures else (None, None)
        cause = next(iter(self._watch.hang_killed.values()), None)
        if cause is not None:
            root_rank = cause.rank
            what = f"HANG ({cause.reason}, last step {cause.last_step}), killed"
        elif root is None:
            what = f"worker group {result.state.name}"
        else:
            what = describe_exit(root.exitcode)
        self._check_guard(committed)
        self._log_failure(root_rank, what, committed, failures)
        if root is not None:
            self._last_failure = (root_rank, what, self._tail_of(root.local_rank))
        self.events.write(
            "failed",
            rank=root_rank,
            what=what,
            exitcode=None if root is None else root.exitcode,
            generation=self.generation,
            committed=committed,
            restarts_left=self._remaining_restarts,
            detected=round(detected, 4),
            stop_s=round(now - detected, 4),
        )
        self._recovery = Recovery(detected=detected, what=what, committed=committed, stopped=now)
        self._poller.set_fast(True)

    def _log_failure(
        self,
        rank: int | None,
        what: str,
        committed: int | None,
        failures: list[tuple[int, ProcessFailure]],
    ) -> None:
        spec = self._worker_group.spec
        left = self._remaining_restarts
        if left > 0:
            outcome = f"restarting ({spec.max_restarts - left + 1}/{spec.max_restarts})"
        elif self.stop_reason:
            outcome = "not restarting (no-progress guard)"
        else:
            outcome = f"no restarts left (max {spec.max_restarts})"
        stopped = [r for r, f in failures[1:] if f.exitcode == -signal.SIGTERM]
        log_failure(self._node, rank, what, self.generation, committed, outcome, stopped)

    def _check_guard(self, committed: int | None) -> None:
        if self._guard.on_failure(committed) and self._remaining_restarts > 0:
            self.stop_reason = (
                f"{self._guard.streak} restart(s) in a row without a newer committed step "
                f"(newest committed: {self._guard.best}); stopping "
                f"(--ftmem-no-progress-restarts {self._guard.limit})"
            )
            log.error("[%s] NO PROGRESS: %s", self._node, self.stop_reason)
            self.events.write("no_progress_stop", reason=self.stop_reason)
            self._remaining_restarts = 0

    def _on_smp_death(self, worker_group: WorkerGroup, exitcode: int) -> RunResult:
        self._smp_failed = True
        pid = self._smp.pid or -1
        latest = self._poller.latest()
        ranks = [w.global_rank for w in worker_group.workers]
        committed = min_committed(ranks, latest[1]) if latest is not None else None
        why = describe_exit(exitcode)
        self.events.write(
            "smp_died", pid=pid, exitcode=exitcode, generation=self.generation, committed=committed
        )
        return self._node_failure(
            ranks,
            f"SMP pid {pid} died ({why})",
            f"the node's SMP died ({why})",
            committed,
            exitcode,
        )

    def _exchange_failure(self) -> str | None:
        """The error that stopped the SMP's exchange thread during this generation, or None.

        Only a status fetched after these ranks started counts: the SMP replaces a failed
        exchange at the generation's PEER_BIND, so an older answer may predate that.
        """
        latest = None if self._exchange_failed else self._poller.exchange()
        if latest is None:
            return None
        fetched, status = latest
        if fetched <= self._started_at or status.state is not ExchangeState.FAILED:
            return None
        return status.error or "no error given"

    def _on_exchange_failure(self, worker_group: WorkerGroup, error: str) -> RunResult:
        """The exchange thread stopped: snapshots are no longer protected. Restart the ranks
        (from memory) with a new generation, whose PEER_BIND gives the SMP a new exchange."""
        self._exchange_failed = True
        ranks = [w.global_rank for w in worker_group.workers]
        committed = self._committed_now(ranks)
        what = f"the SMP's erasure-coding thread stopped ({error})"
        log.error(
            "[%s] PROTECTION STOPPED: %s; snapshots of this node are no longer protected: "
            "restarting the ranks from memory with a new peer mesh",
            self._node,
            what,
        )
        self.events.write(
            "exchange_failed", error=error, generation=self.generation, committed=committed
        )
        return self._node_failure(ranks, what, what, committed, 1)

    def _node_failure(
        self, ranks: list[int], what: str, message: str, committed: int | None, exitcode: int
    ) -> RunResult:
        """A failure of the node's SMP side (not of a rank): account for it and have elastic
        restart the ranks (the result names the SMP as the failed process)."""
        pid = self._smp.pid or -1
        failure = ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<N/A>")
        failure.message = f"{message}; see {self._smp.log_path}"
        self._check_guard(committed)
        self._log_failure(None, what, committed, [])
        self._recovery = Recovery(detected=time.time(), what=what, committed=committed)
        self._poller.set_fast(True)
        return RunResult(state=WorkerState.FAILED, failures={ranks[0]: failure})

    def _tail_of(self, local_rank: int) -> list[str]:
        """The last lines of a rank's stderr file (empty if its output is not in a file)."""
        paths = getattr(self._pcontext, "stderrs", None) or {}
        return tail_lines(paths.get(local_rank))

    def report_last_failure(self) -> None:
        """Log why the agent gave up: the guard's reason and the failing rank's last lines."""
        log_last_failure(self._node, self.stop_reason, self._last_failure)
