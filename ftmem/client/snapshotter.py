"""Checkpointer: per-step snapshots of a training state into the node's SMP, and restore.

    ckpt = Checkpointer()
    step = ckpt.load(state)            # agreed over the default process group; 0 = fresh
    for step in range(step, total):
        train_one_step()
        ckpt.save(state, step=step + 1)  # returns at once; the copy runs in the background

``save`` copies buffers and small objects eagerly, queues the parameters and optimizer state
(which only ``optimizer.step()`` changes) for the background copy, and registers a step
pre-hook on every optimizer in the state: the fence that waits for that copy. What a save
plans is cached (:mod:`ftmem.client.planner`). A skipped newest step is saved again by
``wait()``, ``close()`` and interpreter exit (bounded, logged) unless the optimizer has changed
the state since.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ftmem._logging import get_logger
from ftmem.client import agreement, pitfalls
from ftmem.client.loading import SnapshotLoader
from ftmem.client.planner import CopyPlanner, gather_group, optimizers_in
from ftmem.client.slot_maps import SlotMappings, stage
from ftmem.client.staging import CopyJob, CopyWorker, PrepareJob, SkipNotice
from ftmem.config import ClientConfig
from ftmem.errors import FtmemError
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient

log = get_logger(__name__)

PREMAP_WAIT_S = 0.05
"""How long a save waits for the copy thread to map a newly granted slot of at most
``PREMAP_WAIT_MAX_BYTES`` (a larger one takes longer than a save could wait) before it skips."""
PREMAP_WAIT_MAX_BYTES = 1 << 30


@dataclass
class _Pending:
    """The newest step passed to ``save`` when it was skipped."""

    state: Mapping[str, Any]
    step: int
    replicated_over: Any
    reason: str


@dataclass(frozen=True)
class _Refusal:
    """Why the SMP gave no slot to a save; ``tell``: the SMP did not refuse it itself (or
    does not know it gave up), so the copy thread reports the skip."""

    reason: str
    tell: bool = False


@dataclass
class SnapshotHandle:
    """The result of one :meth:`Checkpointer.save`: skipped, or a copy that will commit."""

    step: int
    skipped: bool
    reason: str = ""
    _job: CopyJob | None = None

    def done(self) -> bool:
        """True once the snapshot is committed, failed, or was skipped."""
        return self._job is None or self._job.finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the copy and the commit; return True if committed, False if skipped.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            FtmemError: the copy or the commit failed.
        """
        if self._job is None:
            return False
        if not self._job.finished.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not committed within {timeout} s")
        if self._job.error is not None:
            raise FtmemError(f"snapshot of step {self.step} failed: {self._job.error}")
        return True


class Checkpointer:
    """Takes snapshots of a state into the node's SMP and restores them.

    Resource handling: connects lazily; :meth:`close` (idempotent, also at interpreter
    exit) waits (bounded) for the pending commit, stops the copy thread and closes sockets.

    Error handling: :class:`SmpUnavailableError` when the SMP does not answer within the
    configured timeout (sooner when its process is gone); load raises
    :class:`InconsistentSnapshotError`, :class:`SnapshotMismatchError` or
    :class:`CorruptSnapshotError` rather than restore something wrong.
    """

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._client: SmpClient | None = None
        self._worker: CopyWorker | None = None
        self._rank: int | None = None
        self._slots = SlotMappings()
        self._planner = CopyPlanner(shard=self.config.shard_replicated)
        self._preparing: PrepareJob | None = None
        self._pending: _Pending | None = None
        self._changed = False
        """The optimizer stepped since the newest save (its state is not that step's)."""
        self._job: CopyJob | None = None
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hooks: list[Any] = []
        self._skipped = 0
        self._last_save_s = 0.0
        self._last_fence_s = 0.0
        self._closed = False
        self._optimizers: list[torch.optim.Optimizer] = []
        self._in_process = False
        atexit.register(self.close)

    # -- connection ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank."""
        if self._rank is None:
            self._rank = agreement.current_rank()
        return self._rank

    def _connect(self) -> SmpClient:
        if self._client is None:
            client = SmpClient(self.config.run_dir, self.config.request_timeout)
            info = client.call(self._hello())
            self._slots.shm_dir = Path(info.shm_dir)
            self._client = client
            self._worker = CopyWorker(self.config.run_dir, self.config.request_timeout)
        return self._client

    def _hello(self, rejoined: bool = False) -> m.Hello:
        return m.Hello(
            rank=self.rank,
            pid=os.getpid(),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=agreement.current_world_size(),
            in_process=self._in_process,
            rejoined=rejoined,
        )

    def announce_in_process(self) -> None:
        """Tell the SMP that this rank runs under :func:`ftmem.run`: ftmem-launch keeps it
        alive at a restart and hands it the next generation (see ``ftmem.client.in_process``)."""
        self._in_process = True
        if self._client is None:
            self._connect()
        else:
            self._client.request(self._hello())

    def leave_generation(self) -> None:
        """A peer failed and this process rejoins in process: wait (bounded) for the pending
        snapshot and drop everything tied to the old process group (a skipped step's retry,
        the group and the replica sharding cache, the rank), so the group can be freed."""
        self.wait_quietly()
        self._drop_grant()
        self._pending = None
        self._changed = False
        self._planner.forget_group()
        self._rank = None

    def rejoined(self) -> None:
        """This process joined a new generation in process: say hello again, so the SMP and
        the agent time this restart from now (call after :meth:`leave_generation`)."""
        self._connect().request(self._hello(rejoined=True))

    # -- save ------------------------------------------------------------------------------
    def save(
        self, state: Mapping[str, Any], step: int, *, replicated_over: Any = None
    ) -> SnapshotHandle:
        """Snapshot ``state`` as ``step``; return at once with a handle.

        The snapshot is skipped (counted, reported to the SMP with its reason, never waited
        for) when the previous copy is still running, the SMP has no free slot, or the
        rank's slots are still being allocated off the training thread (the first save). If
        this newest step stays skipped, :meth:`wait` and :meth:`close` save it again.

        ``replicated_over``: a process group over which the modules' parameters and their
        optimizer state are the same on every rank (found by itself for a DDP module): each
        rank saves only its share (``ClientConfig.shard_replicated``); ``load`` gathers it.

        Raises:
            ValueError: bad step or a state that cannot be snapshotted.
            SmpUnavailableError: the SMP is gone or does not answer.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        handle = self._save(state, step, replicated_over, deadline=None)
        self._changed = False
        if handle.skipped:
            self._pending = _Pending(state, step, replicated_over, handle.reason)
        else:
            self._pending = None
        return handle

    def _save(
        self,
        state: Mapping[str, Any],
        step: int,
        replicated_over: Any,
        deadline: float | None,
    ) -> SnapshotHandle:
        """One save; ``deadline`` (monotonic) set: the final save, which waits instead of
        skipping."""
        t0 = time.perf_counter()
        client = self._connect()
        # The fence first, also when this save is skipped: an optimizer step after a skipped
        # save must mark the state changed (a final save of that step would be stale).
        self._hook_optimizers(state)
        busy = self._wait_busy(deadline)
        if busy is not None:
            return self._skip(step, busy, t0, tell=True)
        read = self._planner.read_state(state, self._optimizers, replicated_over)
        flat, plan, objects, unsharded = read.flat, read.plan, read.objects, read.unsharded
        total = max(1, plan.layout.tensors_end + len(objects))
        decision = self._take_grant(total, deadline is not None)
        if isinstance(decision, m.BeginReply):
            client.check_alive()
        elif decision is None:
            decision = self._begin(client, step, total, deadline)
        if isinstance(decision, _Refusal):
            return self._skip(step, decision.reason, t0, tell=decision.tell)
        seg = self._slots.segment(decision.path, decision.capacity)
        job = stage(
            flat,
            plan,
            objects,
            seg,
            self._slots.views(seg, plan.layout),
            rank=self.rank,
            step=step,
            slot=decision.slot,
            gen=decision.gen,
        )
        job.next_nbytes = total
        job.premap = self._slots.prepare
        job.stall_s = self._last_save_s = time.perf_counter() - t0
        job.skipped = self._skipped
        if unsharded:
            job.unsharded_nbytes = unsharded + len(objects)
        self._job = job
        assert self._worker is not None
        self._worker.submit(job)
        return SnapshotHandle(step=step, skipped=False, _job=job)

    def _wait_busy(self, deadline: float | None) -> str | None:
        """Why a save must skip because this rank is busy (None: it may go on).

        The final save (``deadline`` set) waits instead, for the previous copy and commit
        and for a slot allocation in progress. An ordinary save also waits when the
        previous copy is done and only the SMP's ack of its COMMIT is in flight (one IPC
        round trip): ranks that skip different steps can end up with no step in common.
        """
        final = deadline is not None
        prev = self._job
        if prev is not None and not prev.finished.is_set():
            if not prev.copied.is_set() and not final:
                return "the previous copy is still running"
            prev.finished.wait(self._left(deadline, self.config.request_timeout))
        preparing = self._preparing
        if preparing is not None and not preparing.done.is_set():
            if not final:
                return "slots are being allocated"
            preparing.done.wait(self._left(deadline, self.config.prepare_timeout))
        return None

    def _take_grant(self, total: int, final: bool) -> m.BeginReply | _Refusal | None:
        """The slot the SMP granted to this save with the previous COMMIT's reply, if it
        holds ``total`` bytes and, if conditional, the SMP's grant board says it is ready
        (None: the save asks with a BEGIN, which also gives the grant back). Each grant
        serves one save. The copy thread maps a new slot file after the COMMIT; a save that
        comes sooner waits at most ``PREMAP_WAIT_S`` and is otherwise skipped, keeping the
        grant (``final``: the last save waits)."""
        job = self._job
        if job is None or not job.finished.is_set() or job.grant is None:
            return None
        grant, job.grant = job.grant, None
        if grant.action is not m.Decision.WRITE or grant.capacity < total:
            return None
        if not self._slots.grant_ready(grant):
            return None  # conditional and not (yet) settled: the BEGIN gives it back
        if final:
            wait = self.config.request_timeout.total_seconds()
        else:
            wait = PREMAP_WAIT_S if grant.capacity <= PREMAP_WAIT_MAX_BYTES else 0.0
        if not job.premapped.wait(wait):
            job.grant = grant
            return _Refusal("a new slot is being mapped", tell=True)
        return grant

    def _drop_grant(self) -> None:
        """Forget the grant for the next save (a new generation: the next save asks)."""
        if self._job is not None:
            self._job.grant = None

    def _begin(
        self, client: SmpClient, step: int, total: int, deadline: float | None
    ) -> m.BeginReply | _Refusal:
        """Ask the SMP for a slot of ``total`` bytes: its ``write`` decision, or why not.

        The final save (``deadline`` set) waits for the slots' allocation and polls
        (bounded) while a flush or a protection round holds the slots."""
        final = deadline is not None
        while True:
            decision = client.call(m.Begin(rank=self.rank, step=step, nbytes=total, final=final))
            if decision.action is m.Decision.WRITE:
                return decision
            if decision.action is m.Decision.RESIZE:
                prep = self._prepare_ahead(total)
                if not final:
                    return _Refusal("slots are being allocated", tell=True)
                prep.done.wait(self._left(deadline, self.config.prepare_timeout))
                if prep.error is not None or not prep.done.is_set():
                    return _Refusal(f"slots could not be allocated: {prep.error}")
                continue
            reason = decision.reason or decision.action.value
            if not final:
                return _Refusal(reason)
            assert deadline is not None
            if time.monotonic() >= deadline:
                return _Refusal(reason, tell=True)
            time.sleep(0.05)  # a flush or a protection round holds the slots: bounded poll

    @staticmethod
    def _left(deadline: float | None, default: timedelta) -> float:
        if deadline is None:
            return default.total_seconds()
        return max(0.0, deadline - time.monotonic())

    def _prepare_ahead(self, nbytes: int) -> PrepareJob:
        """Have the SMP grow this rank's free slots (allocated and pre-faulted by the SMP,
        mapped by the copy thread): off the training thread; saves skip until it is done."""
        job = self._preparing
        if job is not None and not job.done.is_set():
            return job
        if job is not None and job.error is not None:
            pitfalls.warn_once("prepare", f"snapshots are skipped: {job.error}")
        want = int(nbytes * (1 + self.config.arena_headroom)) + 1
        job = PrepareJob(self.rank, want, self.config.prepare_timeout, self._slots.map_new)
        self._preparing = job
        log.info("allocating snapshot slots of %.1f MiB in the background", want / 2**20)
        assert self._worker is not None
        self._worker.submit(job)
        return job

    def _skip(self, step: int, reason: str, t0: float, tell: bool = False) -> SnapshotHandle:
        """Count a skipped snapshot; ``tell``: the SMP did not refuse it itself, so the copy
        thread reports it (the SMP counts skips per rank and reason)."""
        self._skipped += 1
        self._last_save_s = time.perf_counter() - t0
        log.debug("snapshot of step %d skipped: %s", step, reason)
        if tell and self._worker is not None:
            self._worker.submit(SkipNotice(self.rank, step, reason))
        return SnapshotHandle(step=step, skipped=True, reason=reason)

    # -- the fence -------------------------------------------------------------------------
    def _hook_optimizers(self, state: Mapping[str, Any]) -> None:
        found = optimizers_in(state)
        self._optimizers = found
        for opt in found:
            if opt not in self._hooked:
                self._hooks.append(opt.register_step_pre_hook(self._fence_hook))
                self._hooked.add(opt)

    def _fence_hook(
        self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The optimizer is about to step: wait for the copy first. A step given a closure
        (Lightning, LBFGS) runs it, forward and backward, before it changes anything: the
        wait then moves to the closure's end, so the copy overlaps the forward and backward."""
        self._changed = True
        closure = kwargs["closure"] if "closure" in kwargs else (args[0] if args else None)
        if not callable(closure):
            self._fence()
            return None

        def fenced() -> Any:
            try:
                return closure()
            finally:
                self._fence()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": fenced}
        return (fenced, *args[1:]), kwargs

    def _fence(self) -> None:
        t0 = time.perf_counter()
        job = self._job
        if job is not None and not job.copied.is_set():
            limit = self.config.fence_timeout.total_seconds()
            if not job.copied.wait(limit):
                # The optimizer is about to change the sources: this snapshot must not commit.
                job.cancelled = True
                log.error(
                    "copy of step %d not done after %.0f s at the fence; abandoning it",
                    job.step,
                    limit,
                )
        self._last_fence_s = time.perf_counter() - t0
        if job is not None and job.error is not None:
            log.error("snapshot of step %d failed; training goes on: %s", job.step, job.error)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the pending snapshot's copy and commit; True if one was committed. It
        also waits (within ``timeout``) for the copy thread to map the slot the commit granted,
        so that the next :meth:`save` finds it ready instead of skipping.

        If the newest step passed to :meth:`save` was skipped and the optimizer has not
        changed the state since, save it now, waiting (at most
        ``ClientConfig.final_save_timeout``) for a slot: the last step is never lost.
        """
        self._save_skipped_newest()
        job = self._job
        if job is None:
            return False
        start = time.monotonic()
        committed = SnapshotHandle(job.step, False, _job=job).wait(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        job.premapped.wait(left)
        return committed

    def _save_skipped_newest(self) -> None:
        """Commit the newest step passed to save if it was skipped (see :meth:`wait`)."""
        pending, self._pending = self._pending, None
        if pending is None or self._closed:
            return
        if self._changed:
            log.warning(
                "the newest snapshot (step %d) was skipped (%s) and the state has changed since: "
                "it is not committed",
                pending.step,
                pending.reason,
            )
            return
        limit = self.config.final_save_timeout.total_seconds()
        log.info(
            "snapshot of step %d was skipped (%s); saving it again, waiting up to %.0f s for a slot",
            pending.step,
            pending.reason,
            limit,
        )
        handle = self._save(
            pending.state, pending.step, pending.replicated_over, time.monotonic() + limit
        )
        if handle.skipped:
            log.error(
                "the final snapshot of step %d is not committed: %s", pending.step, handle.reason
            )

    def heartbeat(self, step: int = 0) -> None:
        """Tell the SMP that training makes progress (used for hang detection)."""
        self._connect().request(m.Heartbeat(rank=self.rank, step=step))

    def stats(self) -> dict[str, Any]:
        """Figures of the last snapshot: stall (save + fence), copy time, skips."""
        job = self._job
        return {
            "last_save_s": self._last_save_s,
            "last_fence_s": self._last_fence_s,
            "last_stall_s": self._last_save_s + self._last_fence_s,
            "last_copy_s": job.copy_s if job is not None else 0.0,
            "last_step": job.step if job is not None else None,
            "skipped": self._skipped,
        }

    # -- load ------------------------------------------------------------------------------
    def load(
        self,
        state: MutableMapping[str, Any],
        *,
        allow_fresh_start: bool | None = None,
        replicated_over: Any = None,
    ) -> int:
        """Restore the newest step every rank holds (in place); return it, or 0 if none.

        All ranks of the default process group must call this together. Memory first; when
        memory cannot serve every rank, the newest flushed checkpoint every rank can read
        (:class:`~ftmem.client.loading.SnapshotLoader` says how the ranks agree).

        Raises:
            InconsistentSnapshotError: some ranks hold snapshots and others none (unless
                fresh starts are allowed), or no step is common to all ranks.
            CorruptSnapshotError: no common step passes its checksums on every rank.
            SnapshotMismatchError: the snapshot does not fit ``state``.
        """
        allow = self.config.allow_fresh_start if allow_fresh_start is None else allow_fresh_start
        group = gather_group(state, replicated_over)
        self.wait_quietly()
        self._drop_grant()
        client = self._connect()
        loader = SnapshotLoader(
            rank=self.rank,
            client=client,
            segment=self._slots.segment,
            group=group,
            flush_dirs=self.config.flush_dirs,
            run_dir=self.config.run_dir,
        )
        return loader.load(state, allow_fresh_start=allow)

    # -- shutdown --------------------------------------------------------------------------
    def wait_quietly(self, timeout: float | None = None) -> None:
        """Wait for a pending commit, logging (not raising) a failure."""
        job = self._job
        if job is not None:
            limit = timeout if timeout is not None else self.config.request_timeout.total_seconds()
            if not job.finished.wait(limit):
                log.warning("snapshot of step %d still pending after %.0f s", job.step, limit)
            elif job.error is not None:
                log.warning("snapshot of step %d failed: %s", job.step, job.error)

    def close(self) -> None:
        """Finish the pending commit (bounded), stop the copy thread, close the socket."""
        if self._closed:
            return
        try:
            self._save_skipped_newest()
        except Exception as exc:  # at exit: report, never raise out of close
            log.error("the final snapshot could not be saved: %s", exc)
        self._closed = True
        atexit.unregister(self.close)
        self.wait_quietly()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._worker is not None:
            self._worker.close()
        if self._client is not None:
            self._client.close()
        self._job = None
        self._slots.close()
