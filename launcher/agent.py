"""The ftmem-launch agent: torch.distributed.elastic's LocalElasticAgent plus the node's SMP.

:class:`FtmemElasticAgent` keeps elastic's restart loop (rendezvous, worker groups, restart
accounting, node-loss detection through the rendezvous keep-alive) and adds:

- the SMP's lifecycle: started before the first ranks, kept across rank restarts, restarted
  (with the ranks) when it dies, stopped when the agent shuts down;
- a generation id common to all nodes (the rendezvous round), passed to the ranks;
- hang detection from the SMP's per-rank progress (SIGKILL, then elastic's restart);
- the no-progress guard, and one log line per failure and per recovery.

The private hooks it overrides (``_rendezvous``, ``_start_workers``, ``_stop_workers``,
``_monitor_workers``, ``_shutdown``) are those of torch 2.6-2.14; see docs/launcher.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import (
    LaunchConfig,
    _get_addr_and_port,
    _get_entrypoint_name,
)

from launcher.config import (
    FtmemLaunchConfig,
    apply_safe_env_defaults,
    apply_safe_rdzv_defaults,
    default_node_name,
    default_run_dir,
    safe_name,
)
from launcher.monitor import (
    HangVerdict,
    NoProgressGuard,
    RankProcess,
    StatusPoller,
    all_resumed,
    find_hangs,
    min_committed,
)
from launcher.smp_runner import SmpRunner
from launcher.workers import describe_exit, kill_rank, rank_env, wrap_entrypoint

log = logging.getLogger(__name__)

_GENERATION_KEY = "ftmem/generation"


@dataclass(slots=True)
class _Recovery:
    """A failure being recovered from: when it was detected and what it was."""

    detected: float
    what: str
    committed: int | None


class FtmemElasticAgent(LocalElasticAgent):
    """LocalElasticAgent that also runs the node's SMP and detects hung ranks.

    Resource handling: the SMP and the status poller are stopped in :meth:`_shutdown`,
    which elastic calls on every exit path of ``run()`` (success, failure, signal).
    """

    def __init__(
        self,
        *args: Any,
        ftmem: FtmemLaunchConfig,
        smp: SmpRunner,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._ft = ftmem
        self._smp = smp
        self._node = smp.node
        self._poller = StatusPoller(
            smp.run_dir, ftmem.status_interval, request_timeout=timedelta(seconds=5)
        )
        self._guard = NoProgressGuard(ftmem.no_progress_restarts)
        self.generation = -1
        """The rendezvous round the current ranks belong to (same on every node)."""
        self._procs: list[RankProcess] = []
        self._hang_killed: dict[int, HangVerdict] = {}
        self._recovery: _Recovery | None = None
        self._prev_group_rank: int | None = None
        self._smp_failed = False
        self.stop_reason: str | None = None
        """Why the agent gave up early (the no-progress guard), for the final report."""

    # -- rendezvous -------------------------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self.generation = self._exchange_generation(worker_group)
        rank = worker_group.group_rank
        if self._prev_group_rank is not None and rank != self._prev_group_rank:
            log.warning(
                "[%s] group rank changed %s -> %s after a membership change: ranks of this "
                "node now restore other ranks' snapshots",
                self._node,
                self._prev_group_rank,
                rank,
            )
        self._prev_group_rank = rank

    def _exchange_generation(self, worker_group: WorkerGroup) -> int:
        """Agree on the generation: group rank 0 publishes the rendezvous round."""
        store = worker_group.store
        if store is None:
            return self.generation + 1
        if worker_group.group_rank == 0:
            state = getattr(getattr(self._rdzv_handler, "_state_holder", None), "state", None)
            round_ = getattr(state, "round", None)
            gen = int(round_) if isinstance(round_, int) else self.generation + 1
            store.set(_GENERATION_KEY, str(gen))
            return gen
        return int(store.get(_GENERATION_KEY).decode())

    # -- start / stop ranks -----------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._smp.ensure_running():
            self._poller.forget()
        self._smp_failed = False
        os.environ.update(
            rank_env(
                run_dir=self._smp.run_dir,
                run_id=self._smp.run_id,
                node=self._node,
                generation=self.generation,
            )
        )
        start = time.time()
        pids = super()._start_workers(worker_group)
        self._procs = [
            RankProcess(rank=w.global_rank, pid=pids[w.local_rank], start_time=start)
            for w in worker_group.workers
        ]
        self._hang_killed.clear()
        self._poller.start()
        log.info(
            "[%s] generation %d: started ranks %s (pids %s)",
            self._node,
            self.generation,
            [p.rank for p in self._procs],
            [p.pid for p in self._procs],
        )
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # LocalElasticAgent's version calls self._shutdown(), which here also stops the SMP.
        LocalElasticAgent._shutdown(self, signal.SIGTERM, self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        try:
            super()._shutdown(death_sig, timeout)
        finally:
            self._poller.close()
            self._smp.stop()

    # -- monitoring -------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        smp_exit = None if self._smp_failed else self._smp.poll()
        if smp_exit is not None:
            return self._on_smp_death(worker_group, smp_exit)
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._on_failure(worker_group, result)
        elif result.state == WorkerState.HEALTHY:
            self._check_progress()
        return result

    def _check_progress(self) -> None:
        latest = self._poller.latest()
        if latest is None:
            return
        fetched, progress = latest
        if self._recovery is not None and all_resumed(self._procs, progress):
            self._report_resumed(progress)
        if self._hang_killed:
            return
        hangs = find_hangs(
            self._procs,
            progress,
            fetched,
            self._ft.hang_timeout,
            self._ft.first_progress_timeout,
        )
        if hangs:
            verdict = hangs[0]
            self._hang_killed[verdict.pid] = verdict
            others = ", ".join(f"rank {h.rank} idle {h.idle_s:.1f} s" for h in hangs[1:])
            log.error(
                "[%s/%d] HANG: %s (last step %s); SIGKILL pid %d%s",
                self._node,
                verdict.rank,
                verdict.reason,
                verdict.last_step,
                verdict.pid,
                f" (also idle: {others})" if others else "",
            )
            kill_rank(verdict.pid)

    def _committed_now(self, ranks: list[int]) -> int | None:
        progress = self._poller.fetch() if self._smp.is_alive() else None
        if progress is None:
            latest = self._poller.latest()
            progress = latest[1] if latest is not None else {}
        return min_committed(ranks, progress)

    def _on_failure(self, worker_group: WorkerGroup, result: RunResult) -> None:
        now = time.time()
        ranks = [w.global_rank for w in worker_group.workers]
        committed = self._committed_now(ranks)
        failures = sorted(result.failures.items(), key=lambda kv: kv[1].timestamp)
        root_rank, root = failures[0] if failures else (None, None)
        if root is None:
            what = f"worker group {result.state.name}"
        elif root.pid in self._hang_killed:
            what = f"HANG ({self._hang_killed[root.pid].reason}), killed"
        else:
            what = describe_exit(root.exitcode)
        self._check_guard(committed)
        self._log_failure(root_rank, what, committed, failures)
        self._recovery = _Recovery(detected=now, what=what, committed=committed)

    def _log_failure(
        self,
        rank: int | None,
        what: str,
        committed: int | None,
        failures: list[tuple[int, ProcessFailure]],
    ) -> None:
        spec = self._worker_group.spec
        left = self._remaining_restarts
        stopped = [r for r, f in failures[1:] if f.exitcode == -signal.SIGTERM]
        log.error(
            "[%s/%s] FAILED: %s (generation %d); newest committed step on this node: %s; "
            "%s%s",
            self._node,
            "-" if rank is None else rank,
            what,
            self.generation,
            committed,
            f"restarting ({spec.max_restarts - left + 1}/{spec.max_restarts})"
            if left > 0
            else f"no restarts left (max {spec.max_restarts})",
            f"; ranks {stopped} stopped by the agent" if stopped else "",
        )

    def _check_guard(self, committed: int | None) -> None:
        if self._guard.on_failure(committed) and self._remaining_restarts > 0:
            self.stop_reason = (
                f"{self._guard.streak} restarts in a row without a newer committed step "
                f"(newest committed: {self._guard.best}); stopping "
                f"(--ftmem-no-progress-restarts {self._guard.limit})"
            )
            log.error("[%s] NO PROGRESS: %s", self._node, self.stop_reason)
            self._remaining_restarts = 0

    def _on_smp_death(self, worker_group: WorkerGroup, exitcode: int) -> RunResult:
        self._smp_failed = True
        pid = self._smp.pid or -1
        ranks = [w.global_rank for w in worker_group.workers]
        latest = self._poller.latest()
        committed = min_committed(ranks, latest[1]) if latest is not None else None
        what = f"SMP pid {pid} died ({describe_exit(exitcode)})"
        failure = ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<N/A>")
        failure.message = f"the node's SMP died ({describe_exit(exitcode)}); see {self._smp.log_path}"
        self._check_guard(committed)
        self._log_failure(None, what, committed, [])
        self._recovery = _Recovery(detected=time.time(), what=what, committed=committed)
        return RunResult(state=WorkerState.FAILED, failures={ranks[0]: failure})

    def _report_resumed(self, progress: dict[int, Any]) -> None:
        rec, self._recovery = self._recovery, None
        assert rec is not None
        steps = [progress[p.rank].last_progress_step for p in self._procs]
        known = [s for s in steps if s is not None]
        log.warning(
            "[%s] RESUMED after %s: generation %d, %d local ranks stepping again "
            "(first step %s, newest committed before the failure %s); detect->resumed %.2f s",
            self._node,
            rec.what,
            self.generation,
            len(self._procs),
            min(known) if known else "?",
            rec.committed,
            time.time() - rec.detected,
        )


def launch_agent(
    config: LaunchConfig,
    ftmem: FtmemLaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
) -> dict[int, Any]:
    """Run one node's ftmem-launch agent to completion (torch's ``launch_agent`` + the SMP).

    Returns each local rank's return value by global rank. Raises ``ChildFailedError``
    when the ranks failed beyond ``max_restarts`` or the no-progress guard stopped them,
    and ``SignalException`` when the agent was told to stop.

    Resource handling: the SMP is started before the first rendezvous (so its start-up
    overlaps the wait for other nodes) and is stopped on every exit path; ranks are spawned
    through the exec shim, so they die with the agent even if it is SIGKILLed.
    """
    if not config.run_id or config.run_id == "none":
        config.run_id = uuid.uuid4().hex
        log.warning("no --rdzv-id given; generated run id %s", config.run_id)
    entrypoint_name = _get_entrypoint_name(entrypoint, args)
    run_id = safe_name(config.run_id)
    node = ftmem.node or default_node_name()
    run_dir = ftmem.run_dir or default_run_dir(run_id, node)
    env_set = apply_safe_env_defaults()
    rdzv_set = apply_safe_rdzv_defaults(config.rdzv_configs)
    log.info(
        "[%s] ftmem-launch: run id %s, run dir %s, nodes %s:%s x %d ranks, max restarts %d, "
        "hang timeout %s s, safe defaults applied: %s",
        node,
        run_id,
        run_dir,
        config.min_nodes,
        config.max_nodes,
        config.nproc_per_node,
        config.max_restarts,
        ftmem.hang_timeout.total_seconds() or "off",
        {**env_set, **rdzv_set} or "none (all set by the user)",
    )
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    wrapped, wrapped_args = wrap_entrypoint(entrypoint, args)
    # Options newer torch versions added to WorkerSpec are passed only where they exist.
    optional = {
        name: getattr(config, name, None)
        for name in (
            "numa_options",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
            "virtual_local_rank",
        )
    }
    spec_fields = {f.name for f in dataclasses.fields(WorkerSpec)}
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=wrapped,
        args=tuple(wrapped_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        **{k: v for k, v in optional.items() if k in spec_fields and v is not None},
    )
    smp = SmpRunner(
        run_dir=run_dir,
        run_id=run_id,
        node=node,
        slots=ftmem.slots,
        start_timeout=ftmem.smp_start_timeout,
        stop_timeout=ftmem.smp_stop_timeout,
        log_level=ftmem.smp_log_level,
        extra_env=ftmem.extra_env,
    )
    agent = FtmemElasticAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,
        ftmem=ftmem,
        smp=smp,
    )
    shutdown_rdzv = True
    succeeded = False
    try:
        smp.start()
        result = agent.run()
        if result is None:  # the rendezvous was closed gracefully
            succeeded = True
            return {}
        if result.is_failed():
            if agent.stop_reason:
                log.error("[%s] stopped: %s", node, agent.stop_reason)
            raise ChildFailedError(name=entrypoint_name, failures=result.failures)
        succeeded = True
        return result.return_values
    except SignalException:
        # Like torch: a signalled agent must not close the rendezvous for the other nodes.
        shutdown_rdzv = False
        raise
    finally:
        smp.stop()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        _cleanup_run_dir(run_dir, auto=ftmem.run_dir is None, keep=not succeeded)


def _cleanup_run_dir(run_dir: Path, *, auto: bool, keep: bool) -> None:
    """Remove an auto-created run dir after success; say where it is otherwise."""
    if not auto:
        return
    if keep:
        log.info("run dir kept for inspection: %s", run_dir)
        return
    shutil.rmtree(run_dir, ignore_errors=True)
