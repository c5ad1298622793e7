"""The sync that starts each generation: which step the group keeps, and who rebuilds it.

Every node tells the group which steps it holds (own data plus owed parity); once every list
is in, each node runs :func:`decide` on the same inputs, so all agree: the newest step held by
at least ``n - m`` nodes is kept, the nodes that lack it rebuild it, every node keeps only
that step. Until then a node holds its peers' META and FETCH requests; then it serves the kept
step to the nodes that rebuild it and refuses everyone else.

A node that lost the kept step fetches its data and parity from the survivors
(:meth:`GroupProtector.rebuild`), writes each rank's bytes into a new slot
(:meth:`SlotStore.install_rebuilt`) and from then on serves the step from those slot files.
Before anything is allocated, :func:`check_manifest` checks what the survivors sent: the
manifest is for the step and lists exactly this node's ranks, each rank's bytes fit its slot,
they add up to the node's size, and the slots fit in the free shared memory. A refusal fails
the rebuild (REBUILD_FAILED), like any other error.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ftmem._logging import get_logger
from ftmem.errors import ErrorKind, FtmemError, UnrecoverableError
from ftmem.exchange.placement import GroupPlan
from ftmem.exchange.rebuilder import RebuildMeta
from ftmem.format.record import NodeManifest, decode_manifest
from ftmem.protocol.status import ProtectionState, RebuildProgress, SyncReply
from ftmem.smp.protection_state import (
    Generation,
    PinnedStep,
    PinnedSteps,
    Result,
    StartCommand,
    StatusBoard,
)
from ftmem.smp.slot_store import SlotStore
from ftmem.smp.store import StoreError

log = get_logger(__name__)

REBUILD_ERRORS = (FtmemError, StoreError, TimeoutError, OSError, ValueError)
"""What a failed rebuild raises (the peers, the codec, the slot store); each one is reported
as the rebuild's failure, none stops the protection thread."""


def report_progress(board: StatusBoard, step: int, done: int, total: int) -> None:
    """(The protector's ``on_progress``) publish and log how far the rebuild of ``step`` is."""
    pct = 100.0 * done / total if total else 100.0
    board.update(rebuild_progress=RebuildProgress(step, done, total))
    log.info(
        "[%s/protection] rebuilding step %d: %.0f%% (%d/%d fragments)",
        board.node_name,
        step,
        pct,
        done,
        total,
    )


def check_manifest(gen: Generation, local: SlotStore, meta: RebuildMeta) -> NodeManifest:
    """Refuse a rebuild whose manifest does not fit this node (see the module docstring);
    the manifest that fits.

    Raises:
        UnrecoverableError: saying what does not fit.
    """
    try:
        manifest = decode_manifest(meta.manifest, meta.step)
    except ValueError as exc:
        raise UnrecoverableError(str(exc)) from exc
    entries = manifest.ranks
    ranks = sorted(e.rank for e in entries)
    if ranks != sorted(gen.ranks):
        raise UnrecoverableError(
            f"the manifest lists ranks {ranks[:16]}, this node runs {sorted(gen.ranks)}"
        )
    for e in entries:
        if e.nbytes > e.capacity:
            raise UnrecoverableError(f"rank {e.rank}: {e.nbytes} bytes in a slot of {e.capacity}")
    used, capacity = sum(e.nbytes for e in entries), sum(e.capacity for e in entries)
    if used != meta.sizes.get(gen.me):
        raise UnrecoverableError(
            f"the manifest's ranks hold {used} bytes, the node's size is {meta.sizes.get(gen.me)}"
        )
    vfs = os.statvfs(local.files.shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if capacity > free:
        raise UnrecoverableError(
            f"the rebuilt slots need {capacity} bytes, {local.files.shm_dir} has {free} free"
        )
    return manifest


@dataclass(frozen=True, slots=True)
class SyncVerdict:
    """What the group's sync decided: the step kept, who holds it, who must rebuild it."""

    step: int | None
    holders: frozenset[int]
    lost: frozenset[int]
    error: str = ""


def decide(plan: GroupPlan, held: dict[int, list[int]]) -> SyncVerdict:
    """The newest step held by at least ``n - m`` nodes, and who must rebuild it.

    Every node runs this on the same inputs (every node's held steps), so all agree.
    """
    n, m = len(plan.nodes), plan.m
    steps = {s for v in held.values() for s in v}
    holders = {s: frozenset(node for node, v in held.items() if s in v) for s in steps}
    ok = [s for s in steps if len(holders[s]) >= n - m]
    if not ok:
        if not steps:
            return SyncVerdict(None, frozenset(), frozenset())
        newest = max(steps)
        lost = frozenset(plan.nodes) - holders[newest]
        return SyncVerdict(
            None,
            frozenset(),
            lost,
            error=(
                f"cannot rebuild from memory: step {newest} is held by nodes "
                f"{sorted(holders[newest])} only; {len(lost)} nodes {sorted(lost)} of the group "
                f"{list(plan.nodes)} lost their snapshots, more than m={m}"
            ),
        )
    step = max(ok)
    return SyncVerdict(step, holders[step], frozenset(plan.nodes) - holders[step])


class GenerationSync:
    """One generation's sync, from :meth:`begin` until :meth:`poll` returns its result. It
    changes only the steps pinned here (``pins``) and reports on ``board``.

    Error handling: a node that does not answer within ``timeout_s`` fails the sync
    (SYNC_FAILED); more than m lost nodes fail it as UNRECOVERABLE; a failed rebuild fails it
    as REBUILD_FAILED. Each is the start command's failed :class:`Result`; none raises.
    """

    def __init__(self, pins: PinnedSteps, board: StatusBoard, timeout_s: float) -> None:
        self.pins = pins
        self.board = board
        self.timeout_s = timeout_s
        self.pending: StartCommand | None = None
        """The start command whose sync is under way (None: none)."""
        self.gen: Generation | None = None
        """The generation being synced (or last synced)."""
        self.synced = False
        """The generation is in sync: protection rounds may run."""
        self._states: dict[int, list[int]] = {}
        self._deadline = 0.0

    def begin(self, cmd: StartCommand, gen: Generation, held: list[int]) -> None:
        """Start the sync of ``cmd``'s generation ``gen``; this node holds ``held``."""
        self.pending, self.gen = cmd, gen
        self.synced = False
        self._states = {gen.me: held}
        self._deadline = time.monotonic() + self.timeout_s
        gen.protector.rebuilder.hold()

    def on_held(self, sender: int, held: list[int]) -> None:
        """Node ``sender``'s held steps."""
        self._states[sender] = held

    def poll(self) -> Result | None:
        """The start command's result once every node answered (or the deadline passed)."""
        cmd, gen = self.pending, self.gen
        assert cmd is not None and gen is not None
        if set(self._states) < set(gen.plan.nodes):
            if time.monotonic() <= self._deadline:
                return None
            missing = sorted(set(gen.plan.nodes) - set(self._states))
            self.pending = None
            gen.protector.rebuilder.serve_only(None, frozenset())
            self.board.move(ProtectionState.SYNC_FAILED)
            self.board.event("sync", epoch=gen.epoch, ok=False, missing=missing)
            why = f"nodes {missing} did not answer the sync in {self.timeout_s:.0f} s"
            return Result(cmd.token, False, {}, why)
        self.pending = None
        return self._finish(cmd, gen, decide(gen.plan, self._states))

    def _finish(self, cmd: StartCommand, gen: Generation, verdict: SyncVerdict) -> Result:
        protector, board = gen.protector, self.board
        # Snapshot bytes go to the nodes that rebuild the kept step, and to no one else.
        protector.rebuilder.serve_only(None if verdict.error else verdict.step, verdict.lost)
        board.event(
            "sync",
            epoch=gen.epoch,
            ok=not verdict.error,
            step=verdict.step,
            holders=sorted(verdict.holders),
            lost=sorted(verdict.lost),
            error=verdict.error,
        )
        reply = SyncReply(verdict.step, tuple(sorted(verdict.lost)))
        keep = verdict.step
        for step in protector.held_steps():
            if step != keep:
                protector.forget(step)
                self.pins.release(step)
        self.pins.protected = keep
        if verdict.error:
            board.move(ProtectionState.UNRECOVERABLE, error=verdict.error)
            return Result(cmd.token, False, reply.to_json(), verdict.error, ErrorKind.UNRECOVERABLE)
        if keep is not None and gen.me in verdict.lost:
            try:
                self._rebuild(gen, keep, verdict.lost, min(verdict.holders))
            except REBUILD_ERRORS as exc:
                self.pins.protected = None
                why = f"rebuild of step {keep} failed: {exc}"
                log.error("[%s/protection] %s", board.node_name, why)
                board.event("rebuild_failed", step=keep, error=str(exc))
                board.move(ProtectionState.REBUILD_FAILED, error=why)
                return Result(cmd.token, False, reply.to_json(), why)
            reply = SyncReply(keep, reply.lost, rebuilt=True)
        self.synced = True
        board.move(ProtectionState.READY, error="")
        log.info(
            "[%s/protection] mesh epoch %d: protected step %s (lost nodes %s)",
            board.node_name,
            gen.epoch,
            keep,
            sorted(verdict.lost),
        )
        return Result(cmd.token, True, reply.to_json())

    def _rebuild(self, gen: Generation, step: int, lost: frozenset[int], source: int) -> None:
        """Rebuild ``step`` from the group (``source``: a node that holds it), install it in
        the slots and pin it.

        Raises:
            One of REBUILD_ERRORS (a StoreError: a rank had no slot to take its rebuilt
            bytes); the protector has then forgotten the step.
        """
        protector, pins, board = gen.protector, self.pins, self.board
        t0 = time.monotonic()
        board.move(ProtectionState.REBUILDING, rebuilding=step)
        log.info(
            "[%s/protection] rebuilding step %d from node %d's group (lost %s)",
            board.node_name,
            step,
            source,
            sorted(lost),
        )
        checked: list[NodeManifest] = []
        data = protector.rebuilder.rebuild(
            step, lost, source, lambda meta: checked.append(check_manifest(gen, pins.local, meta))
        )
        try:  # the rebuild checked its manifest (``accept``) before it allocated anything
            pieces = pins.local.install_rebuilt(step, checked[-1], data)
        except StoreError as exc:
            protector.forget(step)
            raise StoreError(f"cannot install the rebuilt snapshot in the slots: {exc}") from exc
        except BaseException:
            protector.forget(step)
            raise
        # Serve the rebuilt data from the slot files from now on, not from the heap copy.
        pinned = PinnedStep(step, pieces)
        protector.steps[step].data = pinned.open()
        pins.keep(pinned)
        seconds = time.monotonic() - t0
        board.count("rebuilt")
        board.update(last_rebuild_s=round(seconds, 3))
        parity = protector.parity_bytes(step)
        board.event(
            "rebuilt", step=step, seconds=round(seconds, 3), bytes=data.nbytes, parity_bytes=parity
        )
        log.info(
            "[%s/protection] rebuilt step %d: %.1f MiB own data and %.1f MiB parity in %.2f s",
            board.node_name,
            step,
            data.nbytes / 2**20,
            parity / 2**20,
            seconds,
        )
