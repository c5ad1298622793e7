"""Rebuild this node's snapshot of the group's protected step and install it in the slots.

A node that lost the step the group keeps fetches its data and parity from the survivors
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

from ftmem._logging import get_logger
from ftmem.errors import FtmemError, UnrecoverableError
from ftmem.exchange.rebuilder import RebuildMeta
from ftmem.format.record import NodeManifest, decode_manifest
from ftmem.protocol.status import ProtectionState, RebuildProgress
from ftmem.smp.protection_state import Generation, PinnedStep, PinnedSteps, StatusBoard
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


def rebuild_step(
    gen: Generation,
    pins: PinnedSteps,
    board: StatusBoard,
    step: int,
    lost: frozenset[int],
    source: int,
) -> None:
    """Rebuild ``step`` from the group (``source``: a node that holds it), install it in the
    slots and pin it.

    Raises:
        One of REBUILD_ERRORS (a StoreError: a rank had no slot to take its rebuilt bytes);
        the protector has then forgotten the step.
    """
    protector = gen.protector
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


def rebuild_failed(pins: PinnedSteps, board: StatusBoard, step: int, exc: BaseException) -> str:
    """Record a failed rebuild of ``step`` (log, event, REBUILD_FAILED); return the error."""
    pins.protected = None
    msg = f"rebuild of step {step} failed: {exc}"
    log.error("[%s/protection] %s", board.node_name, msg)
    board.event("rebuild_failed", step=step, error=str(exc))
    board.move(ProtectionState.REBUILD_FAILED, error=msg)
    return msg
