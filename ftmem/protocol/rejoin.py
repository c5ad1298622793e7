"""The orders ``ftmem-launch`` gives its ranks: :class:`RejoinOrder`, which takes a rank that
survived a failure into the next generation in process, and :class:`ReshardRequest`
(``$FTMEM_RESHARD``), which asks a generation whose world size changed to reshard a step.

At a restart, ``ftmem-launch`` keeps the ranks that run under :func:`ftmem.run` alive and
writes each of them a :class:`RejoinOrder`: the environment elastic would have given a new
process for that rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_*``, ``FTMEM_GENERATION``, ...). The rank, which tore down its process group
when a collective failed, waits for an order of a newer generation than its own, applies it
to ``os.environ`` and joins the new process group.

The order is a JSON file in the run directory (``<run_dir>/rejoin/rank-<R>.json``, mode
0600 in a 0700 directory, written to a temporary name and renamed, so a reader sees it whole
or not at all). A reader opens it without following symbolic links, checks that it is this
user's and private, bounds its size and validates every field: nothing else in the file is
trusted, and nothing is unpickled.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftmem.config import ENV_RESHARD
from ftmem.errors import ProtocolError
from ftmem.secure_fs import ensure_private_dir, open_owned

REJOIN_DIR = "rejoin"
MAX_ORDER_BYTES = 1 << 20
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True, slots=True)
class RejoinOrder:
    """Join generation ``generation`` as global rank ``rank`` with ``env`` applied."""

    generation: int
    rank: int
    env: dict[str, str]
    """Environment variables to set in the rank (elastic's per-rank ones and ftmem's)."""
    agent_pid: int
    """The agent that wrote the order (the rank's parent)."""
    stdout: str = ""
    """The new generation's log file for the rank's stdout ("" : keep the current one)."""
    stderr: str = ""
    """The same for stderr."""

    def __post_init__(self) -> None:
        for name in ("generation", "rank", "agent_pid"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProtocolError(f"rejoin order: {name} must be an int >= 0, not {value!r}")
        if not isinstance(self.env, dict):
            raise ProtocolError("rejoin order: env must be an object")
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise ProtocolError(f"rejoin order: bad variable name {key!r}")
            if not isinstance(value, str) or "\0" in value:
                raise ProtocolError(f"rejoin order: variable {key} must be a string")
        for name in ("stdout", "stderr"):
            value = getattr(self, name)
            if not isinstance(value, str) or "\0" in value or (value and value[0] != "/"):
                raise ProtocolError(f"rejoin order: {name} must be an absolute path or empty")

    def to_json(self) -> bytes:
        """The order as the bytes of its file."""
        doc = {
            "generation": self.generation,
            "rank": self.rank,
            "env": self.env,
            "agent_pid": self.agent_pid,
            "stdout": self.stdout,
            "stderr": self.stderr,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> RejoinOrder:
        """Parse and validate an order; raise :class:`ProtocolError` on anything unexpected."""
        try:
            doc: Any = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(f"rejoin order is not JSON: {exc}") from None
        if not isinstance(doc, dict) or set(doc) != set(_FIELDS):
            raise ProtocolError(f"rejoin order: expected exactly the fields {', '.join(_FIELDS)}")
        return RejoinOrder(**{name: doc[name] for name in _FIELDS})


_FIELDS = ("generation", "rank", "env", "agent_pid", "stdout", "stderr")


def order_path(run_dir: Path, rank: int) -> Path:
    """Where the order for global rank ``rank`` is written."""
    return run_dir / REJOIN_DIR / f"rank-{int(rank)}.json"


def write_order(run_dir: Path, order: RejoinOrder) -> Path:
    """Write ``order`` for its rank, replacing an older one atomically; return the path."""
    directory = run_dir / REJOIN_DIR
    ensure_private_dir(directory, "rejoin directory")
    path = order_path(run_dir, order.rank)
    tmp = directory / f".{path.name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(order.to_json())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
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

    world_size: int
    """The world size the step was saved at."""
    step: int | None = None
    """The step to load (None: the newest one every old rank holds)."""
    run_dirs: tuple[Path, ...] = ()
    """SMP run directories on this host besides the rank's own (one that rebuilt a lost
    machine's snapshots)."""

    def to_env(self) -> str:
        """The value of ``$FTMEM_RESHARD`` that :func:`requested` reads back."""
        return json.dumps(
            {
                "world_size": self.world_size,
                "step": self.step,
                "run_dirs": list(map(str, self.run_dirs)),
            }
        )


def requested() -> ReshardRequest | None:
    """The launcher's request to reshard (``$FTMEM_RESHARD``), or None.

    Raises:
        ProtocolError: the variable is set but malformed.
    """
    raw = os.environ.get(ENV_RESHARD, "")
    if not raw:
        return None
    try:
        doc = json.loads(raw)
        world, step, dirs = doc["world_size"], doc.get("step"), doc.get("run_dirs", [])
        if type(world) is not int or world < 1:
            raise ValueError("world_size is not a positive integer")
        if step is not None and (type(step) is not int or step < 0):
            raise ValueError("step is not a non-negative integer")
        if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
            raise ValueError("run_dirs is not a list of paths")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"${ENV_RESHARD} is malformed ({exc}): {raw[:200]!r}") from exc
    return ReshardRequest(world, step, tuple(Path(d) for d in dirs))
