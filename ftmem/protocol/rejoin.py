"""The orders ``ftmem-launch`` gives its ranks: :class:`RejoinOrder`, which takes a rank that
survived a failure into the next generation in process, and :class:`ReshardRequest`
(``$FTMEM_RESHARD``), which asks a generation whose world size changed to reshard a step.

At a restart, ``ftmem-launch`` keeps the ranks that run under :func:`ftmem.run` alive and
writes each a :class:`RejoinOrder`: the environment elastic would give a new process for that
rank. The rank waits for an order of a newer generation, applies it to ``os.environ`` and
joins the new process group. The order is a JSON file (``<run_dir>/rejoin/rank-<R>.json``,
mode 0600 in a 0700 directory, written to a temporary name and renamed); a reader opens it
without following symlinks, checks that it is this user's and private, bounds its size and
validates every field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from ftmem.config import ENV_RESHARD
from ftmem.errors import ProtocolError
from ftmem.secure_fs import ensure_private_dir, open_owned, replace_private_file
from ftmem.typed_json import MAX_INT, Pattern, Range, parse, to_fields

REJOIN_DIR = "rejoin"
MAX_ORDER_BYTES = 1 << 20
_Count = Annotated[int, Range(0, MAX_INT)]
_EnvName = Annotated[str, Pattern(r"[A-Za-z_][A-Za-z0-9_]*")]
_NoNul = Annotated[str, Pattern(r"[^\0]*")]
_AbsoluteOrEmpty = Annotated[str, Pattern(r"(?:/[^\0]*)?")]


@dataclass(frozen=True, slots=True)
class RejoinOrder:
    """Join generation ``generation`` as global rank ``rank`` with ``env`` applied. Its file
    holds exactly these fields."""

    generation: _Count
    rank: _Count
    env: dict[_EnvName, _NoNul]
    """Environment variables to set in the rank (elastic's per-rank ones and ftmem's)."""
    agent_pid: _Count
    """The agent that wrote the order (the rank's parent)."""
    stdout: _AbsoluteOrEmpty
    """The new generation's log file for the rank's stdout ("" : keep the current one)."""
    stderr: _AbsoluteOrEmpty
    """The same for stderr."""

    def to_json(self) -> bytes:
        """The order as the bytes of its file."""
        return json.dumps(to_fields(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> RejoinOrder:
        """Parse and validate an order; raise :class:`ProtocolError` on anything unexpected."""
        return parse(RejoinOrder, data, what="rejoin order")


def order_path(run_dir: Path, rank: int) -> Path:
    """Where the order for global rank ``rank`` is written."""
    return run_dir / REJOIN_DIR / f"rank-{int(rank)}.json"


def write_order(run_dir: Path, order: RejoinOrder) -> Path:
    """Write ``order`` for its rank, replacing an older one atomically; return the path.

    Raises:
        ProtocolError: ``order`` is not one :meth:`RejoinOrder.from_json` reads back.
    """
    directory = run_dir / REJOIN_DIR
    ensure_private_dir(directory, "rejoin directory")
    data = order.to_json()
    RejoinOrder.from_json(data)  # an order its reader would refuse is not written
    path = order_path(run_dir, order.rank)
    replace_private_file(path, data)
    return path


def read_order(run_dir: Path, rank: int) -> RejoinOrder | None:
    """The order for ``rank``, or None if there is none yet.

    Raises:
        UnsafePathError: the file is a link, not this user's, or readable by others.
        ProtocolError: it is too large, malformed, or for another rank.
    """
    path = order_path(run_dir, rank)
    if not os.path.lexists(path):
        return None
    fd = open_owned(path, "rejoin order", private=True)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_ORDER_BYTES + 1)
    if len(data) > MAX_ORDER_BYTES:
        raise ProtocolError(f"rejoin order {path} is larger than {MAX_ORDER_BYTES} bytes")
    order = RejoinOrder.from_json(data)
    if order.rank != rank:
        raise ProtocolError(f"rejoin order {path} is for rank {order.rank}, not {rank}")
    return order


@dataclass(frozen=True, slots=True)
class ReshardRequest:
    """What ftmem-launch asks of a generation whose world size changed (``$FTMEM_RESHARD``)."""

    world_size: Annotated[int, Range(1, MAX_INT)]
    """The world size the step was saved at."""
    step: _Count | None = None
    """The step to load (None: the newest one every old rank holds)."""
    run_dirs: tuple[Path, ...] = ()
    """SMP run directories on this host besides the rank's own (one that rebuilt a lost
    machine's snapshots)."""

    def to_env(self) -> str:
        """The value of ``$FTMEM_RESHARD`` that :func:`requested` reads back."""
        return json.dumps(to_fields(self))


def requested() -> ReshardRequest | None:
    """The launcher's request to reshard (``$FTMEM_RESHARD``), or None.

    Raises:
        ProtocolError: the variable is set but malformed.
    """
    raw = os.environ.get(ENV_RESHARD, "")
    if not raw:
        return None
    try:
        return parse(ReshardRequest, raw, strict=False)  # a newer launcher may say more
    except ProtocolError as exc:
        raise ProtocolError(f"${ENV_RESHARD} is malformed ({exc}): {raw[:200]!r}") from exc
