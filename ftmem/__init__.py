"""ftmem: in-memory fault tolerance for PyTorch training.

Public API (the simple path)::

    import ftmem
    state = {"model": model, "optim": optimizer, "rng": ftmem.RNGState()}
    step = ftmem.load(state)
    for step in range(step, total):
        train_one_step()
        ftmem.save(state, step=step + 1)

Ranks that should survive the failure of other ranks (in-process restart, under
``ftmem-launch``) hand their loop to :func:`run` instead::

    def train(start: int) -> None:
        ddp = DistributedDataParallel(model)      # per generation: bound to the process group
        for step in range(start, total):
            train_one_step(ddp)
            ftmem.save(state, step=step + 1)

    ftmem.run(train, state)

The package's layers, which import one way only (tests/unit/test_layers.py checks it), are
described in docs/design.md, "Layout".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from ftmem.config import ClientConfig, SmpConfig
from ftmem.errors import (
    CorruptSnapshotError,
    FtmemError,
    InconsistentSnapshotError,
    ProtocolError,
    SmpStartError,
    SmpUnavailableError,
    SnapshotMismatchError,
)

if TYPE_CHECKING:
    from ftmem.client import (
        CheckFreeStage,
        Checkpointer,
        ElasticSampler,
        RNGState,
        SnapshotHandle,
    )

__all__ = [
    "CheckFreeStage",
    "Checkpointer",
    "ClientConfig",
    "CorruptSnapshotError",
    "ElasticSampler",
    "FtmemError",
    "InconsistentSnapshotError",
    "ProtocolError",
    "RNGState",
    "SmpConfig",
    "SmpStartError",
    "SmpUnavailableError",
    "SnapshotHandle",
    "SnapshotMismatchError",
    "close",
    "heartbeat",
    "load",
    "run",
    "save",
    "stats",
    "wait",
]

_T = TypeVar("_T")
_default: Checkpointer | None = None
_LAZY = {"CheckFreeStage", "Checkpointer", "ElasticSampler", "RNGState", "SnapshotHandle"}


def __getattr__(name: str) -> Any:
    # The client (and torch) load on first use, so the SMP and the CLI start fast.
    if name in _LAZY:
        import ftmem.client

        return getattr(ftmem.client, name)
    raise AttributeError(f"module 'ftmem' has no attribute {name!r}")


def _checkpointer() -> Checkpointer:
    global _default
    if _default is None:
        from ftmem.client import Checkpointer

        _default = Checkpointer()
    return _default


def save(state: Mapping[str, Any], step: int, *, replicated_over: Any = None) -> SnapshotHandle:
    """Snapshot ``state`` as ``step`` into the node's SMP; return at once (see Checkpointer.save;
    ``replicated_over``: the data-parallel process group, to save 1/D of the replicated state)."""
    return _checkpointer().save(state, step, replicated_over=replicated_over)


def load(
    state: MutableMapping[str, Any],
    *,
    allow_fresh_start: bool | None = None,
    replicated_over: Any = None,
) -> int:
    """Restore the newest step every rank holds, in place; return it (0: nothing to restore).
    ``replicated_over``: the group a sharded snapshot was saved over (default: the world)."""
    return _checkpointer().load(
        state, allow_fresh_start=allow_fresh_start, replicated_over=replicated_over
    )


def run(
    train: Callable[[int], _T],
    state: MutableMapping[str, Any],
    *,
    replicated_over: Callable[[], Any] | None = None,
    backend: str | None = None,
    pg_timeout: timedelta | None = None,
) -> _T:
    """Restore ``state`` and call ``train(start_step)``; when another rank fails, rejoin the
    next generation in this same process and call it again; return what ``train`` returns.

    Under ``ftmem-launch`` only (anywhere else it raises ``FtmemError`` saying so). Creates
    the default process group from the environment if it does not exist (``backend``:
    ``nccl`` with CUDA, else ``gloo``; ``pg_timeout``: its timeout). A failure that is not a
    peer's, or a rejoin that fails, propagates (the process is started cold). Build
    process-group-bound objects (DDP, FSDP, ``new_group``) inside ``train``.
    ``replicated_over``: a function returning the group a sharded snapshot is saved over
    (called after every join), e.g. ``lambda: dist.group.WORLD``. See docs/launcher.md,
    "In-process restart", and :mod:`ftmem.client.in_process`.
    """
    from ftmem.client.in_process import run_in_process

    return run_in_process(
        train,
        state,
        _checkpointer(),
        replicated_over=replicated_over,
        backend=backend,
        pg_timeout=pg_timeout,
    )


def wait(timeout: float | None = None) -> bool:
    """Wait for the last snapshot's copy and commit; True if it was committed."""
    return _checkpointer().wait(timeout)


def heartbeat(step: int = 0) -> None:
    """Report training progress to the SMP (for hang detection by ftmem-launch)."""
    _checkpointer().heartbeat(step)


def stats() -> dict[str, Any]:
    """Figures of the last snapshot: stall (save + fence), copy time, skipped count."""
    return _checkpointer().stats()


def close() -> None:
    """Finish the pending snapshot (bounded) and release the connection to the SMP."""
    global _default
    if _default is not None:
        _default.close()
        _default = None
