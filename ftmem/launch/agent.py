"""The ftmem-launch agent: torch.distributed.elastic's LocalElasticAgent plus the node's SMP.

:class:`FtmemElasticAgent` keeps elastic's restart loop (rendezvous, worker groups, restart
accounting, node loss through the rendezvous keep-alive); from elastic's hooks it calls the
modules that add ftmem's recovery: the SMP, the round's generation and this node's slot
(stable global ranks, hot spares, fencing), the failure detector, the peer mesh, a round of
another size, the ranks' warm or in-process start, hung ranks, what failed, and the report.

Its state is :class:`~ftmem.launch.recovery.RecoveryLifecycle`, changed only through its
methods. It overrides elastic's four abstract hooks (``_start_workers``, ``_stop_workers``,
``_monitor_workers``, ``_shutdown``); all else it needs of elastic's private API is in
:mod:`ftmem.launch.elastic_compat`.
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

from ftmem.errors import UnrecoverableError
from ftmem.faults import Point, maybe_inject
from ftmem.launch.config import FtmemLaunchConfig
from ftmem.launch.elastic_compat import (
    ELASTIC_POLL_S,
    ElasticAgentBase,
    awaiting_group_rank_0,
    failed_after_detach,
    log_tails_stop_at_once,
    rendezvous_join_timeout_s,
    rendezvous_members,
    rendezvous_poll_s,
    restart_rendezvous_quickly,
    trust_rendezvous_state_for,
)
from ftmem.launch.failures import NodeFailures, a_rank_failed
from ftmem.launch.in_process import InProcessRestarts
from ftmem.launch.membership import MembershipWatch
from ftmem.launch.metrics import AgentMetrics, MetricsServer
from ftmem.launch.monitor import EventLog, NoProgressGuard, RankProcess, StatusPoller, all_resumed
from ftmem.launch.node_slot import NodeSlot
from ftmem.launch.node_watch import NodeWatch
from ftmem.launch.peers import PeerMesh, PeerSettings, mesh_epoch
from ftmem.launch.rank_store import RankStore
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.recovery import AgentState, FailureKind, RecoveryLifecycle
from ftmem.launch.rendezvous import (
    SlotClaims,
    exchange_generation,
    join_until_held,
    share_master,
    slot_workers,
    stable_ranks_apply,
)
from ftmem.launch.report import log_joining, record_standbys, report_resumed, report_started
from ftmem.launch.reshape import Reshaper
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.state_guard import expire_keep_alive, leaving_round, reread_state
from ftmem.launch.warm_start import StandbyPool, spawning_from
from ftmem.launch.workers import rank_env
from ftmem.protocol.status import RankProgress

log = logging.getLogger(__name__)

RESTART_STOP_GRACE_S = 3
"""Seconds between SIGTERM and SIGKILL when the ranks stop for a restart (elastic's
``shutdown_timeout`` applies when the job ends): their state is in the SMP, and a SIGTERM
handler that talks to dead peers (Lightning's ``dist.broadcast``) would hold the restart."""

STANDBY_FALLBACK_S = 30.0
"""Standbys start this long after the ranks even if the ranks never report progress."""


class FtmemElasticAgent(ElasticAgentBase):
    """LocalElasticAgent that also runs the node's SMP and its recovery (module docstring).

    Resource handling: the SMP and the status poller are stopped in :meth:`_shutdown`,
    which elastic calls on every exit path of ``run()`` (success, failure, signal).
    """

    def __init__(self, *args: Any, ftmem: FtmemLaunchConfig, smp: SmpRunner, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._ft = ftmem
        self._smp = smp
        self._node = smp.node
        self._poller = StatusPoller(
            smp.run_dir, ftmem.status_interval, request_timeout=timedelta(seconds=5)
        )
        self.events = EventLog(smp.run_dir / "events.jsonl", smp.node)
        """The machine-readable event log (JSON lines) in the run directory."""
        self._life = RecoveryLifecycle(
            smp.node, self.events, NoProgressGuard(ftmem.no_progress_restarts)
        )
        """The agent's state and the recovery in progress (ftmem.launch.recovery)."""
        self.generation = -1
        """The generation of the current ranks (same on every node; the rendezvous round
        where no round number came back)."""
        self._watch = RankWatch(
            smp.node,
            self.events,
            ftmem.hang_timeout,
            ftmem.first_progress_timeout,
            ftmem.rejoin_timeout,
        )
        self._failures = NodeFailures(
            life=self._life,
            smp=smp,
            poller=self._poller,
            watch=self._watch,
            events=self.events,
            restarts=lambda: (self.restarts_left, self.get_worker_group().spec.max_restarts),
            stop_restarting=self.stop_restarting,
        )
        self._in_process = InProcessRestarts(smp.node, smp.run_dir)
        self._rank_store = RankStore(smp.node)
        self._mesh = PeerMesh(PeerSettings.from_launch(ftmem, smp.run_id))
        self._reshape = Reshaper(smp, self._mesh, self.events)
        self._seat = NodeSlot(
            SlotClaims(self._mesh.settings, smp.node), smp, self._poller, self.events
        )
        self._standbys = StandbyPool(
            count=ftmem.standby,
            imports=ftmem.standby_imports,
            cuda=ftmem.standby_cuda,
            run_dir=smp.run_dir,
            node=smp.node,
            fork=ftmem.standby_fork and not ftmem.standby_cuda,
        )
        spec = self.get_worker_group().spec
        self._standbys.configure(spec.entrypoint, spec.args, spec.local_world_size)
        handler = spec.rdzv_handler
        self._membership = handler if isinstance(handler, MembershipWatch) else None
        """The rendezvous handler's watch (launch_agent always wraps it), None otherwise."""
        self._nodes = NodeWatch(
            node=smp.node,
            run_id=smp.run_id,
            mesh=self._mesh,
            suspect=ftmem.detect_timeout,
            insecure=ftmem.insecure_mesh,
            publish=lambda node: expire_keep_alive(self.rdzv_handler, node),
            events=self.events,
            declare=self._membership.declare if self._membership is not None else None,
        )
        if self._membership is not None:
            self._membership.on_event = self.events.write
            self._membership.why_gone = self._nodes.why_gone
        self.metrics: MetricsServer | None = None
        """The Prometheus metrics server (``--ftmem-metrics-port``), started by the launcher."""
        if ftmem.metrics_port:
            counted = AgentMetrics(smp.node, self._poller.status)
            self.events.listeners.append(counted.observe)
            self.metrics = MetricsServer(counted, ftmem.metrics_port, ftmem.metrics_addr)

    def initialize_workers(self, start: Callable[[], None]) -> None:
        """elastic's rendezvous and start of the ranks, until a round holds
        (:func:`~ftmem.launch.rendezvous.join_until_held`)."""
        join_until_held(start, self._node)

    def join_rendezvous(self, worker_group: WorkerGroup, join: Callable[[], None]) -> None:
        if self._life.state is not AgentState.JOINING:  # (joining again: a round was left)
            self._life.to(AgentState.JOINING, generation=self.generation)
        settings = getattr(self.rdzv_handler, "settings", None)  # the c10d/etcd-v2 handler
        log_joining(self._node, settings)
        poll_s = rendezvous_poll_s(settings.max_nodes if settings is not None else 1)
        trust_rendezvous_state_for(self.rdzv_handler, poll_s)
        ms = self._membership  # (a loss counts whichever failure this node noticed first)
        lost = self._life.kind is FailureKind.MACHINE_LOST or bool(ms and ms.machine_lost())
        with (
            restart_rendezvous_quickly(
                restart=self.generation >= 0,
                poll_s=poll_s,
                between_polls=self._while_joining,
                handler=self.rdzv_handler,
                last_call=self._ft.restart_last_call if lost else None,
            ),
            leaving_round(self.rdzv_handler),
            awaiting_group_rank_0(lambda: reread_state(self.rdzv_handler), poll_s),
        ):
            join()
        # Outside restarts elastic's own pace: a state read is trusted for 1 s again, so the
        # healthy loop reads the store about once a second (not every monitor interval).
        trust_rendezvous_state_for(self.rdzv_handler, ELASTIC_POLL_S)
        if self._life.state is AgentState.SPARE:
            log.warning("[%s] SPARE TAKES OVER: a node left the job; joining it", self._node)
            self._life.to(AgentState.JOINING, spare=True)
        store = self.round_store(worker_group.store)
        agreed = self._seat.agreement()
        if agreed is not None:
            share_master(worker_group, store, self._seat.slot, agreed.nonce)
            self.generation = agreed.generation
        else:
            self.generation = exchange_generation(
                worker_group, store, self.rendezvous_round, self.generation
            )
        self._serve_rank_store(worker_group)
        ranks = [w.global_rank for w in worker_group.workers]
        self._seat.joined(ranks)
        self._life.to(AgentState.SYNCING, generation=self.generation, ranks=ranks)

    def _while_joining(self) -> bool:
        """Between two reads of the rendezvous state while joining: notice that this node
        waits as a hot spare (elastic's redundancy list: the round has all its nodes), then
        keep standby ranks warm for the moment it takes a lost node's place. True while a
        spare: it reads the state quickly, to see a lost node's place free at once."""
        if self._life.state is not AgentState.SPARE:
            members = rendezvous_members(self.rdzv_handler)
            if members is None or not members.spare:
                return False
            self._life.to(AgentState.SPARE)
            self._seat.to_spare()
            self._standbys.spawn_missing()
        self._standbys.poll()
        return True

    def _serve_rank_store(self, worker_group: WorkerGroup) -> None:
        """Serve this generation's rank store here if this node runs global rank 0
        (:mod:`ftmem.launch.rank_store`): the node of slot 0, else elastic's group rank 0."""
        hosts = self._seat.index(worker_group.group_rank) == 0
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
        """Keep every node's global ranks across rounds (elastic renumbers by node order):
        :meth:`NodeSlot.agree`; nodes of different sizes fall back to elastic's assignment."""
        if not stable_ranks_apply(self._ft.rank_assignment, spec):
            self._seat.unassigned()
            return elastic_default()
        size, round_ = spec.local_world_size, self.rendezvous_round()
        maybe_inject(Point.IN_AGREEMENT, group_rank, round_ or 0)
        slot = self._seat.agree(store, group_rank, group_world_size, size, self.generation, round_)
        if slot is None:
            return elastic_default()
        return slot_workers(slot, size, group_world_size)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        rec = self._life.recovery
        expected = rec.committed if rec is not None else None
        if self._smp.ensure_running():
            self._poller.forget()
        self._watch_nodes(worker_group)
        self._join_peers(worker_group)
        ftmem_env = rank_env(
            run_dir=self._smp.run_dir,
            run_id=self._smp.run_id,
            node=self._node,
            generation=self.generation,
            expected_step=expected,
            # A rank under ftmem.run waits for its next generation up to the rendezvous's wait
            # for a replacement node, plus --ftmem-rejoin-timeout for the order itself.
            rejoin_timeout_s=self._ft.rejoin_timeout.total_seconds()
            + rendezvous_join_timeout_s(self.rdzv_handler),
            checkfree=self._ft.checkfree,
            flush_dirs=self._ft.flush_tiers(),
            reshard=self._reshape.request.to_env() if self._reshape.request else "",
        )
        if not isinstance(worker_group.spec.entrypoint, str):
            # A function entrypoint runs in multiprocessing children that elastic gives a copy
            # of this process's environment: no hook hands them a value.
            os.environ.update(ftmem_env)
        start = time.time()
        self._in_process.begin_generation(self.generation, ftmem_env)
        with (
            log_tails_stop_at_once(),
            spawning_from(
                self._standbys,
                self._in_process.adopt,
                {**ftmem_env, **self._rank_store.rank_env()},
            ),
        ):
            pids: dict[int, Any] = super()._start_workers(worker_group)
        self._in_process.discard("its local rank is not in the new generation")
        kept = self._in_process.adopted
        self._life.to(AgentState.STARTED, generation=self.generation)
        started = self._life.started_at
        workers = worker_group.workers
        procs = [
            RankProcess(w.global_rank, pids[w.local_rank], start, kept=w.global_rank in kept)
            for w in workers
        ]
        self._watch.started(procs)
        self._poller.start()
        report_started(
            self._node,
            self.generation,
            procs,
            self.events,
            from_standby=[w.global_rank for w in workers if w.local_rank in self._standbys.handed],
            in_process=sorted(kept),
            start_s=round(started - start, 4),
            smp_pid=self._smp.pid,
            smp_starts=self._smp.starts,
        )
        return pids

    def _watch_nodes(self, worker_group: WorkerGroup) -> None:
        """Have the failure detector watch this round's ring neighbours."""
        members = rendezvous_members(self.rdzv_handler)
        self._nodes.watch_round(
            self.round_store(worker_group.store),
            nodes=worker_group.group_world_size,
            slot=self._seat.index(worker_group.group_rank),
            group_rank=worker_group.group_rank,
            me=members.me if members is not None else None,
            generation=self.generation,
        )

    def _join_peers(self, worker_group: WorkerGroup) -> None:
        """Sync this generation's peer mesh; a node that lost its memory rebuilds it first.
        When the job's size changed, the lost machines' step is rebuilt first
        (:mod:`ftmem.launch.reshape`) and the ranks are told to reshard it."""
        store = self.round_store(worker_group.store)
        self._reshape.request = None
        if store is None:
            return
        reshaped = self._reshape.prepare(
            store,
            self._seat.offers(),
            group_rank=worker_group.group_rank or 0,
            claimed=self._seat.claimed,
            generation=self.generation,
        )
        self._seat.nodes = worker_group.group_world_size
        try:
            self._mesh.sync(
                self.events,
                self._ft.checkfree,
                store=store,
                group_rank=worker_group.group_rank,
                nodes=worker_group.group_world_size,
                me=self._seat.index(worker_group.group_rank),
                generation=self.generation,
                run_dir=self._smp.run_dir,
                ranks=[w.global_rank for w in worker_group.workers],
                node_name=self._node,
                epoch=mesh_epoch(self.generation, reshaped=reshaped),
            )
        except UnrecoverableError as exc:
            self._life.stop_reason = str(exc)
            raise

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # LocalElasticAgent's version calls self._shutdown(), which here also stops the SMP.
        self._nodes.pause()
        self._watch.kill_stopped("while the ranks are stopped")
        kind = self._life.kind
        if self._life.state is not AgentState.RESTARTING:
            self._in_process.discard("no restart follows")
        elif kind is not None and kind.node_side:
            self._in_process.discard("the node's SMP side failed: every rank restarts cold")
        else:
            self._keep_survivors(worker_group)
        self.stop_ranks(signal.SIGTERM, min(RESTART_STOP_GRACE_S, self.shutdown_timeout_s))
        if self._life.state is AgentState.RESTARTING:
            rec = self._life.recovery
            if rec is not None and rec.stopped is None:  # a node-side failure: stopped only now
                rec.stopped = time.time()
            self._life.to(AgentState.STOPPED)

    def _keep_survivors(self, worker_group: WorkerGroup) -> list[int]:
        """Take the ranks that can rejoin in process out of elastic's hands before it stops
        the others (see :mod:`ftmem.launch.in_process`); return their local ranks."""
        # The poller's answer may be a poll old: progress only grows, so it can only make a
        # rank look as if it had not stepped in this generation yet (it then restarts cold).
        latest = self._poller.latest()
        progress = latest[1] if latest is not None else None
        if progress is None and self._smp.is_alive():
            progress = self._poller.fetch()
        global_ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        keep = self._in_process.keepable(
            self.process_context(),
            global_ranks,
            self._watch.procs,
            progress or {},
            set(self._watch.hang_killed),
        )
        self._in_process.detach(self.process_context(), keep, global_ranks)
        return keep

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        try:
            self._life.to(AgentState.DONE)
            self._in_process.discard("the agent is shutting down")
            self._watch.kill_stopped("at shutdown")
            self.stop_ranks(death_sig, timeout)
        finally:
            self._nodes.close()
            self._standbys.stop()
            self._poller.close()
            self._reshape.stop()
            self._smp.stop()
            self._rank_store.close()

    def before_restart(self, worker_group: WorkerGroup) -> None:
        if self._life.state is not AgentState.DETECTED:  # another node changed the job
            ranks = [w.global_rank for w in worker_group.workers]
            lost = list(self._membership.lost) if self._membership is not None else []
            self._failures.membership_changed(ranks, lost, self.generation)
        self._life.to(AgentState.RESTARTING)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        ranks = [w.global_rank for w in worker_group.workers]
        smp_exit = self._smp.poll() if self._life.watching else None
        if smp_exit is not None:
            return self._failures.smp_died(ranks, smp_exit, self.generation)
        protection_error = self._failures.protection_error()
        if protection_error is not None:
            return self._failures.protection_failed(ranks, protection_error, self.generation)
        record_standbys(self.events, "standbys_ready", self._standbys.poll())
        if self._watch.kill_stopped_peers() and self._life.first_seen is None:
            self._life.first_seen = time.time()
        if (
            self.restarts_left > 0
            and a_rank_failed(self.process_context())
            and self._keep_survivors(worker_group)
        ):
            # elastic stops every other rank as soon as it sees the failure: the ones that
            # can rejoin in process were taken out of its reach first.
            result: RunResult = failed_after_detach(self.process_context(), worker_group)
        else:
            result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            paths = self.rank_stderr_paths()
            server = self._standbys.server
            died_at = server.reaped_at if server is not None else {}
            self._failures.rank_failed(ranks, result, paths, self.generation, died_at)
        elif result.state == WorkerState.HEALTHY:
            self._life.first_seen = None  # a rank that exited 0 is no failure
            self._check_progress()
            self._maybe_start_standbys()
        elif result.state == WorkerState.SUCCEEDED and self._life.state is AgentState.STARTED:
            # The ranks stepped and finished between two polls: ask the SMP once more, so
            # the recovery is still reported (its times are the ranks' own progress times).
            progress = self._poller.fetch()
            if progress is not None and all_resumed(self._watch.procs, progress):
                self._resumed(progress)
        return result

    def _maybe_start_standbys(self) -> None:
        """Start the standbys for the next failure: at once where the host has idle cores
        for their warm-up (:func:`~ftmem.launch.warm_start.idle_cores`), else once every rank is
        stepping, so that their imports do not slow this start (ranks that never report
        progress get them after :data:`STANDBY_FALLBACK_S`)."""
        idle = self._standbys.idle
        if not self._standbys.enabled or (self._life.recovery is not None and not idle):
            return
        if len(self._standbys.standbys()) >= self._standbys.count * len(self._watch.procs):
            return
        latest = self._poller.latest()
        stepping = latest is not None and all_resumed(self._watch.procs, latest[1])
        if idle or stepping or time.time() - self._life.started_at > STANDBY_FALLBACK_S:
            started = self._standbys.spawn_missing()
            record_standbys(self.events, "standbys_started", started, generation=self.generation)

    def _check_progress(self) -> None:
        latest = self._poller.latest()
        if latest is None:
            return
        fetched, progress = latest
        if self._life.state is AgentState.STARTED and all_resumed(self._watch.procs, progress):
            self._resumed(progress)
        if self._reshape.guests:
            ex = self._poller.protection()
            self._reshape.protected(ex[1].protected_step if ex is not None else None)
        self._watch.check_hangs(progress, fetched)

    def _resumed(self, progress: dict[int, RankProgress]) -> None:
        """Every rank stepped: RUNNING; a recovery in progress is reported."""
        rec = self._life.resumed()
        if rec is None:
            return
        self._poller.set_fast(False)
        report_resumed(self._node, self.generation, rec, self._watch.procs, progress, self.events)

    def report_last_failure(self) -> None:
        """Log why the agent gave up: the guard's reason and the failing rank's last lines."""
        self._life.report_last_failure()
