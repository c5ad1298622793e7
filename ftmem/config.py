"""Settings of ftmem's components as dataclasses, and every environment variable in one place."""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

# Environment variables ftmem reads (the launcher sets the first four for its ranks).
ENV_RUN_DIR = "FTMEM_RUN_DIR"  # the SMP's run directory; holds smp.sock
ENV_RUN_ID = "FTMEM_RUN_ID"  # names the run (shared-memory names, default run dir)
ENV_NODE = "FTMEM_NODE"  # names this node
ENV_GENERATION = "FTMEM_GENERATION"  # restart generation common to all nodes (informational)
ENV_REQUEST_TIMEOUT = "FTMEM_REQUEST_TIMEOUT"  # seconds a rank waits for an SMP reply
ENV_SHARD = "FTMEM_SHARD"
"""``0`` turns sharded snapshots of replicated state off (default on)."""
ENV_ALLOW_FRESH_START = "FTMEM_ALLOW_FRESH_START"  # "1": load returns 0 if ranks disagree
ENV_CHECKFREE = "FTMEM_CHECKFREE"
"""``1`` (set by ``ftmem-launch --ftmem-checkfree``): rebuild a lost pipeline stage from its
neighbours when no snapshot of it is left (ftmem.client.checkfree)."""
ENV_EXPECTED_STEP = "FTMEM_EXPECTED_STEP"  # set by ftmem-launch: the step the node had committed
ENV_AGENT_PID = "FTMEM_AGENT_PID"  # set by ftmem-launch: the agent's pid (the ranks' parent)
ENV_REJOIN_TIMEOUT = (
    "FTMEM_REJOIN_TIMEOUT"  # set by ftmem-launch: ftmem.run's wait for a new generation
)
ENV_LOG_LEVEL = "FTMEM_LOG_LEVEL"  # log level of the ftmem CLIs and the SMP
ENV_FAULT = "FTMEM_FAULT"  # testing only: a fault to inject (see ftmem.faults)
ENV_FAULT_FILE = "FTMEM_FAULT_FILE"
"""Testing only: the armed-faults file (JSON lines) every process of a run watches."""
ENV_FLUSH_DIRS = "FTMEM_FLUSH_DIRS"  # disk tiers, nearest first, ":"-separated (load's fallback)
ENV_TIER_KEY_FILE = "FTMEM_TIER_KEY_FILE"
"""The key that signs every checkpoint's manifest (default ``~/.config/ftmem/tier.key``)."""
ENV_RESHARD = "FTMEM_RESHARD"
"""Set by ftmem-launch when the job's world size changed: JSON of the step to reshard from
memory (:class:`ftmem.protocol.rejoin.ReshardRequest`)."""
ENV_SHM_DIR = "FTMEM_SHM_DIR"
"""The private directory (mode 0700) holding the slot files and their commit records
(default ``/dev/shm/ftmem-<uid>``); ``python -m ftmem.smp --shm-dir`` overrides it."""

SOCKET_NAME = "smp.sock"
GUEST_DIR_PREFIX = "guest-"
"""A guest SMP's run directory inside its host agent's: ``guest-<lost slot>`` (ftmem-launch
makes them after a shrink; a rank's resharding load reads the live ones)."""
AUTH_KEY_NAME = "auth.key"
READY_NAME = "smp.ready"

NAME_PATTERN = r"[A-Za-z0-9_.-]{1,64}"
"""What a run id or node name may be (no ``@``: see :func:`check_name`)."""
_NAME_RE = re.compile(NAME_PATTERN)


def default_run_id() -> str:
    """Return the run id from FTMEM_RUN_ID, else TORCHELASTIC_RUN_ID, else ``"default"``."""
    rid = os.environ.get(ENV_RUN_ID) or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", rid)[:64]


def _private_runtime_dir() -> Path | None:
    """``$XDG_RUNTIME_DIR`` if it is set and, as its specification demands, a directory of
    this user with mode 0700 (not a symlink); else None."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not xdg or not os.path.isabs(xdg):
        return None
    try:
        st = os.lstat(xdg)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return Path(xdg)


def user_base_dir() -> Path:
    """This user's private directory for run directories and locks: ``$XDG_RUNTIME_DIR/ftmem``
    when the runtime directory is private, else ``/tmp/ftmem-<uid>`` (created 0700 and
    checked by whoever uses it)."""
    runtime = _private_runtime_dir()
    return runtime / "ftmem" if runtime else Path("/tmp") / f"ftmem-{os.getuid()}"


def default_shm_dir() -> Path:
    """Return FTMEM_SHM_DIR (made absolute) if set, else ``/dev/shm/ftmem-<uid>``: this user's
    private directory (mode 0700) for slot files (checked by the SMP and the ranks,
    :mod:`ftmem.shm`)."""
    env = os.environ.get(ENV_SHM_DIR)
    if env:
        return Path(env).absolute()
    return Path("/dev/shm") / f"ftmem-{os.geteuid()}"


MAX_SLOT_BYTES = 1 << 40
"""The largest slot (1 TiB): a request, record or manifest naming a larger one is refused."""

MAX_SOCKET_PATH = 100
"""Longest path of a Unix socket (``sun_path`` holds 108 bytes; some systems 104)."""


def default_run_dir(run_id: str | None = None, node: str | None = None) -> Path:
    """The one rule for a run directory: under :func:`user_base_dir`, ``<run_id>`` or, for one
    node of a launched job, ``<run_id>-<node>``, shortened from the left so that its socket's
    path fits :data:`MAX_SOCKET_PATH`. Without a node, FTMEM_RUN_DIR (what ``ftmem-launch``
    gives its ranks) comes first. The SMP creates it private
    (:func:`ftmem.secure_fs.prepare_private_dir`)."""
    env = os.environ.get(ENV_RUN_DIR)
    if env and node is None:
        return Path(env)
    base = user_base_dir()
    rid = run_id or default_run_id()
    name = rid if node is None else f"{rid[:24]}-{node}"
    room = MAX_SOCKET_PATH - len(str(base)) - len(SOCKET_NAME) - 2
    return base / name[-max(room, 8) :]


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a safe name for files and shared memory, else raise ValueError.

    Run ids and node names are 1-64 of ``[A-Za-z0-9_.-]``: never ``@``, which separates
    them in slot file names and lock names, so each name maps back to one run and node."""
    if not _NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} must match {NAME_PATTERN}")
    return value


@dataclass(kw_only=True, slots=True)
class SmpConfig:
    """Settings of one snapshot management process (SMP)."""

    run_dir: Path
    """Directory (made 0700) holding the SMP's socket, key and readiness files."""
    run_id: str = "default"
    """Names the run; part of every shared-memory file name."""
    node: str = "node0"
    """Names this node; part of every shared-memory file name."""
    slots: int = 2
    """Snapshot slots per rank (>= 2): one being written while the newest committed is kept."""
    max_message_bytes: int = 16 << 20
    """Largest message accepted on the rank socket; larger ones are dropped by ZeroMQ."""
    shm_dir: Path = field(default_factory=default_shm_dir)
    """This user's private directory (on a tmpfs) of the slot files and commit records
    (:func:`default_shm_dir`); the SMP refuses to start if it is not private."""
    parent_pid: int | None = None
    """If set, the SMP exits (cleaning up) when this process is gone."""
    adopt: bool = True
    """At start, serve again the committed slots a killed SMP of this run and node left in
    shm_dir (their commit records are checked; data checksums are checked at load)."""
    poll_interval: timedelta = timedelta(milliseconds=100)
    """How often the loop wakes up to check signals, the parent and finished allocations."""
    flush_tiers: list[Path] = field(default_factory=list)
    """Disk tiers to flush to, node-local first then persistent; empty: no flushing."""
    flush_shared: bool = False
    """The last of ``flush_tiers`` is shared by every node (multi-node: parts assembled there)."""
    flush_every: int = 0
    """Flush every this many steps in the background (0: only when ``ftmem flush`` asks)."""
    flush_keep: int = 2
    """Complete checkpoints kept per tier."""
    flush_writers: int = 2
    """Data files the flush writes in parallel (a thread and an I/O thread each)."""
    flush_direct: bool = True
    """The flush writes with O_DIRECT where the file system allows it (else buffered)."""
    flush_on_stop: timedelta = timedelta(seconds=60)
    """On SIGTERM (preemption), time allowed for a final flush of the newest step."""
    hash_threads: int = 0
    """Threads that checksum committed slots (xxh3 releases the GIL); 0: half the cores this
    process may run on, at most 8 (:func:`hash_threads_for`). A slot stays held until its
    snapshot is checked, so more threads let saves follow each other sooner."""

    def __post_init__(self) -> None:
        check_name("run_id", self.run_id)
        check_name("node", self.node)
        self.shm_dir = self.shm_dir.absolute()  # ranks get it in the HELLO reply
        if self.slots < 2:
            raise ValueError(f"slots must be >= 2, got {self.slots}")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be >= 4096")
        if not 0 <= self.hash_threads <= 64:
            raise ValueError(f"hash_threads must be in [0, 64], got {self.hash_threads}")

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint ranks connect to."""
        return f"ipc://{self.run_dir / SOCKET_NAME}"


def hash_threads_for(setting: int) -> int:
    """The SMP's hashing threads for ``SmpConfig.hash_threads`` (0: half the cores this
    process may run on, at least 1, at most 8)."""
    if setting > 0:
        return setting
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (its factory's value), for the
    command lines that set it."""
    f = {x.name: x for x in dataclasses.fields(cls)}[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


def env_seconds(name: str, default: float) -> timedelta:
    """Seconds from environment variable ``name`` (``default`` if unset or empty).

    Raises:
        ValueError: not a number, or not > 0.
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return timedelta(seconds=default)
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from exc
    if value <= 0:
        raise ValueError(f"{name} must be > 0")
    return timedelta(seconds=value)


@dataclass(kw_only=True, slots=True)
class ClientConfig:
    """Settings of the client that runs in each training rank."""

    run_dir: Path = field(default_factory=default_run_dir)
    """The SMP's run directory (FTMEM_RUN_DIR)."""
    request_timeout: timedelta = field(
        default_factory=lambda: env_seconds(ENV_REQUEST_TIMEOUT, 30.0)
    )
    """Longest wait for one SMP reply (FTMEM_REQUEST_TIMEOUT); a dead SMP is noticed sooner."""
    prepare_timeout: timedelta = timedelta(seconds=600)
    """Longest wait for the SMP to create and pre-fault a rank's arena (first save, resize)."""
    fence_timeout: timedelta = timedelta(seconds=300)
    """Longest wait at the optimizer fence for a copy; past it the snapshot is abandoned."""
    final_save_timeout: timedelta = timedelta(seconds=120)
    """``wait()``/``close()``: longest wait for a slot (held by a flush or a protection round,
    or still being allocated) to commit the newest step when its save was skipped."""
    allow_fresh_start: bool = field(
        default_factory=lambda: os.environ.get(ENV_ALLOW_FRESH_START, "") == "1"
    )
    """If ranks disagree (some have a snapshot, some none), start fresh instead of raising."""
    shard_replicated: bool = field(default_factory=lambda: os.environ.get(ENV_SHARD, "1") != "0")
    """Under data parallelism each replica saves only its share of the replicated state
    (FTMEM_SHARD=0: off)."""
    arena_headroom: float = 0.10
    """Extra fraction allocated over the first snapshot's size, so small growth needs no resize."""
    flush_dirs: list[Path] = field(
        default_factory=lambda: [
            Path(p) for p in os.environ.get(ENV_FLUSH_DIRS, "").split(":") if p.strip()
        ]
    )
    """Disk tiers (nearest first) ``load`` falls back to when memory cannot serve every rank."""

    def __post_init__(self) -> None:
        if self.arena_headroom < 0:
            raise ValueError("arena_headroom must be >= 0")
