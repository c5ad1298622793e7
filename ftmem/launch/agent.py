"""The ftmem-launch agent: torch.distributed.elastic's LocalElasticAgent plus the node's SMP.

:class:`FtmemElasticAgent` keeps elastic's restart loop (rendezvous, worker groups, restart
accounting, node-loss detection through the rendezvous keep-alive) and adds:

- the SMP's lifecycle: started before the first ranks, kept across rank restarts, restarted
  (with the ranks) when it dies, stopped when the agent shuts down;
- a generation id common to all nodes (the rendezvous round), passed to the ranks;
- stable global ranks: a node keeps its ranks across rounds, a replacement takes the lost
  node's, and MASTER_ADDR/PORT follow global rank 0;
- hang detection from the SMP's per-rank progress (SIGKILL, then elastic's restart);
- a failure detector of its own (:mod:`ftmem.launch.detector`): heartbeats with its ring
  neighbours; a machine declared lost is marked expired in the rendezvous, and every agent
  restarts its ranks at once, a spare waiting or not;
- hot spares: an agent that finds the round full waits in elastic's redundancy list with
  warm standbys and takes a lost machine's slot; a node that was dropped and returns is
  fenced (its slot and snapshots dropped);
- the no-progress guard, and one log line per failure and per recovery.

Its state (joining, spare, syncing, started, running, detected, ...) is one state machine,
:class:`~ftmem.launch.recovery.RecoveryLifecycle`; the rendezvous handler it is given is
wrapped in :class:`~ftmem.launch.membership.MembershipWatch`, which rides out a store that
does not answer and names lost machines.

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
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ftmem.client.reshard import ReshardRequest
from ftmem.errors import FtmemError, UnrecoverableError
from ftmem.exchange.keys import KeyFileError
from ftmem.launch.config import (
    FtmemLaunchConfig,
    is_loopback,
)
from ftmem.launch.detector import FailureDetector, neighbours, read_watch_entry, watch_entry
from ftmem.launch.elastic_compat import (
    ELASTIC_POLL_S,
    ElasticAgentBase,
    expire_keep_alive,
    failed_after_detach,
    live_handlers,
    log_tails_stop_at_once,
    rendezvous_members,
    rendezvous_poll_s,
    restart_rendezvous_quickly,
    trust_rendezvous_state_for,
)
from ftmem.launch.in_process import InProcessRestarts
from ftmem.launch.membership import MembershipWatch
from ftmem.launch.metrics import AgentMetrics, MetricsServer
from ftmem.launch.monitor import (
    EventLog,
    NoProgressGuard,
    RankProcess,
    StatusPoller,
    all_resumed,
    min_committed,
)
from ftmem.launch.peers import (
    PeerSettings,
    host_key_path,
    job_keys,
    join_generation,
    mesh_epoch,
    resolve_parity,
)
from ftmem.launch.rank_store import RankStore
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.recovery import AgentState, FailureKind, RecoveryLifecycle
from ftmem.launch.rendezvous import (
    SlotClaims,
    SlotOffer,
    exchange_generation,
    share_master,
    slot_workers,
    stable_ranks_apply,
)
from ftmem.launch.report import report_resumed, tail_lines
from ftmem.launch.reshape import (
    Reshape,
    drop_newer,
    guest_run_dir,
    plan_reshape,
    run_all,
    survivors_barrier,
)
from ftmem.launch.smp_runner import SmpRunner
from ftmem.launch.standby import StandbyPool, spawning_from
from ftmem.launch.workers import describe_exit, rank_env
from ftmem.protocol.status import ExchangeState, RankProgress

log = logging.getLogger(__name__)

RESTART_STOP_GRACE_S = 3
"""Seconds the ranks get after SIGTERM before SIGKILL when they are stopped for a restart
(elastic's ``shutdown_timeout``, 30 s, still applies when the job ends). Their state is in the
SMP, so they have nothing to save; a SIGTERM handler that talks to dead peers (Lightning's
calls ``dist.broadcast``) would otherwise hold the restart for the whole 30 s."""

STANDBY_FALLBACK_S = 30.0
"""Standbys start this long after the ranks even if the ranks never report progress."""


class FtmemElasticAgent(ElasticAgentBase):
    """LocalElasticAgent that also runs the node's SMP and detects hung ranks.

    Its recovery lifecycle (what state it is in, the failure being recovered from) is one
    :class:`~ftmem.launch.recovery.RecoveryLifecycle`; see that module for the states.

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
        self.events = EventLog(smp.run_dir / "events.jsonl", smp.node)
        """The machine-readable event log (JSON lines) in the run directory."""
        self._life = RecoveryLifecycle(
            smp.node, self.events, NoProgressGuard(ftmem.no_progress_restarts)
        )
        """The agent's state and the recovery in progress (ftmem.launch.recovery)."""
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
        self._slot: int | None = None
        """This node's block of global ranks (stable across rounds), None: elastic's."""
        self._prev_ranks: list[int] | None = None
        self._prev_nodes: int | None = None
        """The node count of the last round this node ran ranks in (None: none yet)."""
        self._claimed: int | None = None
        """The slot this node held in the last round (what it offered in this one)."""
        self._reshard: ReshardRequest | None = None
        """This generation's step to reshard (the job's size changed), else None."""
        self._reshard_step: int | None = None
        self._guests: list[SmpRunner] = []
        """Guest SMPs holding lost slots' rebuilt step until the new mesh protects a newer one."""
        self._peer_settings = _peer_settings(ftmem, smp.run_id)
        self._claims = SlotClaims(self._peer_settings, smp.node)
        self._key_warned = [False]
        self._standbys = StandbyPool(
            count=ftmem.standby,
            imports=ftmem.standby_imports,
            cuda=ftmem.standby_cuda,
            run_dir=smp.run_dir,
            node=smp.node,
        )
        spec = self.get_worker_group().spec
        self._standbys.configure(spec.entrypoint, spec.args, spec.local_world_size)
        handler = self.get_worker_group().spec.rdzv_handler
        self._membership = handler if isinstance(handler, MembershipWatch) else None
        """The rendezvous handler's watch (launch_agent always wraps it), None otherwise."""
        if self._membership is not None:
            self._membership.on_event = self.events.write
        self._detector: FailureDetector | None = None
        """The failure detector, started at the first round of several nodes."""
        self._detector_off = ftmem.detect_timeout.total_seconds() <= 0
        self._detector_key = b""
        self.metrics: MetricsServer | None = None
        """The Prometheus metrics server (``--ftmem-metrics-port``), started by the launcher."""
        if ftmem.metrics_port:
            counted = AgentMetrics(smp.node, self._poller.status)
            self.events.listeners.append(counted.observe)
            self.metrics = MetricsServer(counted, ftmem.metrics_port, ftmem.metrics_addr)

    # -- rendezvous -------------------------------------------------------------------------

    def join_rendezvous(self, worker_group: WorkerGroup, join: Callable[[], None]) -> None:
        self._life.to(AgentState.JOINING, generation=self.generation)
        settings = getattr(self.rdzv_handler, "settings", None)  # the c10d/etcd-v2 handler
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
        trust_rendezvous_state_for(self.rdzv_handler, poll_s)
        lost = self._life.kind is FailureKind.MACHINE_LOST
        with restart_rendezvous_quickly(
            restart=self.generation >= 0,
            poll_s=poll_s,
            between_polls=self._while_joining,
            handler=self.rdzv_handler,
            last_call=self._ft.restart_last_call if lost else None,
        ):
            join()
        # Outside restarts elastic's own pace: a state read is trusted for 1 s again, so the
        # healthy loop reads the store about once a second (not every monitor interval).
        trust_rendezvous_state_for(self.rdzv_handler, ELASTIC_POLL_S)
        if self._life.state is AgentState.SPARE:
            log.warning("[%s] SPARE TAKES OVER: a node left the job; joining it", self._node)
            self._life.to(AgentState.JOINING, spare=True)
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
            log.warning(
                "[%s] SPARE: the job has all its nodes; waiting as a hot spare (an SMP and "
                "warm standby ranks) to take the place of a lost node",
                self._node,
            )
            if self._slot is not None:
                self._fence(f"slot {self._slot} went on without this node")
                self._slot = None
            self._standbys.spawn_missing()
        self._standbys.poll()
        return True

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
        claimed = self._claimed = self._slot
        nodes = self._prev_nodes if claimed is not None else None
        offer = SlotOffer(claimed, spec.local_world_size, self.generation, nodes)
        self._slot = self._claims.agree(
            store, group_rank, group_world_size, offer, self.rendezvous_round()
        )
        if claimed is not None and self._claims.fenced_by(claimed, group_rank):
            self._fence(f"slot {claimed} is held by a node that took it over more recently")
        if self._slot is None:
            log.warning("[%s] nodes differ in size: elastic assigns the ranks", self._node)
            return elastic_default()
        return slot_workers(self._slot, spec.local_world_size, group_world_size)

    # -- start / stop ranks -----------------------------------------------------------------

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
            rejoin_timeout_s=self._rank_rejoin_wait(),
            checkfree=self._ft.checkfree,
            flush_dirs=self._ft.flush_tiers(),
            reshard=self._reshard.to_env() if self._reshard is not None else "",
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
        settings = getattr(self.rdzv_handler, "settings", None)
        join = getattr(getattr(settings, "timeout", None), "join", None)
        extra = join.total_seconds() if isinstance(join, timedelta) else 0.0
        return self._ft.rejoin_timeout.total_seconds() + extra

    def _watch_nodes(self, worker_group: WorkerGroup) -> None:
        """Have the failure detector watch this round's nodes: publish this node's heartbeat
        address in the store (authenticated with the job's key) and read its ring
        neighbours' (at most ``2 * RADIUS`` reads, whatever the job's size)."""
        store, n = worker_group.store, worker_group.group_world_size
        members = rendezvous_members(self.rdzv_handler)
        if self._detector_off or store is None or n < 2 or members is None:
            return
        me = self._slot if self._slot is not None else worker_group.group_rank
        if me is None or not 0 <= me < n:
            return
        slots = [f"slot {i}" for i in range(n)]  # the ring, by slot; names filled in below
        near = [int(x.split()[1]) for x in neighbours(slots, slots[me])]
        try:
            detector = self._detector or self._start_detector(store, worker_group.group_rank)
            if detector is None:
                return
            key = self._detector_key
            store.set(
                f"ftmem/watch/{me}",
                watch_entry(key, self.generation, me, members.me, detector.address),
            )
            raw = store.multi_get([f"ftmem/watch/{i}" for i in near])
            entries = [
                read_watch_entry(key, bytes(v), self.generation, i)
                for i, v in zip(near, raw, strict=True)
            ]
        except (FtmemError, KeyFileError, OSError, RuntimeError, ValueError) as exc:
            log.warning(
                "[%s] the failure detector does not watch generation %d (%s): a lost machine "
                "is found by the rendezvous keep-alive alone",
                self._node,
                self.generation,
                exc,
            )
            return
        slots[me] = members.me
        for e in entries:
            slots[e.slot] = e.node
        detector.watch(self.generation, members.me, {e.node: e.addr for e in entries}, slots)

    def _start_detector(self, store: Any, group_rank: int) -> FailureDetector | None:
        """Start the failure detector with a key derived from the job's (None: no key)."""
        from ftmem.exchange import keys

        ps = self._peer_settings
        if ps.key_file is None and not self._ft.insecure_mesh and not is_loopback(ps.host):
            log.warning(
                "[%s] no --ftmem-key-file: the failure detector's heartbeats cannot be "
                "authenticated across hosts, so it is off; a lost machine is found by the "
                "rendezvous keep-alive alone",
                self._node,
            )
            self._detector_off = True
            return None
        job = keys.CurveKeyPair.from_json(job_keys(ps, store, group_rank, self._key_warned))
        self._detector_key = job.derived_key("heartbeat")
        detector = FailureDetector(
            node=self._node,
            run_id=self._smp.run_id,
            key=self._detector_key,
            host=ps.host,
            suspect=self._ft.detect_timeout,
            publish=lambda node: expire_keep_alive(self.rdzv_handler, node),
            on_lost=self._declared_lost,
        )
        detector.start()
        self._detector = detector
        return detector

    def _declared_lost(self, node: str, why: str) -> None:
        """The failure detector published ``node`` lost (its thread): restart at once."""
        self.events.write("declared_lost", peer=node, why=why, generation=self.generation)
        if self._membership is not None:
            self._membership.declare(node, why)

    def _join_peers(self, worker_group: WorkerGroup) -> None:
        """Sync this generation's peer mesh; a node that lost its memory rebuilds it first.
        When the job's size changed, the lost machines' step is rebuilt first
        (:mod:`ftmem.launch.reshape`) and the ranks are told to reshard it."""
        store = worker_group.store
        self._reshard = None
        if store is None:
            return
        reshape = None
        if self._slot is not None:
            reshape = plan_reshape(self._claims.offers())
        self._prev_nodes = worker_group.group_world_size
        if reshape is not None:
            self._rebuild_lost(worker_group, reshape)
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
                epoch=mesh_epoch(self.generation, reshaped=reshape is not None),
            )
        except UnrecoverableError as exc:
            if self._ft.checkfree:  # the ranks rebuild lost pipeline stages from neighbours
                log.error("[%s] %s; --ftmem-checkfree: going on without it", self._node, exc)
                self.events.write("checkfree", generation=self.generation, reason=str(exc))
                return
            self._life.stop_reason = str(exc)
            log.error("[%s] UNRECOVERABLE: %s", self._node, exc)
            self.events.write("unrecoverable", generation=self.generation, reason=str(exc))
            raise
        except (FtmemError, KeyFileError) as exc:
            log.error("[%s] the peer mesh is not protecting this generation: %s", self._node, exc)
            self.events.write("peers_failed", generation=self.generation, reason=str(exc))
            return
        if result is not None:
            self.events.write("peers_synced", generation=self.generation, **result)

    def _rebuild_lost(self, worker_group: WorkerGroup, rs: Reshape) -> None:
        """The job changed size: rebuild the lost slots' protected step in guest SMPs (this
        node hosts some), and set the step the ranks reshard (:mod:`ftmem.launch.reshape`)."""
        grew = rs.new_nodes > rs.old_nodes
        log.warning(
            "[%s] RESHAPE: the job %s from %d to %d nodes%s; the ranks reshard its step from "
            "memory",
            self._node,
            "grows" if grew else "shrinks",
            rs.old_nodes,
            rs.new_nodes,
            f" (lost slots {list(rs.lost)})" if rs.lost else "",
        )
        self.events.write(
            "reshape",
            generation=self.generation,
            old_nodes=rs.old_nodes,
            new_nodes=rs.new_nodes,
            lost=list(rs.lost),
        )
        step: int | None = None
        dirs: list[Path] = []
        parity = resolve_parity(self._peer_settings.parity, rs.old_nodes)
        claimed = self._claimed
        rebuild = claimed is not None and 0 < len(rs.lost) <= parity
        if rebuild and claimed is not None:
            t0 = time.monotonic()
            hosted = [s for s, g in rs.guests.items() if g == worker_group.group_rank]
            try:
                jobs = {"self": self._old_mesh_join(worker_group, rs, claimed, self._smp)}
                for slot in hosted:
                    guest = self._start_guest(slot)
                    dirs.append(guest.run_dir)
                    jobs[f"guest{slot}"] = self._old_mesh_join(worker_group, rs, slot, guest)
                results = run_all(jobs)
            except (FtmemError, KeyFileError, OSError) as exc:
                log.error(
                    "[%s] rebuilding the lost slots %s failed: %s; the ranks reshard from "
                    "what memory holds, else from the newest flushed checkpoint",
                    self._node,
                    list(rs.lost),
                    exc,
                )
                self.events.write("reshape_failed", generation=self.generation, reason=str(exc))
                self._stop_guests()
                dirs = []
            else:
                mine = results.get("self") or {}
                step = mine.get("step")
                if step is not None:
                    self._drop_unprotected(rs.old_ranks(claimed), step)
                self.events.write(
                    "rebuilt_lost",
                    generation=self.generation,
                    step=step,
                    slots=hosted,
                    seconds=round(time.monotonic() - t0, 3),
                )
                log.info(
                    "[%s] the old mesh kept step %s; lost slots %s rebuilt here: %s (%.2f s)",
                    self._node,
                    step,
                    list(rs.lost),
                    hosted,
                    time.monotonic() - t0,
                )
        elif rs.lost:
            log.error(
                "[%s] %d slots lost, erasure coding covers %d: the ranks reshard from the "
                "newest flushed checkpoint of the %d-node job (--ftmem-flush-dir)",
                self._node,
                len(rs.lost),
                parity,
                rs.old_nodes,
            )
        if rebuild:  # every survivor, whatever its own join did
            try:
                survivors_barrier(
                    worker_group.store, rs, worker_group.group_rank or 0, self.generation
                )
            except RuntimeError as exc:  # torch's DistStoreError: a survivor never arrived
                log.error("[%s] the survivors did not all finish the rebuild: %s", self._node, exc)
        self._reshard = ReshardRequest(rs.old_world, step, tuple(dirs))
        self._reshard_step = step

    def _drop_unprotected(self, ranks: list[int], step: int) -> None:
        """Drop this node's snapshots of the old job newer than the kept ``step`` before the
        new mesh forms (:func:`~ftmem.launch.reshape.drop_newer`)."""
        try:
            drop_newer(self._smp.run_dir, ranks, step)
        except FtmemError as exc:  # the ranks' load drops them as well, later
            log.warning(
                "[%s] could not drop the old job's steps newer than %d: %s", self._node, step, exc
            )

    def _old_mesh_join(
        self, worker_group: WorkerGroup, rs: Reshape, slot: int, smp: SmpRunner
    ) -> Callable[[], Any]:
        """Join the last round's mesh once more as old slot ``slot`` with SMP ``smp``."""
        own = smp is self._smp
        # A store client serves one blocking call at a time: each concurrent join its own.
        assert worker_group.store is not None
        store = worker_group.store if own else worker_group.store.clone()
        return lambda: join_generation(
            settings=self._peer_settings,
            store=store,
            group_rank=(worker_group.group_rank or 0) if own else -1,
            nodes=rs.old_nodes,
            me=slot,
            generation=self.generation,
            run_dir=smp.run_dir,
            ranks=rs.old_ranks(slot),
            node_name=smp.node,
            warned=self._key_warned,
            epoch=mesh_epoch(self.generation),
            tag="/rebuild",
        )

    def _start_guest(self, slot: int) -> SmpRunner:
        """Start (and keep) the guest SMP of lost slot ``slot`` on this node."""
        main = self._smp
        guest = SmpRunner(
            run_dir=guest_run_dir(main.run_dir, slot),
            run_id=main.run_id,
            node=f"{self._node}-guest{slot}",
            slots=main.slots,
            start_timeout=main.start_timeout,
            stop_timeout=main.stop_timeout,
            log_level=main.log_level,
            extra_env=main.extra_env,
        )
        self._guests.append(guest)
        guest.start()
        return guest

    def _stop_guests(self) -> None:
        guests, self._guests = self._guests, []
        for guest in guests:
            guest.stop()

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # LocalElasticAgent's version calls self._shutdown(), which here also stops the SMP.
        if self._detector is not None:
            self._detector.pause()
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
            self._life.to(AgentState.STOPPED)

    def _keep_survivors(self, worker_group: WorkerGroup) -> list[int]:
        """Take the ranks that can rejoin in process out of elastic's hands before it stops
        the others (see :mod:`ftmem.launch.in_process`); return their local ranks."""
        # The poller's newest answer (at most --ftmem-tune status-interval old, 0.1 s during a
        # recovery): progress only grows, so an older answer can only make a rank look as if
        # it had not stepped yet in this generation, and it is then restarted cold.
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
            if self._detector is not None:
                self._detector.close()
            self._standbys.stop()
            self._poller.close()
            self._stop_guests()
            self._smp.stop()
            self._rank_store.close()

    def before_restart(self, worker_group: WorkerGroup) -> None:
        if self._life.state is not AgentState.DETECTED:
            # elastic restarts healthy ranks when another node (re)joins the rendezvous:
            # typically that node's ranks failed, or a spare replaces a lost machine. It is
            # not charged as a restart.
            ranks = [w.global_rank for w in worker_group.workers]
            committed = self._committed_now(ranks)
            lost = list(self._membership.lost) if self._membership is not None else []
            what = (
                f"MACHINE LOST ({', '.join(lost)}): a spare or a replacement takes its place, or the job shrinks"
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
            kind = FailureKind.MACHINE_LOST if lost else FailureKind.MEMBERSHIP
            self._life.detected(kind, what, committed)
            self._poller.set_fast(True)
            self.events.write(
                "restart",
                reason=kind.value,
                lost=lost,
                generation=self.generation,
                committed=committed,
            )
        self._life.to(AgentState.RESTARTING)

    # -- monitoring -------------------------------------------------------------------------

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        smp_exit = self._smp.poll() if self._life.watching else None
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
        if self._watch.kill_stopped_peers() and self._life.first_seen is None:
            self._life.first_seen = time.time()
        if (
            self.restarts_left > 0
            and _a_rank_failed(self.process_context())
            and self._keep_survivors(worker_group)
        ):
            # elastic stops every other rank as soon as it sees the failure: the ones that
            # can rejoin in process were taken out of its reach first.
            result: RunResult = failed_after_detach(self.process_context(), worker_group)
        else:
            result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._on_failure(worker_group, result)
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
        for their warm-up (:func:`~ftmem.launch.standby.idle_cores`), else once every rank is
        stepping, so that their imports do not slow this start (ranks that never report
        progress get them after :data:`STANDBY_FALLBACK_S`).
        """
        idle = self._standbys.idle
        if not self._standbys.enabled or (self._life.recovery is not None and not idle):
            return
        if len(self._standbys.standbys()) >= self._standbys.count * len(self._watch.procs):
            return
        latest = self._poller.latest()
        stepping = latest is not None and all_resumed(self._watch.procs, latest[1])
        if idle or stepping or time.time() - self._life.started_at > STANDBY_FALLBACK_S:
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
        if self._life.state is AgentState.STARTED and all_resumed(self._watch.procs, progress):
            self._resumed(progress)
        if self._guests:
            ex = self._poller.exchange()
            protected = ex[1].protected_step if ex is not None else None
            if protected is not None and protected > (self._reshard_step or 0):
                log.info(
                    "[%s] step %s is protected at the new size: stopping the guest SMPs",
                    self._node,
                    protected,
                )
                self._stop_guests()
        self._watch.check_hangs(progress, fetched)

    def _resumed(self, progress: dict[int, RankProgress]) -> None:
        """Every rank stepped: RUNNING; a recovery in progress is reported."""
        rec = self._life.resumed()
        if rec is None:
            return
        self._poller.set_fast(False)
        report_resumed(self._node, self.generation, rec, self._watch.procs, progress, self.events)

    # -- failures ---------------------------------------------------------------------------

    def _committed_now(self, ranks: list[int]) -> int | None:
        """The newest step every one of ``ranks`` committed (the SMP asked now if it runs)."""
        progress = self._poller.fetch() if self._smp.is_alive() else None
        if progress is None:
            latest = self._poller.latest()
            progress = latest[1] if latest is not None else {}
        return min_committed(ranks, progress)

    def _check_guard(self, committed: int | None) -> None:
        if self._life.check_guard(committed, self.restarts_left):
            self.stop_restarting()

    def _log_failure(
        self, rank: int | None, what: str, committed: int | None, stopped: list[int]
    ) -> None:
        restarts = (self.restarts_left, self.get_worker_group().spec.max_restarts)
        dead = not self._smp.is_alive()
        self._life.log_failure(rank, what, self.generation, committed, restarts, stopped, dead)

    def _on_failure(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """A rank failed (elastic's verdict; elastic has stopped the survivors by now)."""
        now = time.time()
        ranks = [w.global_rank for w in worker_group.workers]
        committed = self._committed_now(ranks)
        failures = sorted(result.failures.items(), key=lambda kv: kv[1].timestamp)
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
        rec = self._life.detected(kind, what, committed, stopped=now)
        self._check_guard(committed)
        stopped = [r for r, f in failures[1:] if f.exitcode == -signal.SIGTERM]
        self._log_failure(root_rank, what, committed, stopped)
        if root is not None:
            tail = tail_lines(self.rank_stderr_paths().get(root.local_rank))
            self._life.last_failure = (root_rank, what, tail)
        self.events.write(
            "failed",
            rank=root_rank,
            what=what,
            exitcode=None if root is None else root.exitcode,
            generation=self.generation,
            committed=committed,
            restarts_left=self.restarts_left,
            detected=round(rec.detected, 4),
            stop_s=round(now - rec.detected, 4),
        )
        self._poller.set_fast(True)

    def _on_smp_death(self, worker_group: WorkerGroup, exitcode: int) -> RunResult:
        pid = self._smp.pid or -1
        latest = self._poller.latest()
        ranks = [w.global_rank for w in worker_group.workers]
        committed = min_committed(ranks, latest[1]) if latest is not None else None
        why = describe_exit(exitcode)
        self.events.write(
            "smp_died", pid=pid, exitcode=exitcode, generation=self.generation, committed=committed
        )
        what = f"SMP pid {pid} died ({why})"
        return self._node_failure(
            FailureKind.SMP, ranks, what, f"the node's SMP died ({why})", committed, exitcode
        )

    def _exchange_failure(self) -> str | None:
        """The error that stopped the SMP's exchange thread during this generation, or None.

        Only a status fetched after these ranks started counts: the SMP replaces a failed
        exchange at the generation's PEER_BIND, so an older answer may predate that.
        """
        latest = self._poller.exchange() if self._life.watching else None
        if latest is None:
            return None
        fetched, status = latest
        if fetched <= self._life.started_at or status.state is not ExchangeState.FAILED:
            return None
        return status.error or "no error given"

    def _on_exchange_failure(self, worker_group: WorkerGroup, error: str) -> RunResult:
        """The exchange thread stopped: snapshots are no longer protected. Restart the ranks
        (from memory) with a new generation, whose PEER_BIND gives the SMP a new exchange."""
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
        return self._node_failure(FailureKind.EXCHANGE, ranks, what, what, committed, 1)

    def _node_failure(
        self,
        kind: FailureKind,
        ranks: list[int],
        what: str,
        message: str,
        committed: int | None,
        exitcode: int,
    ) -> RunResult:
        """A failure of the node's SMP side (not of a rank): account for it and have elastic
        restart the ranks (the result names the SMP as the failed process)."""
        pid = self._smp.pid or -1
        failure = ProcessFailure(local_rank=0, pid=pid, exitcode=exitcode, error_file="<N/A>")
        failure.message = f"{message}; see {self._smp.log_path}"
        self._life.detected(kind, what, committed)
        self._check_guard(committed)
        self._log_failure(None, what, committed, [])
        self._poller.set_fast(True)
        return RunResult(state=WorkerState.FAILED, failures={ranks[0]: failure})

    def report_last_failure(self) -> None:
        """Log why the agent gave up: the guard's reason and the failing rank's last lines."""
        self._life.report_last_failure()


def _a_rank_failed(pcontext: Any) -> bool:
    """A rank of ``pcontext`` exited with an error (elastic will report a failure)."""
    return any(h.proc.poll() not in (None, 0) for h in live_handlers(pcontext).values())


def _peer_settings(ft: FtmemLaunchConfig, run_id: str) -> PeerSettings:
    """The peer mesh's settings from the launcher's flags. Without a key file (and without
    ``--ftmem-insecure-mesh``) the mesh is on this host only (``check_mesh_key``): its key is
    then shared through a private file of this host, never through the store."""
    host_local = ft.key_file is None and not ft.insecure_mesh
    return PeerSettings(
        parity=ft.ec_parity,
        max_group=ft.ec_group_size,
        key_file=ft.key_file,
        host_key=host_key_path(run_id) if host_local else None,
        host=ft.peer_host or "127.0.0.1",
        interval_s=ft.ec_interval.total_seconds(),
        rebuild_timeout=ft.rebuild_timeout,
        encrypt=ft.ec_encrypt,
        encode_workers=ft.ec_encode_workers,
    )
