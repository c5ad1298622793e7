"""Checkpointer: per-step snapshots of a training state into the node's SMP, and restore.

    ckpt = Checkpointer()
    step = ckpt.load(state)            # agreed over the default process group; 0 = fresh
    for step in range(step, total):
        train_one_step()
        ckpt.save(state, step=step + 1)  # returns at once; the copy runs in the background

``save`` copies module buffers and small objects eagerly, queues the rest (parameters and
optimizer state, which only ``optimizer.step()`` changes) for the background copy, and
registers a step pre-hook on every optimizer in the state: the fence that waits for the
copy before the optimizer changes those tensors. The rank only moves bytes: the SMP
checksums each committed snapshot. What a save plans (the sharding split, the layout, which
tensors are copied lazily, the slot's views) is cached by the state's signature, so a save
whose state did not change shape costs the state walk, one IPC round trip and the copies.

The newest step passed to ``save`` is never lost silently: when it was skipped (no free
slot, slots still being allocated, the previous copy still running), ``wait()``,
``close()`` and interpreter exit save it again, waiting (bounded, logged) for a slot, as
long as the optimizer has not changed the state since.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ftmem._logging import get_logger
from ftmem.client import agreement
from ftmem.client.flatten import (
    Flat,
    Layout,
    flatten_state,
    plan_layout,
    shard_replicated,
    signature_of,
)
from ftmem.client.loading import SnapshotLoader
from ftmem.client.staging import (
    CopyJob,
    CopyWorker,
    PrepareJob,
    SkipNotice,
    copy_into,
    register_pinned,
    slot_views,
    start_cuda_copies,
    unregister_pinned,
)
from ftmem.config import ClientConfig
from ftmem.errors import (
    FtmemError,
)
from ftmem.format.tensors import encode_skeleton
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.shm import MappedSegment

log = get_logger(__name__)


@dataclass(frozen=True, eq=False)
class _SavePlan:
    """What a save of a state of one signature does (cached while the signature and the
    tensors' storages stay the same)."""

    key: tuple[Any, ...]
    layout: Layout
    eager: list[int]
    """CPU tensors copied inside ``save`` (buffers, RNG, anything the forward may change)."""
    lazy: list[int]
    """CPU tensors only the optimizers change: copied by the worker, largest first."""
    cuda: list[int]
    """Device tensors the optimizers do not own (buffers...): copied first by a side stream,
    which the current stream then waits for (on the device)."""
    cuda_lazy: list[int]
    """Device tensors only the optimizers change: copied next by the side stream, fenced by
    the optimizer pre-hook."""


@dataclass
class _Pending:
    """The newest step passed to ``save`` when it was skipped."""

    state: Mapping[str, Any]
    step: int
    replicated_over: Any
    reason: str


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
        self._segments: dict[str, MappedSegment] = {}
        self._plan: _SavePlan | None = None
        self._views: dict[int, tuple[Layout, list[torch.Tensor]]] = {}
        """id of a slot mapping -> (the layout, that slot's views of every tensor); dropped
        when the mapping is closed (holding the layout keeps its identity unique)."""
        self._replicated: tuple[Any, list[int], list[tuple[int, int]]] | None = None
        """(signature and group, the replicated tensors' indices, their data pointers)."""
        self._preparing: PrepareJob | None = None
        self._pending: _Pending | None = None
        self._changed = False
        """The optimizer stepped since the newest save (its state is not that step's)."""
        self._seg_lock = threading.Lock()
        self._job: CopyJob | None = None
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hooks: list[Any] = []
        self._skipped = 0
        self._last_save_s = 0.0
        self._last_fence_s = 0.0
        self._closed = False
        self._optimizers: list[torch.optim.Optimizer] = []
        self._group: Any = None
        self._hsdp_group: Any = None
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
            info = client.request(
                m.Hello(
                    rank=self.rank,
                    pid=os.getpid(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    world_size=agreement.current_world_size(),
                )
            )
            self._shm_dir = Path(str(info.get("shm_dir", "/dev/shm")))
            self._client = client
            self._worker = CopyWorker(self.config.run_dir, self.config.request_timeout)
        return self._client

    def _segment(self, path: str, capacity: int) -> MappedSegment:
        with self._seg_lock:
            seg = self._segments.get(path)
            if seg is None or seg.nbytes != capacity:
                seg = MappedSegment(Path(path), capacity, self._shm_dir)
                self._segments[path] = seg
                # Forget mappings of files the SMP replaced (one live file per slot).
                for old in [p for p in self._segments if p != path and not os.path.exists(p)]:
                    gone = self._segments.pop(old)
                    self._views.pop(id(gone), None)
                    unregister_pinned(gone)
                    gone.close()
            return seg

    def _map_new_slots(self, slots: list[dict[str, Any]]) -> None:
        """Map (and populate the page tables of) slots the SMP just made (copy thread)."""
        for slot in slots:
            self._segment(str(slot["path"]), int(slot["capacity"]))

    # -- save ------------------------------------------------------------------------------
    def save(
        self, state: Mapping[str, Any], step: int, *, replicated_over: Any = None
    ) -> SnapshotHandle:
        """Snapshot ``state`` as ``step``; return at once with a handle.

        The snapshot is skipped (counted, reported to the SMP with its reason, never waited
        for) when the previous copy is still running, the SMP has no free slot, or the
        rank's slots are still being allocated (the first save: they are allocated and
        pre-faulted off the training thread). If this newest step stays skipped,
        :meth:`wait` and :meth:`close` save it again, waiting for a slot.

        ``replicated_over``: a process group over which the parameters of the modules in
        ``state`` and their optimizer state are the same on every rank (data parallelism);
        found by itself when ``state`` holds a DDP module. Each rank then saves only its
        share of those bytes (``ClientConfig.shard_replicated``, FTMEM_SHARD=0 turns it off);
        ``load`` gathers them back.

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
        """One save; ``deadline`` (monotonic) set: the final save, which waits for the
        previous copy, the allocation and a free slot instead of skipping."""
        t0 = time.perf_counter()
        final = deadline is not None
        client = self._connect()
        # The fence first, also when this save is skipped: an optimizer step after a skipped
        # save must mark the state changed (a final save of that step would be stale).
        self._hook_optimizers(state)
        prev = self._job
        if prev is not None and not prev.finished.is_set():
            if not prev.copied.is_set() and not final:
                return self._skip(step, "the previous copy is still running", t0, tell=True)
            # The copy is done and only the SMP's ack of its COMMIT is in flight (one IPC round
            # trip), or this is the final save. Wait rather than skip: ranks that skip
            # different steps can end up with no step in common.
            prev.finished.wait(self._left(deadline, self.config.request_timeout))
        preparing = self._preparing
        if preparing is not None and not preparing.done.is_set():
            if not final:
                return self._skip(step, "slots are being allocated", t0, tell=True)
            preparing.done.wait(self._left(deadline, self.config.prepare_timeout))
        whole = flatten_state(state)
        flat = self._shard(state, whole, replicated_over)
        plan = self._save_plan(flat)
        objects = encode_skeleton(flat.skeleton)
        total = max(1, plan.layout.tensors_end + len(objects))
        while True:
            decision = client.request(m.Begin(rank=self.rank, step=step, nbytes=total, final=final))
            action = decision["action"]
            if action == "write":
                break
            if action == "resize":
                prep = self._prepare_ahead(total)
                if not final:
                    return self._skip(step, "slots are being allocated", t0, tell=True)
                prep.done.wait(self._left(deadline, self.config.prepare_timeout))
                if prep.error is not None or not prep.done.is_set():
                    return self._skip(step, f"slots could not be allocated: {prep.error}", t0)
                continue
            reason = str(decision.get("reason", action))
            if not final:
                return self._skip(step, reason, t0)
            assert deadline is not None
            if time.monotonic() >= deadline:
                return self._skip(step, reason, t0, tell=True)
            time.sleep(0.05)  # a flush or a protection round holds the slots: bounded poll
        seg = self._segment(str(decision["path"]), int(decision["capacity"]))
        job = self._stage(
            flat, plan, objects, seg, step, int(decision["slot"]), int(decision["gen"])
        )
        job.stall_s = self._last_save_s = time.perf_counter() - t0
        job.skipped = self._skipped
        if flat is not whole:
            job.unsharded_nbytes = sum(t.nbytes for t in whole.tensors) + len(objects)
        self._job = job
        assert self._worker is not None
        self._worker.submit(job)
        return SnapshotHandle(step=step, skipped=False, _job=job)

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
        want = int(nbytes * (1 + self.config.arena_headroom)) + 1
        job = PrepareJob(self.rank, want, self.config.prepare_timeout, self._map_new_slots)
        self._preparing = job
        log.info("allocating snapshot slots of %.1f MiB in the background", want / 2**20)
        assert self._worker is not None
        self._worker.submit(job)
        return job

    def _save_plan(self, flat: Flat) -> _SavePlan:
        """The cached plan of a save (layout, eager / lazy / device tensors).

        Reused while the state's signature is the same and the tensors it copies lazily are
        still the same storages (other tensors, e.g. a fresh RNG state each save, may be new
        objects every time: they are copied eagerly wherever they live)."""
        sig = signature_of(flat)
        plan = self._plan
        tensors = flat.tensors
        if (
            plan is not None
            and plan.key[0] == sig
            and all(
                tensors[i].data_ptr() == p
                for i, p in zip(plan.lazy + plan.cuda_lazy, plan.key[1], strict=True)
            )
        ):
            return plan
        layout = plan.layout if plan is not None and plan.key[0] == sig else plan_layout(flat)
        lazy_ptrs = _optimizer_storage_ptrs(self._optimizers)  # found by _hook_optimizers
        eager: list[int] = []
        lazy: list[int] = []
        cuda: list[int] = []
        cuda_lazy: list[int] = []
        for i, t in enumerate(tensors):
            owned = bool(lazy_ptrs) and t.untyped_storage().data_ptr() in lazy_ptrs
            if t.device.type != "cpu":
                (cuda_lazy if owned else cuda).append(i)
            elif owned:
                lazy.append(i)
            else:  # buffers, RNG, anything the forward pass or the user may change
                eager.append(i)
        lazy.sort(key=lambda i: -tensors[i].nbytes)
        key = (sig, tuple(tensors[i].data_ptr() for i in lazy + cuda_lazy))
        self._plan = _SavePlan(key, layout, eager, lazy, cuda, cuda_lazy)
        return self._plan

    def _replica_group(self, state: Mapping[str, Any], given: Any) -> Any:
        """The group the state is replicated over (None: not replicated / not distributed)."""
        if not agreement.distributed():
            return None
        if given is not None:
            return given
        from torch.nn.parallel import DistributedDataParallel

        for v in _walk_values(state):
            if isinstance(v, DistributedDataParallel):
                return v.process_group
        return None

    def _shard(self, state: Mapping[str, Any], flat: Flat, given: Any) -> Flat:
        """Keep only this replica's share of the replicated tensors (see :meth:`save`)."""
        if not self.config.shard_replicated or not agreement.distributed():
            return flat
        group = self._replica_group(state, given)
        if group is None:
            return self._shard_hsdp(flat)
        size = torch.distributed.get_world_size(group)
        if size < 2:
            return flat
        # Cached while the signature, the group and the replicated tensors' storages stay
        # the same (other tensors, e.g. a fresh RNG state each save, may be new objects).
        sig = signature_of(flat)
        cached = self._replicated
        if not (
            cached is not None
            and cached[0] == (sig, id(group))
            and all(flat.tensors[i].data_ptr() == p for i, p in cached[2])
        ):
            ptrs = _replicated_storage_ptrs(state)
            chunks = flat.chunks or [None] * len(flat.tensors)
            found = [
                i
                for i, t in enumerate(flat.tensors)
                if chunks[i] is None and t.untyped_storage().data_ptr() in ptrs
            ]
            cached = ((sig, id(group)), found, [(i, flat.tensors[i].data_ptr()) for i in found])
            self._replicated = cached
        replicated = cached[1]
        if not replicated:
            return flat
        return shard_replicated(flat, replicated, size, torch.distributed.get_rank(group))

    def _shard_hsdp(self, flat: Flat) -> Flat:
        """DTensors replicated along a mesh dimension (HSDP's replicate dimension): each
        replica of that dimension keeps 1/R of their local shards."""
        groups = flat.replica_groups or [None] * len(flat.tensors)
        group = next((g for g in groups if g is not None), None)
        if group is None:
            return flat
        size = torch.distributed.get_world_size(group)
        replicated = [i for i, g in enumerate(groups) if g is group]
        self._hsdp_group = group
        return shard_replicated(flat, replicated, size, torch.distributed.get_rank(group))

    def _skip(self, step: int, reason: str, t0: float, tell: bool = False) -> SnapshotHandle:
        """Count a skipped snapshot; ``tell``: the SMP did not refuse it itself, so the copy
        thread reports it (the SMP counts skips per rank and reason)."""
        self._skipped += 1
        self._last_save_s = time.perf_counter() - t0
        log.debug("snapshot of step %d skipped: %s", step, reason)
        if tell and self._worker is not None:
            self._worker.submit(SkipNotice(self.rank, step, reason))
        return SnapshotHandle(step=step, skipped=True, reason=reason)

    def _stage(
        self,
        flat: Flat,
        plan: _SavePlan,
        objects: bytes,
        seg: MappedSegment,
        step: int,
        slot: int,
        gen: int,
    ) -> CopyJob:
        """Copy the eager part now; return the job that copies the rest in the background."""
        off = plan.layout.tensors_end
        seg.view[off : off + len(objects)] = objects
        cached = self._views.get(id(seg))
        if cached is None or cached[0] is not plan.layout:
            cached = self._views[id(seg)] = (plan.layout, slot_views(seg, plan.layout))
        views = cached[1]
        tensors = flat.tensors
        copy_into([views[i] for i in plan.eager], [tensors[i] for i in plan.eager])
        job = CopyJob(
            rank=self.rank,
            step=step,
            slot=slot,
            gen=gen,
            seg=seg,
            layout=plan.layout,
            dsts=[views[i] for i in plan.lazy],
            srcs=[tensors[i] for i in plan.lazy],
            objects=(off, len(objects)),
        )
        if plan.cuda or plan.cuda_lazy:
            register_pinned(seg)
            job.cuda_event = start_cuda_copies(
                ([views[i] for i in plan.cuda], [tensors[i] for i in plan.cuda]),
                ([views[i] for i in plan.cuda_lazy], [tensors[i] for i in plan.cuda_lazy]),
            )
        return job

    # -- the fence -------------------------------------------------------------------------
    def _hook_optimizers(self, state: Mapping[str, Any]) -> None:
        found = [v for v in _walk_values(state) if isinstance(v, torch.optim.Optimizer)]
        self._optimizers = found
        for opt in found:
            if opt not in self._hooked:
                self._hooks.append(opt.register_step_pre_hook(self._fence_hook))
                self._hooked.add(opt)

    def _fence_hook(self, *_: Any) -> None:
        t0 = time.perf_counter()
        self._changed = True
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
        """Wait for the pending snapshot's copy and commit; True if one was committed.

        If the newest step passed to :meth:`save` was skipped and the optimizer has not
        changed the state since, save it now, waiting (at most
        ``ClientConfig.final_save_timeout``) for a slot: the last step is never lost.
        """
        self._save_skipped_newest()
        job = self._job
        if job is None:
            return False
        return SnapshotHandle(job.step, False, _job=job).wait(timeout)

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
        self._group = self._replica_group(state, replicated_over)
        if self._group is None and agreement.distributed():
            # HSDP: DTensors replicated along a mesh dimension gather over its group.
            groups = flatten_state(state).replica_groups
            self._group = next((g for g in groups if g is not None), None)
        self.wait_quietly()
        client = self._connect()
        loader = SnapshotLoader(
            rank=self.rank,
            client=client,
            segment=self._segment,
            group=self._group,
            flush_dirs=self.config.flush_dirs,
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
        self._views.clear()
        for seg in self._segments.values():
            unregister_pinned(seg)
            seg.close()
        self._segments.clear()


def _walk_values(obj: Any) -> list[Any]:
    out = []
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        else:
            out.append(v)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    """The data pointer of a tensor's storage (a DTensor's: its local shard's)."""
    local = getattr(t, "_local_tensor", None)
    return int((local if isinstance(local, torch.Tensor) else t).untyped_storage().data_ptr())


def _optimizer_storage_ptrs(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages that only the optimizers mutate: their parameters and their state tensors."""
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(_storage_ptr(p))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(_storage_ptr(v))
    return ptrs


def _replicated_storage_ptrs(state: Mapping[str, Any]) -> set[int]:
    """Storages replicated under data parallelism: the (plain) parameters of the modules in
    ``state`` and the optimizer state of those parameters. Buffers (BatchNorm statistics...)
    are per rank: each rank's forward updates its own."""
    values = _walk_values(state)
    params: dict[int, torch.Tensor] = {}
    for mod in (v for v in values if isinstance(v, torch.nn.Module)):
        for p in mod.parameters():
            if type(p) in (torch.Tensor, torch.nn.Parameter):
                params[id(p)] = p
    ptrs = {_storage_ptr(p) for p in params.values()}
    for opt in (v for v in values if isinstance(v, torch.optim.Optimizer)):
        for param, st in opt.state.items():
            if id(param) in params:
                ptrs.update(_storage_ptr(v) for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs
