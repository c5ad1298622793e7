"""SnapshotLoader: which step every rank restores, and the restore itself (memory, then disk).

A :class:`~ftmem.client.snapshotter.Checkpointer` makes one per ``load``. The ranks agree
on every decision over the default process group (:mod:`ftmem.client.agreement`): the
newest step every rank holds, then whether every rank could check it, so either all ranks
restore the same step or none restores anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ftmem._logging import get_logger
from ftmem.client import agreement, checkfree, reshard
from ftmem.client.flatten import parse_layout
from ftmem.client.restore import (
    RestorePlan,
    apply_restore,
    copy_verified,
    finish_restore,
    plan_restore,
    restore_threads,
)
from ftmem.config import ENV_EXPECTED_STEP, GUEST_DIR_PREFIX, SOCKET_NAME
from ftmem.errors import (
    CorruptSnapshotError,
    InconsistentSnapshotError,
    SnapshotMismatchError,
    UnsafePathError,
)
from ftmem.format.tensors import REPLICAS_KEY, decode_skeleton, read_objects
from ftmem.protocol import messages as m
from ftmem.protocol import rejoin
from ftmem.protocol.smp_client import SmpClient
from ftmem.shm import MappedSegment

log = get_logger(__name__)

_OK, _CORRUPT, _MISMATCH, _RESIZED = 2, 1, 0, -1
"""A rank's verdict on a candidate step; the ranks take the minimum (_RESIZED: the step was
saved by a job of another size; it is resharded from memory)."""


class SnapshotLoader:
    """Restores one state for one ``load`` call of a rank.

    Resource handling: borrows the rank's SMP client and slot mappings (``segment``) from
    its Checkpointer and closes neither.
    """

    def __init__(
        self,
        *,
        rank: int,
        client: SmpClient,
        segment: Callable[[str, int], MappedSegment],
        group: Any,
        flush_dirs: Sequence[Path],
        run_dir: Path | None = None,
    ) -> None:
        self._rank = rank
        self._run_dir = run_dir
        self._client = client
        self._segment_of = segment
        self._group = group
        """The replica group a sharded snapshot gathers over (None: the default group)."""
        self._flush_dirs = list(flush_dirs)
        self.unreadable: list[str] = []
        """The configured disk tiers this rank could not read, with why."""
        self._saved_world = 0
        """The world size of a sharded snapshot saved by a job of another size (0: none)."""

    def load(self, state: MutableMapping[str, Any], *, allow_fresh_start: bool) -> int:
        """Restore the newest step every rank can restore (in place); return it, or 0.

        The ranks agree on the newest step they all hold, each checks its snapshot, and they
        agree again before anything is applied; a step that fails anywhere is excluded and
        the next older one tried. Without a common step in memory, the flushed checkpoints of
        ``flush_dirs`` are tried the same way. Raises as :meth:`Checkpointer.load` does.
        """
        allow = allow_fresh_start
        request = rejoin.requested()
        if request is not None:  # ftmem-launch: the job's size changed
            return self._reshard(state, request.world_size, request.step, request.run_dirs)
        client = self._client
        snaps = client.query(self._rank)
        excluded: set[int] = set()
        for _ in range(agreement.MAX_CANDIDATES + 1):
            mine = [s.step for s in snaps if s.step not in excluded]
            everyone = agreement.gather_candidates(mine)
            step = agreement.newest_common(everyone)
            if step is None:
                from_disk = self._load_from_disk(state)
                if from_disk is not None:
                    return from_disk
                self._refuse_unread_tiers(allow)
                if not any(everyone) and not excluded:
                    lost = expected_step()
                    if lost > 0 and not allow:
                        raise InconsistentSnapshotError(
                            f"the run had committed step {lost} but no snapshot is left "
                            "(the SMP was restarted?); set FTMEM_ALLOW_FRESH_START=1 to start "
                            "from step 0"
                        )
                    return 0
                holders = [r for r, c in enumerate(everyone) if c]
                saved = -agreement.min_over_ranks(-self._saved_world_of(snaps))
                if holders and not excluded and saved and saved != agreement.current_world_size():
                    return self._reshard(state, saved, None, ())  # the job grew
                if holders and not excluded and checkfree.enabled():
                    return self._load_checkfree(state, everyone, snaps)
                held = "; ".join(
                    f"rank {r}: {sorted(c) if c else 'none'}" for r, c in enumerate(everyone[:8])
                ) + (f"; {len(everyone) - 8} more ranks" if len(everyone) > 8 else "")
                msg = (
                    f"no snapshot step is held by every rank (steps each rank holds: {held}; "
                    f"steps that failed their checks: {sorted(excluded)})"
                )
                if not excluded and len(holders) > 1:
                    msg += (
                        ". The ranks did not save the same steps: every rank must call "
                        "ftmem.save at the same steps, in one distributed run (a script that "
                        "did not start torch.distributed, e.g. the HF Trainer on CPU without "
                        "a distributed backend, or a save behind a rank-dependent condition, "
                        "gives each rank steps of its own)"
                    )
                if allow:
                    log.warning("%s; starting fresh as allowed", msg)
                    client.request(m.DiscardNewer(rank=self._rank, step=0))
                    return 0
                if excluded:
                    raise CorruptSnapshotError(msg)
                if checkfree.find_stage(state) is not None:
                    msg += (
                        "; a pipeline stage can be rebuilt from its neighbours instead: "
                        "ftmem-launch --ftmem-checkfree (CheckFree)"
                    )
                raise InconsistentSnapshotError(msg)
            snap = next(s for s in snaps if s.step == step)
            agreed, err = self._restore(state, snap, step)
            if agreed == _OK:
                client.request(m.DiscardNewer(rank=self._rank, step=step))
                log.info("restored step %d", step)
                return step
            if agreed == _RESIZED:
                world = -agreement.min_over_ranks(-self._saved_world)
                return self._reshard(state, world, None, ())
            if agreed == _MISMATCH:
                raise SnapshotMismatchError(
                    err or f"snapshot {step} does not fit another rank's state"
                )
            log.warning(
                "step %d cannot be restored on every rank (%s); trying an older one",
                step,
                err or "another rank failed its checksum",
            )
            excluded.add(step)
        raise CorruptSnapshotError("no restorable snapshot step")

    def _restore(
        self,
        state: MutableMapping[str, Any],
        snap: m.SnapshotInfo | None,
        step: int,
        single_stage: bool = False,
    ) -> tuple[int, str]:
        """Restore ``snap`` (of ``step``) into ``state`` if every rank can: check it against
        the state, agree, copy and verify it in one pass, agree again, then apply the rest
        (Stateful objects, replicated rows). A collective: every rank calls it, ``snap`` None
        on a rank that restores nothing but takes part (CheckFree's lost ranks; then
        ``single_stage``: a snapshot with replicated rows is refused, as the lost ranks could
        not gather them). Returns the agreed code and this rank's error, if any."""
        code, plan, seg, err = _OK, None, None, ""
        if snap is not None:
            code, plan, seg, err = self._prepare_restore(state, snap)
        if single_stage and plan is not None and plan.replicas is not None:
            code, err = _MISMATCH, "CheckFree needs one stage per rank, no replicas"
        agreed = agreement.min_over_ranks(code)
        if agreed != _OK:
            return agreed, err
        if plan is not None:
            assert seg is not None
            try:
                copy_verified(plan, seg, threads=restore_threads())
            except CorruptSnapshotError as exc:
                log.error("snapshot of step %d is corrupt: %s", step, exc)
                code, err = _CORRUPT, str(exc)
        agreed = agreement.min_over_ranks(code)
        if agreed == _OK and plan is not None:
            assert seg is not None
            peers = None if single_stage else self._peer_pieces(step)
            finish_restore(plan, seg, group=self._group, peers=peers)
        return agreed, err

    def _load_checkfree(
        self,
        state: MutableMapping[str, Any],
        everyone: list[list[int]],
        snaps: list[m.SnapshotInfo],
    ) -> int:
        """(``--ftmem-checkfree``) Some ranks hold snapshots and others none, in memory and on
        disk: the holders restore the newest step they all hold, then the lost ranks' pipeline
        stages are rebuilt from their neighbours (:mod:`ftmem.client.checkfree`).

        Raises:
            InconsistentSnapshotError: on every rank, if the holders share no step, one of
                them cannot restore it, or the loss cannot be rebuilt.
        """
        lost = [r for r, c in enumerate(everyone) if not c]
        step = agreement.newest_common([c for c in everyone if c])
        agreed, err = _CORRUPT, "the ranks holding snapshots share no step"
        if step is not None:  # the same on every rank: they all take part in the agreements
            snap = None if self._rank in lost else next(s for s in snaps if s.step == step)
            agreed, err = self._restore(state, snap, step, single_stage=True)
        if step is None or agreed != _OK:
            raise InconsistentSnapshotError(
                f"CheckFree: ranks {lost} hold no snapshot and the others cannot all restore a "
                f"common step ({err or 'another rank failed'})"
            )
        checkfree.rebuild_lost_stages(state, step, lost)
        self._client.request(m.DiscardNewer(rank=self._rank, step=step))
        log.warning(
            "restored step %d; ranks %s rebuilt from their neighbours (CheckFree)", step, lost
        )
        return step

    def _refuse_unread_tiers(self, allow: bool) -> None:
        """Memory and the readable tiers hold nothing to restore: if a configured tier could
        not be read on some rank (all ranks agree), stop rather than start over on top of
        what it may hold, unless fresh starts are allowed.

        Raises:
            InconsistentSnapshotError: naming the tier and why it could not be read.
        """
        readable = agreement.min_over_ranks(0 if self.unreadable else 1)
        if readable or allow:
            return
        why = "; ".join(self.unreadable) or "on another rank"
        raise InconsistentSnapshotError(
            f"a disk tier could not be read ({why}): it may hold this job's checkpoints, so the "
            "job does not start over; fix the tier, or set FTMEM_ALLOW_FRESH_START=1 to start "
            "from step 0"
        )

    def _load_from_disk(self, state: MutableMapping[str, Any]) -> int | None:
        """Memory cannot serve every rank: restore the newest complete flushed checkpoint that
        every rank can read, nearest tier first; None if there is none (all ranks agree)."""
        from ftmem.tiers.checkpoints import Checkpoint, list_checkpoints
        from ftmem.tiers.disk_restore import load_rank

        world = torch.distributed.get_world_size() if agreement.distributed() else 1
        found: dict[int, Checkpoint] = {}
        for tier in self._flush_dirs:
            try:
                good, other = list_checkpoints(tier, parts=True)
            except (UnsafePathError, OSError) as exc:
                log.error("cannot read disk tier %s: %s", tier, exc)
                self.unreadable.append(f"{tier}: {exc}")
                continue
            for path, why in other:
                log.warning("ignoring %s: %s", path, why)
            for ck in good:  # a whole checkpoint, or a node's part that holds this rank
                if ck.world_size == world and self._rank in ck.ranks:
                    found.setdefault(ck.step, ck)  # the nearest tier's copy wins
        excluded: set[int] = set()
        for _ in range(agreement.MAX_CANDIDATES):
            mine = [s for s in found if s not in excluded]
            step = agreement.newest_common(agreement.gather_candidates(mine))
            if step is None:
                return None
            ck = found[step]
            code, err, restore = _CORRUPT, "", None
            try:
                snap, objects, buf = load_rank(ck, self._rank)
                restore = (self._check_group(plan_restore(state, snap, objects)), buf)
                code = _OK
            except CorruptSnapshotError as exc:
                err = str(exc)
                log.error("flushed checkpoint %s is corrupt: %s", ck.path, exc)
            except SnapshotMismatchError as exc:
                code, err = _MISMATCH, str(exc)
            agreed = agreement.min_over_ranks(code)
            if agreed == _OK:
                assert restore is not None
                apply_restore(*restore, threads=restore_threads(), group=self._group)
                self._client.request(m.DiscardNewer(rank=self._rank, step=step))
                log.warning(
                    "memory could not serve every rank: restored step %d from %s", step, ck.path
                )
                return step
            if agreed == _MISMATCH:
                raise SnapshotMismatchError(err or f"checkpoint {ck.path} does not fit the state")
            log.warning(
                "checkpoint of step %d cannot be restored on every rank (%s); trying an older one",
                step,
                err or "another rank failed",
            )
            excluded.add(step)
        return None

    def _prepare_restore(
        self, state: MutableMapping[str, Any], snap: m.SnapshotInfo
    ) -> tuple[int, Any, Any, str]:
        try:
            seg = self._segment_of(snap.path, snap.capacity)
            stored = parse_layout(snap.layout, snap.capacity)
            objects = read_objects(stored, seg.view)  # the tensors are checked as they are copied
            return _OK, self._check_group(plan_restore(state, stored, objects)), seg, ""
        except (CorruptSnapshotError, OSError, ValueError) as exc:
            log.error("snapshot of step %s is corrupt: %s", snap.step, exc)
            return _CORRUPT, None, None, str(exc)
        except SnapshotMismatchError as exc:
            return (_RESIZED if self._saved_world else _MISMATCH), None, None, str(exc)

    def _saved_world_of(self, snaps: list[m.SnapshotInfo]) -> int:
        """The world size this rank's newest snapshot was sharded over (0: none, or not
        sharded; the world size of an unsharded snapshot is not recorded)."""
        if not snaps:
            return 0
        snap = max(snaps, key=lambda s: s.step)
        try:
            seg = self._segment_of(snap.path, snap.capacity)
            table = decode_skeleton(
                read_objects(parse_layout(snap.layout, snap.capacity), seg.view)
            )
            size = dict(table.get(REPLICAS_KEY) or {}).get("size", 0)
            return int(size) if type(size) is int and size > 0 else 0
        except (CorruptSnapshotError, OSError, ValueError, TypeError):
            return 0

    def _reshard(
        self, state: MutableMapping[str, Any], world: int, step: int | None, extra: Sequence[Path]
    ) -> int:
        """Load a step of a job of ``world`` ranks at this job's size, from memory (the SMPs
        of this host: the rank's own, ``extra`` and any live guest SMP in its run directory,
        which ftmem-launch keeps after a shrink until a newer step is protected); drop this
        rank's newer snapshots."""
        dirs = ([self._run_dir] if self._run_dir is not None else []) + list(extra)
        if self._run_dir is not None:  # guest SMPs ftmem-launch runs here after a shrink
            dirs += [
                d
                for d in sorted(self._run_dir.glob(f"{GUEST_DIR_PREFIX}*"))
                if d not in dirs and (d / SOCKET_NAME).exists()
            ]
        done = reshard.load_resharded(
            state, world_size=world, run_dirs=dirs, step=step, flush_dirs=self._flush_dirs
        )
        self._client.request(m.DiscardNewer(rank=self._rank, step=done))
        # Old ranks beyond the new world are gone for good: their snapshots here would be
        # taken for this job's if it grew back (every process of the host asks; idempotent).
        for rank in range(agreement.current_world_size(), world):
            if self._client.query(rank):
                self._client.request(m.DiscardNewer(rank=rank, step=0))
        return done

    def _peer_pieces(self, step: int) -> Any:
        """For a sharded restore: the other replicas' snapshots of ``step`` that this node's
        SMP holds (same shared memory), so their rows are copied, not sent over the network."""
        if not agreement.distributed():
            return None
        here = set(self._client.status().ranks)
        group = self._group if self._group is not None else torch.distributed.group.WORLD
        assert group is not None

        def find(k: int) -> Any:
            g = torch.distributed.get_global_rank(group, k)
            if g not in here:
                return None
            for snap in self._client.query(g):
                if snap.step == step:
                    seg = self._segment_of(snap.path, snap.capacity)
                    return seg, parse_layout(snap.layout, snap.capacity).tensors
            return None

        return find

    def _check_group(self, plan: RestorePlan) -> RestorePlan:
        """A sharded snapshot restores only with the same replicas (it gathers over them).

        Raises:
            SnapshotMismatchError: the replica group differs from the one that saved.
        """
        shape = plan.replica_group_shape()
        if shape is None:
            return plan
        if not agreement.distributed():
            if shape == (1, 0):
                return plan
            raise SnapshotMismatchError(
                f"the snapshot was sharded over {shape[0]} replicas; load it with a process group"
            )
        have = (
            torch.distributed.get_world_size(self._group),
            torch.distributed.get_rank(self._group),
        )
        if have != shape:
            msg = (
                f"the snapshot was sharded over {shape[0]} replicas (this one #{shape[1]}); "
                f"the replica group here has {have[0]} (this one #{have[1]})"
            )
            if have[0] != shape[0] and self._group in (None, torch.distributed.group.WORLD):
                self._saved_world = shape[0]  # load() reshards the step from memory instead
            if have[0] != shape[0]:
                raise SnapshotMismatchError(
                    f"{msg}: the job's size changed, and ftmem.load restores a snapshot only "
                    "at the size it was saved at; reshard it with DCP instead, from memory "
                    "(ftmem.tiers.memory_dcp.MemoryCheckpoint) or from a flushed checkpoint "
                    "(docs/api.md)"
                )
            raise SnapshotMismatchError(f"{msg}: pass the group that saved it as replicated_over=")
        return plan


def expected_step() -> int:
    """The newest step any rank's launcher says its node had committed (0 if unknown)."""
    raw = os.environ.get(ENV_EXPECTED_STEP, "")
    mine = int(raw) if raw.isdigit() else 0
    return -agreement.min_over_ranks(-mine)
