"""The ftmem-launch agent: torch.distributed.elastic's LocalElasticAgent plus the node's SMP.

:class:`FtmemElasticAgent` keeps elastic's restart loop (rendezvous, worker groups, restart
accounting, node-loss detection through the rendezvous keep-alive) and adds:

- the SMP's lifecycle: started before the first ranks, kept across rank restarts, restarted
  (with the ranks) when it dies, stopped when the agent shuts down;
- a generation id common to all nodes (the rendezvous round), passed to the ranks;
- stable global ranks: a node keeps its ranks across rounds, a replacement takes the lost
  node's, and MASTER_ADDR/PORT follow global rank 0;
- hang detection from the SMP's per-rank progress (SIGKILL, then elastic's restart);
- the no-progress guard, and one log line per failure and per recovery.

Standby ranks (:mod:`ftmem.launch.standby`) take over restarted ranks through elastic's own
process start; ranks under ``ftmem.run`` that survive a failure are kept alive and rejoin
the next generation in process (:mod:`ftmem.launch.in_process`); at a restart the c10d
handler's start jitter is skipped.

It overrides elastic's four abstract hooks (``_start_workers``, ``_stop_workers``,
``_monitor_workers``, ``_shutdown``); everything else it needs from elastic's private API
(three private methods, the rendezvous round, two swapped module functions, and what differs
between the supported torch versions) is in :mod:`ftmem.launch.elastic_compat`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

from ftmem.errors import FtmemError, UnrecoverableError
from ftmem.exchange.keys import KeyFileError
from ftmem.launch.config import (
    FtmemLaunchConfig,
)
from ftmem.launch.elastic_compat import (
    ELASTIC_POLL_S,
    ElasticAgentBase,
    failed_after_detach,
    live_handlers,
    log_tails_stop_at_once,
    rendezvous_members,
    rendezvous_poll_s,
    restart_rendezvous_quickly,
    trust_rendezvous_state_for,
)
from ftmem.launch.failures import FailureAccounting
from ftmem.launch.in_process import InProcessRestarts
from ftmem.launch.membership import MembershipWatch
from ftmem.launch.metrics import AgentMetrics, MetricsServer
from ftmem.launch.monitor import (
    EventLog,
    NoProgressGuard,
    RankProcess,
    RankProgress,
    StatusPoller,
    all_resumed,
)
from ftmem.launch.peers import PeerSettings, join_generation
from ftmem.launch.rank_store import RankStore
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.rendezvous import (
    agree_slot,
    exchange_generation,
    share_master,
    slot_workers,
    stable_ranks_apply,
)
from ftmem.launch.report import (
    Recovery,
    report_resumed,
)
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.standby import StandbyPool, spawning_from
from ftmem.launch.workers import rank_env

log = logging.getLogger(__name__)

STANDBY_FALLBACK_S = 30.0
"""Standbys start this long after the ranks even if the ranks never report progress."""


class FtmemElasticAgent(FailureAccounting, ElasticAgentBase):
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
        self.events = EventLog(smp.run_dir / "events.jsonl", smp.node)
        """The machine-readable event log (JSON lines) in the run directory."""
        self.generation = -1
        """The rendezvous round the current ranks belong to (same on every node)."""
        self._watch = RankWatch(
            smp.node,
            self.events,
            ftmem.hang_timeout,
            ftmem.first_progress_timeout,
            ftmem.rejoin_timeout,
        )
        """The node's ranks: stopped and hung ones get SIGKILL."""
        self._in_process = InProcessRestarts(smp.node, smp.run_dir)
        """Ranks kept alive across the restart in progress (``ftmem.run``)."""
        self._rank_store = RankStore(smp.node)
        """The ranks' TCPStore, served here when this node runs global rank 0."""
        self._restarting = False
        """elastic is restarting the ranks (set in before_restart, read in _stop_workers)."""
        self._recovery: Recovery | None = None
        self._slot: int | None = None
        """This node's block of global ranks (stable across rounds), None: elastic's."""
        self._prev_ranks: list[int] | None = None
        self._smp_failed = False
        self._exchange_failed = False
        self._last_failure: tuple[int | None, str, list[str]] | None = None
        self._peer_settings = _peer_settings(ftmem)
        self._key_warned = [False]
        self._standbys = StandbyPool(
            count=ftmem.standby,
            imports=ftmem.standby_imports,
            cuda=ftmem.standby_cuda,
            run_dir=smp.run_dir,
            node=smp.node,
        )
        spec = self._worker_group.spec
        self._standbys.configure(spec.entrypoint, spec.args, spec.local_world_size)
        self._started_at = 0.0
        self._detected_at: float | None = None
        """When the monitor first saw a rank dead (before elastic stopped the survivors)."""
        self._rendezvous_at: float | None = None
        self.stop_reason: str | None = None
        """Why the agent gave up early (the no-progress guard), for the final report."""
        self._spare = False
        """This agent waits in the rendezvous as a hot spare (the job has all its nodes)."""
        handler = self._worker_group.spec.rdzv_handler
        if isinstance(handler, MembershipWatch):
            handler.on_event = self.events.write
        self.metrics: MetricsServer | None = None
        """The Prometheus metrics server (``--ftmem-metrics-port``), started by the launcher."""
        if ftmem.metrics_port:
            counted = AgentMetrics(smp.node, self._poller.raw)
            self.events.listeners.append(counted.observe)
            self.metrics = MetricsServer(counted, ftmem.metrics_port, ftmem.metrics_addr)

    # -- rendezvous -------------------------------------------------------------------------

    def join_rendezvous(self, worker_group: WorkerGroup, join: Callable[[], None]) -> None:
        settings = getattr(self._rdzv_handler, "settings", None)  # the c10d/etcd-v2 handler
        if settings is not None:
            log.info(
                "[%s] joining the rendezvous: %d-%d nodes, join timeout %.0f s",
                self._node,
                settings.min_nodes,
                settings.max_nodes,
                settings.timeout.join.total_seconds(),
            )
        else:
            log.info("[%s] joining the rendezvous", self._node)
        poll_s = rendezvous_poll_s(settings.max_nodes if settings is not None else 1)
        trust_rendezvous_state_for(self._rdzv_handler, poll_s)
        with restart_rendezvous_quickly(
            restart=self.generation >= 0, poll_s=poll_s, between_polls=self._while_joining
        ):
            join()
        # Outside restarts elastic's own pace: a state read is trusted for 1 s again, so the
        # healthy loop reads the store about once a second (not every monitor interval).
        trust_rendezvous_state_for(self._rdzv_handler, ELASTIC_POLL_S)
        if self._spare:
            self._spare = False
            log.warning("[%s] SPARE TAKES OVER: a node left the job; joining it", self._node)
            self.events.write("spare_joins")
        self._rendezvous_at = time.time()
        share_master(worker_group, self._slot)
        self.generation = exchange_generation(worker_group, self.rendezvous_round, self.generation)
        self._serve_rank_store(worker_group)
        ranks = [w.global_rank for w in worker_group.workers]
        if self._prev_ranks is not None and ranks != self._prev_ranks:
            log.warning(
                "[%s] global ranks changed %s -> %s (elastic's numbering): this node's "
                "ranks now find other ranks' snapshots in its SMP",
                self._node,
                self._prev_ranks,
                ranks,
            )
        self._prev_ranks = ranks

    def _while_joining(self) -> None:
        """Between two reads of the rendezvous state while joining: notice that this node
        waits as a hot spare (elastic's redundancy list: the round has all its nodes), then
        keep standby ranks warm for the moment it takes a lost node's place."""
        if not self._spare:
            members = rendezvous_members(self._rdzv_handler)
            if members is None or not members.spare:
                return
            self._spare = True
            log.warning(
                "[%s] SPARE: the job has all its nodes; waiting as a hot spare (an SMP and "
                "warm standby ranks) to take the place of a lost node",
                self._node,
            )
            self.events.write("spare", generation=self.generation)
            if self._slot is not None:
                self._fence(f"slot {self._slot} went on without this node")
                self._slot = None
            self._standbys.spawn_missing()
        self._standbys.poll()

    def _fence(self, why: str) -> None:
        """This node was dropped from the job and its place taken (it was cut off or stalled
        past the keep-alive bound): its snapshots are of an identity it no longer has. It
        drops them (a fresh SMP) and its ranks' history; the caller gives it a new slot (or
        none: a spare), so it can only come back as a new node."""
        log.warning(
            "[%s] FENCED: %s (this node was dropped from the job); dropping this node's "
            "snapshots and its slot",
            self._node,
            why,
        )
        self.events.write("fenced", slot=self._slot, why=why)
        self._prev_ranks = None
        self._smp.stop()
        self._smp.ensure_running()
        self._poller.forget()

    def _serve_rank_store(self, worker_group: WorkerGroup) -> None:
        """Serve this generation's rank store here if this node runs global rank 0
        (:mod:`ftmem.launch.rank_store`): the node of slot 0, else elastic's group rank 0."""
        hosts = self._slot == 0 if self._slot is not None else worker_group.group_rank == 0
        addr, port = worker_group.master_addr, worker_group.master_port
        if hosts and addr is not None and port is not None:
            self._rank_store.serve(addr, port, self.generation)
        else:
            self._rank_store.close()

    def assign_worker_ranks(
        self,
        store: Any,
        group_rank: int,
        group_world_size: int,
        spec: WorkerSpec,
        elastic_default: Callable[[], list[Worker]],
    ) -> list[Worker]:
        """Keep every node's global ranks across rounds (elastic renumbers by node order).

        Each agent publishes the slot (block of ``local_world_size`` global ranks) it held
        in the previous round; group rank 0 assigns slots
        (:func:`~ftmem.launch.rendezvous.agree_slot`) and publishes them. Nodes of
        different sizes fall back to elastic's assignment.
        """
        if not stable_ranks_apply(self._ft.rank_assignment, spec):
            self._slot = None
            return elastic_default()
        claimed = self._slot
        self._slot = agree_slot(
            store, group_rank, group_world_size, claimed, spec.local_world_size, self.generation
        )
        if claimed is not None and claimed < group_world_size and self._slot not in (None, claimed):
            self._fence(f"slot {claimed} is held by a node that took it over more recently")
        if self._slot is None:
            log.warning("[%s] nodes differ in size: elastic assigns the ranks", self._node)
            return elastic_default()
        return slot_workers(self._slot, spec.local_world_size, group_world_size)

    # -- start / stop ranks -----------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # The ranks (and an SMP started now) inherit the agent's environment.
        expected = self._recovery.committed if self._recovery is not None else None
        ftmem_env = rank_env(
            run_dir=self._smp.run_dir,
            run_id=self._smp.run_id,
            node=self._node,
            generation=self.generation,
            expected_step=expected,
            rejoin_timeout_s=self._rank_rejoin_wait(),
            checkfree=self._ft.checkfree,
        )
        os.environ.update(ftmem_env)
        if self._smp.ensure_running():
            self._poller.forget()
        self._smp_failed = False
        self._exchange_failed = False
        self._join_peers(worker_group)
        start = time.time()
        self._in_process.begin_generation(self.generation, ftmem_env)
        with (
            log_tails_stop_at_once(),
            spawning_from(self._standbys, self._in_process.adopt, self._rank_store.rank_env()),
        ):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        self._in_process.discard("its local rank is not in the new generation")
        kept = self._in_process.adopted
        started = time.time()
        self._started_at = started
        procs = [
            RankProcess(
                rank=w.global_rank,
                pid=pids[w.local_rank],
                start_time=start,
                kept=w.global_rank in kept,
            )
            for w in worker_group.workers
        ]
        self._watch.started(procs)
        handed = self._standbys.handed
        from_standby = [w.global_rank for w in worker_group.workers if w.local_rank in handed]
        self._poller.start()
        self.events.write(
            "ranks_started",
            generation=self.generation,
            ranks=[p.rank for p in procs],
            pids=[p.pid for p in procs],
            from_standby=from_standby,
            in_process=sorted(kept),
            start_s=round(started - start, 4),
            smp_pid=self._smp.pid,
            smp_starts=self._smp.starts,
        )
        log.info(
            "[%s] generation %d: started ranks %s (pids %s%s%s)",
            self._node,
            self.generation,
            [p.rank for p in procs],
            [p.pid for p in procs],
            f"; from standbys: ranks {from_standby}" if from_standby else "",
            f"; rejoined in process: ranks {sorted(kept)}" if kept else "",
        )
        return pids

    def _rank_rejoin_wait(self) -> float:
        """How long a rank under ``ftmem.run`` waits for its next generation after a peer
        failure: the rendezvous may wait for a replacement node up to its join timeout
        before the order is written, and the order comes with ``--ftmem-rejoin-timeout``."""
        settings = getattr(self._rdzv_handler, "settings", None)
        join = getattr(getattr(settings, "timeout", None), "join", None)
        extra = join.total_seconds() if isinstance(join, timedelta) else 0.0
        return self._ft.rejoin_timeout.total_seconds() + extra

    def _join_peers(self, worker_group: WorkerGroup) -> None:
        """Sync this generation's peer mesh; a node that lost its memory rebuilds it first."""
        store = worker_group.store
        if store is None:
            return
        me = self._slot if self._slot is not None else worker_group.group_rank
        ranks = [w.global_rank for w in worker_group.workers]
        try:
            result = join_generation(
                settings=self._peer_settings,
                store=store,
                group_rank=worker_group.group_rank,
                nodes=worker_group.group_world_size,
                me=me,
                generation=self.generation,
                run_dir=self._smp.run_dir,
                ranks=ranks,
                node_name=self._node,
                warned=self._key_warned,
            )
        except UnrecoverableError as exc:
            if self._ft.checkfree:  # the ranks rebuild lost pipeline stages from neighbours
                log.error("[%s] %s; --ftmem-checkfree: going on without it", self._node, exc)
                self.events.write("checkfree", generation=self.generation, reason=str(exc))
                return
            self.stop_reason = str(exc)
            log.error("[%s] UNRECOVERABLE: %s", self._node, exc)
            self.events.write("unrecoverable", generation=self.generation, reason=str(exc))
            raise
        except (FtmemError, KeyFileError) as exc:
            log.error("[%s] the peer mesh is not protecting this generation: %s", self._node, exc)
            self.events.write("peers_failed", generation=self.generation, reason=str(exc))
            return
        if result is not None:
            self.events.write("peers_synced", generation=self.generation, **result)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # LocalElasticAgent's version calls self._shutdown(), which here also stops the SMP.
        self._watch.kill_stopped("while the ranks are stopped")
        if not self._restarting:
            self._in_process.discard("no restart follows")
        elif self._smp_failed or self._exchange_failed:
            self._in_process.discard("the node's SMP side failed: every rank restarts cold")
        else:
            self._keep_survivors(worker_group)
        self._restarting = False
        self.stop_ranks(signal.SIGTERM)

    def _keep_survivors(self, worker_group: WorkerGroup) -> list[int]:
        """Take the ranks that can rejoin in process out of elastic's hands before it stops
        the others (see :mod:`ftmem.launch.in_process`); return their local ranks."""
        # The poller's newest answer (at most --ftmem-status-interval old, 0.1 s during a
        # recovery): progress only grows, so an older answer can only make a rank look as if
        # it had not stepped yet in this generation, and it is then restarted cold.
        latest = self._poller.latest()
        progress = latest[1] if latest is not None else None
        if progress is None and self._smp.is_alive():
            progress = self._poller.fetch()
        global_ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        keep = self._in_process.keepable(
            self._pcontext,
            global_ranks,
            self._watch.procs,
            progress or {},
            set(self._watch.hang_killed),
        )
        self._in_process.detach(self._pcontext, keep, global_ranks)
        return keep

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        try:
            self._in_process.discard("the agent is shutting down")
            self._watch.kill_stopped("at shutdown")
            self.stop_ranks(death_sig, timeout)
        finally:
            self._standbys.stop()
            self._poller.close()
            self._smp.stop()
            self._rank_store.close()

    def before_restart(self, worker_group: WorkerGroup) -> None:
        self._restarting = True
        if self._recovery is None:
            # elastic restarts healthy ranks when another node (re)joins the rendezvous,
            # typically because that node's ranks failed; it is not charged as a restart.
            ranks = [w.global_rank for w in worker_group.workers]
            committed = self._committed_now(ranks)
            handler = worker_group.spec.rdzv_handler
            lost = handler.lost if isinstance(handler, MembershipWatch) else []
            what = (
                f"MACHINE LOST ({', '.join(lost)}): a spare or a replacement takes its place"
                if lost
                else "a membership change (another node re-joined the rendezvous)"
            )
            log.warning(
                "[%s] RESTART: %s (generation %d); newest committed step on this node: %s",
                self._node,
                what,
                self.generation,
                committed,
            )
            self._recovery = Recovery(detected=time.time(), what=what, committed=committed)
            self._poller.set_fast(True)
            self.events.write(
                "restart",
                reason="machine_lost" if lost else "membership",
                lost=lost,
                generation=self.generation,
                committed=committed,
            )

    # -- monitoring -------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        smp_exit = None if self._smp_failed else self._smp.poll()
        if smp_exit is not None:
            return self._on_smp_death(worker_group, smp_exit)
        exchange_error = self._exchange_failure()
        if exchange_error is not None:
            return self._on_exchange_failure(worker_group, exchange_error)
        ready = self._standbys.poll()
        if ready:
            self.events.write(
                "standbys_ready",
                pids=[s.pid for s in ready],
                local_ranks=[s.local_rank for s in ready],
                warm_up_s=[round((s.ready_at or s.spawned) - s.spawned, 3) for s in ready],
            )
        if self._watch.kill_stopped_peers() and self._detected_at is None:
            self._detected_at = time.time()
        if (
            self._remaining_restarts > 0
            and _a_rank_failed(self._pcontext)
            and self._keep_survivors(worker_group)
        ):
            # elastic stops every other rank as soon as it sees the failure: the ones that
            # can rejoin in process were taken out of its reach first.
            result: RunResult = failed_after_detach(self._pcontext, worker_group)
        else:
            result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._on_failure(worker_group, result)
        elif result.state == WorkerState.HEALTHY:
            self._detected_at = None  # a rank that exited 0 is no failure
            self._check_progress()
            self._maybe_start_standbys()
        elif result.state == WorkerState.SUCCEEDED and self._recovery is not None:
            # The ranks stepped and finished between two polls: ask the SMP once more, so
            # the recovery is still reported (its times are the ranks' own progress times).
            progress = self._poller.fetch()
            if progress is not None and all_resumed(self._watch.procs, progress):
                self._report_resumed(progress)
        return result

    def _maybe_start_standbys(self) -> None:
        """Start the standbys for the next failure once every rank is stepping.

        Started no earlier, so that their imports do not slow this start (they run at a low
        priority anyway); ranks that never report progress get them after
        :data:`STANDBY_FALLBACK_S`.
        """
        if not self._standbys.enabled or self._recovery is not None:
            return
        if len(self._standbys.standbys()) >= self._standbys.count * len(self._watch.procs):
            return
        latest = self._poller.latest()
        stepping = latest is not None and all_resumed(self._watch.procs, latest[1])
        if stepping or time.time() - self._started_at > STANDBY_FALLBACK_S:
            started = self._standbys.spawn_missing()
            if started:
                self.events.write(
                    "standbys_started",
                    generation=self.generation,
                    pids=[s.pid for s in started],
                    local_ranks=[s.local_rank for s in started],
                )

    def _check_progress(self) -> None:
        latest = self._poller.latest()
        if latest is None:
            return
        fetched, progress = latest
        if self._recovery is not None and all_resumed(self._watch.procs, progress):
            self._report_resumed(progress)
        self._watch.check_hangs(progress, fetched)

    def _report_resumed(self, progress: dict[int, RankProgress]) -> None:
        rec, self._recovery = self._recovery, None
        assert rec is not None
        self._poller.set_fast(False)
        rec.rendezvous = self._rendezvous_at
        rec.started = self._started_at
        report_resumed(self._node, self.generation, rec, self._watch.procs, progress, self.events)


def _a_rank_failed(pcontext: Any) -> bool:
    """A rank of ``pcontext`` exited with an error (elastic will report a failure)."""
    return any(h.proc.poll() not in (None, 0) for h in live_handlers(pcontext).values())


def _peer_settings(ft: FtmemLaunchConfig) -> PeerSettings:
    """The peer mesh's settings from the launcher's flags."""
    return PeerSettings(
        parity=ft.ec_parity,
        max_group=ft.ec_group_size,
        key_file=ft.key_file,
        host=ft.peer_host or "127.0.0.1",
        interval_s=ft.ec_interval.total_seconds(),
        rebuild_timeout=ft.rebuild_timeout,
        encrypt=ft.ec_encrypt,
        encode_workers=ft.ec_encode_workers,
    )
