"""Rebuild this node's snapshot of the group's protected step and install it in the slots.

A node that lost the step the group keeps (a replacement, a restarted SMP) fetches its data
and parity from the survivors (:meth:`GroupProtector.rebuild`), writes each rank's bytes into
a new slot (:meth:`SlotStore.install_rebuilt`) and from then on serves the step from those
slot files, as if it had protected the step itself.

Before anything is allocated, what the survivors sent is checked (:func:`check_manifest`,
the protector's ``accept`` hook, after the protector's own bounds and seal check): the
manifest is for the step and lists exactly this node's ranks, each rank's bytes fit its slot
capacity, they add up to the node's size, and all the slots together fit in the free shared
memory. A refusal is the rebuild's failure (REBUILD_FAILED), like any other.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ftmem._logging import get_logger
from ftmem.errors import FtmemError, UnrecoverableError
from ftmem.exchange.rebuilder import RebuildMeta
from ftmem.protocol.status import ProtectionState
from ftmem.smp.protection_state import PinnedStep, ProtectionContext
from ftmem.smp.store import MAX_SLOT_BYTES, StoreError

log = get_logger(__name__)

REBUILD_ERRORS = (FtmemError, StoreError, TimeoutError, OSError, ValueError)
"""What a failed rebuild raises (the peers, the codec, the slot store); each one is reported
as the rebuild's failure, none stops the protection thread."""


def report_progress(ctx: ProtectionContext, step: int, done: int, total: int) -> None:
    """(The protector's ``on_progress``) publish and log how far the rebuild of ``step`` is."""
    pct = 100.0 * done / total if total else 100.0
    ctx.board.update(rebuild_progress={"step": step, "fragments": done, "of": total})
    log.info(
        "[%s/protection] rebuilding step %d: %.0f%% (%d/%d fragments)",
        ctx.node_name,
        step,
        pct,
        done,
        total,
    )


def _int_field(entry: dict[str, Any], name: str, hi: int) -> int:
    value = entry.get(name)
    if type(value) is not int or not 0 <= value <= hi:
        raise UnrecoverableError(f"a manifest entry's {name!r} is not an integer in 0..{hi}")
    return value


def check_manifest(ctx: ProtectionContext, meta: RebuildMeta) -> None:
    """Refuse a rebuild whose manifest does not fit this node (see the module docstring).

    Raises:
        UnrecoverableError: saying what does not fit.
    """
    try:
        doc = json.loads(meta.manifest or b"null")
    except (ValueError, RecursionError) as exc:
        raise UnrecoverableError(f"the manifest of step {meta.step} is not JSON") from exc
    if not isinstance(doc, dict) or doc.get("step") != meta.step:
        raise UnrecoverableError("the rebuilt node's manifest is missing or for another step")
    entries = doc.get("ranks")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UnrecoverableError("the manifest has no list of ranks")
    ranks = [_int_field(e, "rank", 1 << 31) for e in entries]
    if sorted(ranks) != sorted(ctx.ranks):
        raise UnrecoverableError(
            f"the manifest lists ranks {sorted(ranks)[:16]}, this node runs {sorted(ctx.ranks)}"
        )
    used = capacity = 0
    for e in entries:
        n, cap = _int_field(e, "nbytes", MAX_SLOT_BYTES), _int_field(e, "capacity", MAX_SLOT_BYTES)
        if n > cap:
            raise UnrecoverableError(f"rank {e['rank']}: {n} bytes in a slot of {cap}")
        used, capacity = used + n, capacity + cap
    if used != meta.sizes.get(ctx.me):
        raise UnrecoverableError(
            f"the manifest's ranks hold {used} bytes, the node's size is {meta.sizes.get(ctx.me)}"
        )
    vfs = os.statvfs(ctx.local.files.shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if capacity > free:
        raise UnrecoverableError(
            f"the rebuilt slots need {capacity} bytes, {ctx.local.files.shm_dir} has {free} free"
        )


def rebuild_step(ctx: ProtectionContext, step: int, lost: frozenset[int], source: int) -> None:
    """Rebuild ``step`` from the group (``source``: a node that holds it) and install it.

    Raises:
        One of REBUILD_ERRORS (a StoreError: a rank had no slot to take its rebuilt bytes);
        the protector has then forgotten the step.
    """
    protector = ctx.protector
    assert protector is not None
    t0 = time.monotonic()
    ctx.board.move(ProtectionState.REBUILDING, rebuilding=step)
    log.info(
        "[%s/protection] rebuilding step %d from node %d's group (lost %s)",
        ctx.node_name,
        step,
        source,
        sorted(lost),
    )
    data = protector.rebuilder.rebuild(step, lost, source, lambda meta: check_manifest(ctx, meta))
    try:
        manifest = json.loads(protector.manifest(step, ctx.me) or b"null")
        if not isinstance(manifest, dict) or manifest.get("step") != step:
            raise ValueError("the rebuilt node's manifest is missing or for another step")
        try:
            pieces = ctx.local.install_rebuilt(step, manifest, data)
        except StoreError as exc:
            raise StoreError(f"cannot install the rebuilt snapshot in the slots: {exc}") from exc
    except BaseException:
        protector.forget(step)
        raise
    # Serve the rebuilt data from the slot files from now on, not from the heap copy.
    pinned = PinnedStep(step, pieces)
    protector.steps[step].data = pinned.open()
    ctx.pinned[step] = pinned
    ctx.counters["rebuilt"] += 1
    ctx.last_rebuild_s = time.monotonic() - t0
    parity = protector.parity_bytes(step)
    ctx.event(
        "rebuilt",
        step=step,
        seconds=round(ctx.last_rebuild_s, 3),
        bytes=data.nbytes,
        parity_bytes=parity,
    )
    log.info(
        "[%s/protection] rebuilt step %d: %.1f MiB own data and %.1f MiB parity in %.2f s",
        ctx.node_name,
        step,
        data.nbytes / 2**20,
        parity / 2**20,
        ctx.last_rebuild_s,
    )


def rebuild_failed(ctx: ProtectionContext, step: int, exc: BaseException) -> str:
    """Record a failed rebuild of ``step`` (log, event, REBUILD_FAILED); return the error."""
    ctx.protected = None
    msg = f"rebuild of step {step} failed: {exc}"
    log.error("[%s/protection] %s", ctx.node_name, msg)
    ctx.event("rebuild_failed", step=step, error=str(exc))
    ctx.board.move(ProtectionState.REBUILD_FAILED, error=msg)
    return msg
