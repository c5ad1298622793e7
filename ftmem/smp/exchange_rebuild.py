"""Rebuild this node's snapshot of the group's protected step and install it in the slots.

A node that lost the step the group keeps (a replacement, a restarted SMP) fetches its data
and parity from the survivors (:meth:`GroupProtector.rebuild`), writes each rank's bytes into
a new slot (:meth:`SlotStore.install_rebuilt`) and from then on serves the step from those
slot files, as if it had protected the step itself.
"""

from __future__ import annotations

import json
import time

from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.exchange.status import ExchangeState
from ftmem.smp.exchange_state import ExchangeContext, PinnedStep
from ftmem.smp.store import StoreError

log = get_logger(__name__)

REBUILD_ERRORS = (FtmemError, StoreError, TimeoutError, OSError, ValueError)
"""What a failed rebuild raises (the peers, the codec, the slot store); each one is reported
as the rebuild's failure, none stops the exchange thread."""


def report_progress(ctx: ExchangeContext, step: int, done: int, total: int) -> None:
    """(The protector's ``on_progress``) publish and log how far the rebuild of ``step`` is."""
    pct = 100.0 * done / total if total else 100.0
    ctx.board.update(rebuild_progress={"step": step, "fragments": done, "of": total})
    log.info(
        "[%s/exchange] rebuilding step %d: %.0f%% (%d/%d fragments)",
        ctx.node_name,
        step,
        pct,
        done,
        total,
    )


def rebuild_step(ctx: ExchangeContext, step: int, lost: frozenset[int], source: int) -> None:
    """Rebuild ``step`` from the group (``source``: a node that holds it) and install it.

    Raises:
        One of REBUILD_ERRORS (a StoreError: a rank had no slot to take its rebuilt bytes);
        the protector has then forgotten the step.
    """
    protector = ctx.protector
    assert protector is not None
    t0 = time.monotonic()
    ctx.board.move(ExchangeState.REBUILDING, rebuilding=step)
    log.info(
        "[%s/exchange] rebuilding step %d from node %d's group (lost %s)",
        ctx.node_name,
        step,
        source,
        sorted(lost),
    )
    data = protector.rebuild(step, lost, source)
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
        "[%s/exchange] rebuilt step %d: %.1f MiB own data and %.1f MiB parity in %.2f s",
        ctx.node_name,
        step,
        data.nbytes / 2**20,
        parity / 2**20,
        ctx.last_rebuild_s,
    )


def rebuild_failed(ctx: ExchangeContext, step: int, exc: BaseException) -> str:
    """Record a failed rebuild of ``step`` (log, event, REBUILD_FAILED); return the error."""
    ctx.protected = None
    msg = f"rebuild of step {step} failed: {exc}"
    log.error("[%s/exchange] %s", ctx.node_name, msg)
    ctx.event("rebuild_failed", step=step, error=str(exc))
    ctx.board.move(ExchangeState.REBUILD_FAILED, error=msg)
    return msg
