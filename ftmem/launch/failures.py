"""What failed on this node, each failure told once.

The agent's monitor asks :class:`NodeFailures`, in this order, whether the SMP died, its
erasure-coding thread stopped, or a rank failed or hung (elastic's verdict); a restart it did
not see coming is another machine's change of the job (:meth:`~NodeFailures.membership_changed`).
Each is reported once through :meth:`RecoveryLifecycle.failed
<ftmem.launch.recovery.RecoveryLifecycle.failed>`, plus the event of its kind; the status
poller then polls fast until the ranks step again. Only elastic's public types are read here.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ftmem.events import EventLog
from ftmem.launch.elastic_compat import live_handlers
from ftmem.launch.monitor import StatusPoller, min_committed
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.recovery import FailureKind, RecoveryLifecycle
from ftmem.launch.report import tail_lines
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.workers import describe_exit
from ftmem.protocol.status import ProtectionState

log = logging.getLogger(__name__)


def a_rank_failed(pcontext: Any) -> bool:
    """A rank of ``pcontext`` exited with an error (elastic will report a failure)."""
    return any(h.proc.poll() not in (None, 0) for h in live_handlers(pcontext).values())


class NodeFailures:
    """Turns what the agent sees into failure reports (see the module docstring).

    ``restarts`` returns elastic's budget now, (left, max); ``stop_restarting`` ends elastic's
    restarts (the no-progress guard's verdict); ``watch`` knows the ranks killed as hung.
    """

    def __init__(
        self,
        *,
        life: RecoveryLifecycle,
        smp: SmpRunner,
        poller: StatusPoller,
        watch: RankWatch,
        events: EventLog,
        restarts: Callable[[], tuple[int, int]],
        stop_restarting: Callable[[], None],
    ) -> None:
        self._life = life
        self._smp = smp
        self._node = smp.node
        self._poller = poller
        self._watch = watch
        self._events = events
        self._restarts = restarts
        self._stop_restarting = stop_restarting

    def committed(self, ranks: list[int]) -> int | None:
        """The newest step every one of ``ranks`` committed (the SMP asked now if it runs)."""
        progress = self._poller.fetch() if self._smp.is_alive() else None
        if progress is None:
            latest = self._poller.latest()
            progress = latest[1] if latest is not None else {}
        return min_committed(ranks, progress)

    def _failed(
        self, kind: FailureKind, what: str, committed: int | None, generation: int, **how: Any
    ) -> None:
        """Report a failure once; stop restarting when the no-progress guard says so."""
        dead = not self._smp.is_alive()
        if self._life.failed(
            kind, what, committed, generation, self._restarts(), smp_died=dead, **how
        ):
            self._stop_restarting()

    def rank_failed(
        self,
        ranks: list[int],
        result: RunResult,
        stderr_paths: dict[int, str],
        generation: int,
        died_at: Mapping[int, float] | None = None,
    ) -> None:
        """A rank failed or was killed as hung (elastic's verdict ``result``; the survivors are
        stopped by now). The failure named is the rank that died first: by ``died_at`` (pid ->
        when the fork server reaped it) when it knows every failed rank, else by elastic's
        whole-second timestamps (a tie goes to the lower local rank)."""
        now = time.time()
        committed = self.committed(ranks)
        failures = list(result.failures.items())
        if died_at and all(f.pid in died_at for _, f in failures):
            failures.sort(key=lambda kv: died_at[kv[1].pid])
        else:
            failures.sort(key=lambda kv: kv[1].timestamp)
        root_rank, root = failures[0] if failures else (None, None)
        cause = next(iter(self._watch.hang_killed.values()), None)
        kind = FailureKind.RANK
        if cause is not None:
            root_rank, kind = cause.rank, FailureKind.HANG
            what = f"HANG ({cause.reason}, last step {cause.last_step}), killed"
        elif root is None:
            what = f"worker group {result.state.name}"
        else:
            what = describe_exit(root.exitcode)
        stopped = [r for r, f in failures[1:] if f.exitcode == -signal.SIGTERM]
        self._failed(
            kind, what, committed, generation, rank=root_rank, stopped_ranks=stopped, stopped=now
        )
        rec = self._life.recovery
        assert rec is not None
        if root is not None:
            tail = tail_lines(stderr_paths.get(root.local_rank))
            self._life.last_failure = (root_rank, what, tail)
        self._events.write(
            "failed",
            rank=root_rank,
            what=what,
            exitcode=None if root is None else root.exitcode,
            generation=generation,
            committed=committed,
            restarts_left=self._restarts()[0],
            detected=round(rec.detected, 4),
            stop_s=round(now - rec.detected, 4),
        )
        self._poller.set_fast(True)

    def smp_died(self, ranks: list[int], exitcode: int, generation: int) -> RunResult:
        """The node's SMP exited with ``exitcode``: elastic's result that restarts the ranks."""
        pid = self._smp.pid or -1
        latest = self._poller.latest()
        committed = min_committed(ranks, latest[1]) if latest is not None else None
        why = describe_exit(exitcode)
        self._events.write(
            "smp_died", pid=pid, exitcode=exitcode, generation=generation, committed=committed
        )
        what = f"SMP pid {pid} died ({why})"
        message = f"the node's SMP died ({why})"
        return self._node_failure(
            FailureKind.SMP, what, message, committed, exitcode, ranks, generation
        )

    def protection_error(self) -> str | None:
        """The error that stopped the SMP's protection thread during this generation, or None
        (only a status fetched after these ranks started counts: the SMP replaces a failed
        exchange at the generation's PEER_BIND)."""
        latest = self._poller.protection() if self._life.watching else None
        if latest is None:
            return None
        fetched, status = latest
        if fetched <= self._life.started_at or status.state is not ProtectionState.FAILED:
            return None
        return status.error or "no error given"

    def protection_failed(self, ranks: list[int], error: str, generation: int) -> RunResult:
        """The protection thread stopped: snapshots are no longer protected. The result
        restarts the ranks (from memory) with a new generation, whose PEER_BIND gives the
        SMP a new exchange."""
        committed = self.committed(ranks)
        what = f"the SMP's erasure-coding thread stopped ({error})"
        log.error(
            "[%s] PROTECTION STOPPED: %s; snapshots of this node are no longer protected: "
            "restarting the ranks from memory with a new peer mesh",
            self._node,
            what,
        )
        self._events.write(
            "protection_failed", error=error, generation=generation, committed=committed
        )
        return self._node_failure(
            FailureKind.PROTECTION, what, what, committed, 1, ranks, generation
        )

    def _node_failure(
        self,
        kind: FailureKind,
        what: str,
        message: str,
        committed: int | None,
        exitcode: int,
        ranks: list[int],
        generation: int,
    ) -> RunResult:
        """A failure of the node's SMP side (not of a rank), reported; the result names the
        SMP as the failed process, with ``exitcode``."""
        pid = self._smp.pid or -1
        failure = ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<N/A>")
        failure.message = f"{message}; see {self._smp.log_path}"
        self._failed(kind, what, committed, generation)
        self._poller.set_fast(True)
        return RunResult(state=WorkerState.FAILED, failures={ranks[0]: failure})

    def membership_changed(self, ranks: list[int], lost: list[str], generation: int) -> None:
        """elastic restarts healthy ranks because another node (re)joined the rendezvous:
        typically that node's ranks failed, or a spare replaces ``lost`` machines. Reported
        (``RESTART``), not charged as a restart."""
        committed = self.committed(ranks)
        what = (
            f"MACHINE LOST ({', '.join(lost)}): a spare or a replacement takes its place, or the job shrinks"
            if lost
            else "a membership change (another node re-joined the rendezvous)"
        )
        log.warning(
            "[%s] RESTART: %s (generation %d); newest committed step on this node: %s",
            self._node,
            what,
            generation,
            committed,
        )
        kind = FailureKind.MACHINE_LOST if lost else FailureKind.MEMBERSHIP
        self._life.detected(kind, what, committed)
        self._poller.set_fast(True)
        self._events.write(
            "restart",
            reason=kind.value,
            lost=lost,
            generation=generation,
            committed=committed,
        )
