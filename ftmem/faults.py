"""Deterministic fault injection at named points of ftmem's code, driven by FTMEM_FAULT.

``FTMEM_FAULT="in_copy:rank=1:step=12"`` SIGKILLs rank 1 inside the copy of step 12's
snapshot (before its commit); ``min_step=12`` instead of ``step=12`` inside the first copy at
or after step 12 (a skipped snapshot has no copy). The fault fires at most once per process.
Faults are real signals to real processes, or real damage to real memory; nothing is mocked.
In an SMP, ``rank`` matches the node index of the peer mesh:
``FTMEM_FAULT="parity_held:rank=2:fault=flip"`` flips a byte of node 2's parity once it has
protected a step; ``in_protect:rank=1:step=5`` SIGKILLs node 1's SMP as it starts protecting
step 5.

**Armed faults (once per run).** ``FTMEM_FAULT_FILE`` names a file of JSON lines
(:class:`ArmedFault`) that every process of a run watches (one ``stat`` at most every
:data:`RECHECK_S`, only when a fault point is passed); a missing field matches anything. The
first process whose point matches claims the fault by creating ``fired-<id>.json`` beside the
file with ``O_EXCL`` (exactly one process wins, across restarts) and fires it. Tests and the
chaos runner use :func:`arm`, :func:`fired` and :func:`disarm` (docs/chaos.md).

Unset (neither variable), each check costs two comparisons.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from ftmem.config import ENV_FAULT, ENV_FAULT_FILE, ENV_NODE
from ftmem.errors import ProtocolError
from ftmem.typed_json import Pattern, loads, parse, to_fields

log = logging.getLogger(__name__)

RECHECK_S = 0.05
"""A process looks at the armed-faults file again at most this often (one ``stat``)."""

_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Point(enum.Enum):
    """Where a fault can be injected."""

    IN_COPY = "in_copy"
    """Inside the background copy of a snapshot, before its commit."""
    BEFORE_COMMIT = "before_commit"
    """After the copy, before the COMMIT is sent."""
    IN_PROTECT = "in_protect"
    """(SMP) A protection round has pinned the step and is about to exchange it."""
    PARITY_HELD = "parity_held"
    """(SMP) A step was just protected: its parity is held in memory."""
    IN_FLUSH = "in_flush"
    """(Flusher) Every file of a checkpoint is written, before the rename that completes it."""
    IN_DCP_WRITE = "in_dcp_write"
    """(Flusher) A data file of a checkpoint is half written: its first tensor is on disk, the
    rest and the metadata are not (``rank``: the file's index; ``fault=enospc``: the disk is full
    there)."""
    IN_ENCODE = "in_encode"
    """(SMP) Inside a protection round: this node has every data column of a stripe it
    encodes and is about to encode it (its peers are waiting for the parity)."""
    IN_HASH = "in_hash"
    """(SMP) A committed slot is about to be checksummed (the snapshot is committed, not yet
    verified)."""
    IN_RESTORE = "in_restore"
    """(Rank) Inside ``ftmem.load``: a snapshot passed its checksums and is about to be
    matched to the state and copied into it (other ranks wait in the agreement)."""
    IN_AGREEMENT = "in_agreement"
    """(Agent) A rendezvous round is complete and this node's agent is about to publish its
    slot offer (``rank``: its group rank; ``step``: the round): a node lost there leaves the
    others waiting for its offer."""
    IN_REJOIN = "in_rejoin"
    """(Rank, ``ftmem.run``) A peer failed, this survivor tore down its process group and
    the agent handed it its new generation; it is about to join it (``step``: the step it
    had restored last)."""


class Fault(enum.Enum):
    """What happens at the point."""

    KILL = "kill"
    STOP = "stop"
    FLIP = "flip"
    """Corrupt data at the point (the caller does it when :func:`maybe_inject` says so)."""
    ENOSPC = "enospc"
    """Fail the write at the point as if the disk were full (the caller raises)."""
    CRASH = "crash"
    """Raise :class:`InjectedCrash` at the point: an unexpected error in the thread that
    passes it (e.g. the SMP's protection thread at ``in_protect``)."""


class InjectedCrash(RuntimeError):
    """The error a ``crash`` fault raises: no code path expects it, as with a real bug."""


@dataclass(frozen=True, slots=True)
class ArmedFault:
    """One armed fault: fires once per run, in the first process whose point matches."""

    id: Annotated[str, Pattern(_ID_RE.pattern)]
    """Unique in the file; names the marker ``fired-<id>.json``."""
    point: Point
    fault: Fault = Fault.KILL
    node: str | None = None
    """Matches the process's ``FTMEM_NODE``; None: any node."""
    rank: int | None = None
    """Matches the point's rank (a rank's global rank; an SMP's mesh index); None: any."""
    step: int | None = None
    """Matches the point's step exactly; None: any."""
    min_step: int | None = None
    """Matches any step at or above; None: any."""

    def __post_init__(self) -> None:
        if not _ID_RE.fullmatch(self.id):
            raise ValueError(f"armed fault id {self.id!r} must match {_ID_RE.pattern}")

    def matches(self, point: Point, node: str | None, rank: int, step: int) -> bool:
        """True if this fault applies to ``point`` passed by ``node``'s ``rank`` at ``step``."""
        return (
            point is self.point
            and (self.node is None or self.node == node)
            and (self.rank is None or self.rank == rank)
            and (self.step is None or self.step == step)
            and (self.min_step is None or step >= self.min_step)
        )

    def to_json(self) -> str:
        """One line of the armed-faults file."""
        doc = {k: v for k, v in to_fields(self).items() if v is not None}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> ArmedFault:
        """Parse one line; raises ValueError (also for unknown points, faults or fields)."""
        try:
            return parse(cls, line, what="armed fault")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None


def _parse(spec: str) -> ArmedFault | None:
    """The fault of an ``FTMEM_FAULT`` value: ``POINT[:rank=R][:step=S][:min_step=S][:fault=F]``
    (None if empty). Raises ValueError on an unknown point, fault or field."""
    if not spec:
        return None
    parts = spec.split(":")
    fields: dict[str, Any] = {"id": "env", "point": Point(parts[0])}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k in ("rank", "step", "min_step"):
            fields[k] = int(v)
        elif k == "fault":
            fields[k] = Fault(v)
        else:
            raise ValueError(f"{ENV_FAULT}: unknown field {k!r}")
    return ArmedFault(**fields)


def marker_path(path: Path, fault_id: str) -> Path:
    """The file whose creation claims armed fault ``fault_id`` of the file ``path``."""
    return path.parent / f"fired-{fault_id}.json"


def arm(path: Path, *faults: ArmedFault) -> None:
    """Add ``faults`` to the armed-faults file ``path`` (tmp + rename: readers never see a
    half-written file). Ids already in the file are refused (ValueError)."""
    old = read_armed(path)
    ids = {a.id for a in old}
    for a in faults:
        if a.id in ids:
            raise ValueError(f"armed fault {a.id!r} is already in {path}")
        ids.add(a.id)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(a.to_json() + "\n" for a in (*old, *faults)))
    os.replace(tmp, path)


def read_armed(path: Path) -> list[ArmedFault]:
    """The faults in ``path`` (none if it does not exist); malformed lines are skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(ArmedFault.from_json(line))
        except ValueError as exc:
            log.warning("%s line %d: ignoring a malformed armed fault: %s", path, n, exc)
    return out


def fired(path: Path, fault_id: str) -> dict[str, Any] | None:
    """What the process that claimed ``fault_id`` wrote (pid, time, point, rank, step...),
    ``{"disarmed": True, ...}`` if :func:`disarm` claimed it, or None if unclaimed."""
    try:
        text = marker_path(path, fault_id).read_text()
    except FileNotFoundError:
        return None
    try:
        doc = loads(text, "a fired fault's record")
    except ProtocolError:
        doc = None  # claimed, its writer died before finishing the record
    return doc if isinstance(doc, dict) else {"id": fault_id, "incomplete": True}


def disarm(path: Path, fault_id: str) -> bool:
    """Claim ``fault_id`` without firing it; True if it had not fired (now it never will)."""
    return _claim(marker_path(path, fault_id), {"id": fault_id, "disarmed": True})


def _claim(marker: Path, record: dict[str, Any]) -> bool:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps({**record, "pid": os.getpid(), "time": time.time()}).encode())
    finally:
        os.close(fd)
    return True


class _ArmedFile:
    """A process's view of the armed-faults file: reloaded when it changes, claims on match."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.node = os.environ.get(ENV_NODE)
        self._lock = threading.Lock()
        self._faults: tuple[ArmedFault, ...] = ()
        self._signature: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._done: set[str] = set()

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._faults, self._signature = (), None
            return
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig != self._signature:
            self._signature = sig
            self._faults = tuple(read_armed(self.path))

    def check(self, point: Point, rank: int, step: int) -> Fault | None:
        """The fault to fire here, once this process has claimed it; else None."""
        with self._lock:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + RECHECK_S
                self._reload()
            for a in self._faults:
                if a.id in self._done or not a.matches(point, self.node, rank, step):
                    continue
                self._done.add(a.id)  # whoever claims it, this process never looks again
                record = {
                    "id": a.id,
                    "point": point.value,
                    "fault": a.fault.value,
                    "node": self.node,
                    "rank": rank,
                    "step": step,
                }
                if _claim(marker_path(self.path, a.id), record):
                    log.warning(
                        "FAULT: armed fault %s fires: %s at %s (node %s, rank %d, step %d)",
                        a.id,
                        a.fault.value,
                        point.value,
                        self.node,
                        rank,
                        step,
                    )
                    return a.fault
            return None


_SPEC: ArmedFault | None = None
_fired = False
_ARMED: _ArmedFile | None = None
_loaded = False


def _load() -> None:
    """Read FTMEM_FAULT and FTMEM_FAULT_FILE: at the first fault point, not at import (a
    process that sets them after importing ftmem, such as a standby that becomes a rank,
    still sees them)."""
    global _SPEC, _ARMED, _loaded
    _SPEC = _parse(os.environ.get(ENV_FAULT, ""))
    path = os.environ.get(ENV_FAULT_FILE)
    _ARMED = _ArmedFile(Path(path)) if path else None
    _loaded = True


def process_rank() -> int:
    """This process's global rank from ``RANK`` (0 if unset): for points that know no rank."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _fire(fault: Fault) -> bool:
    if fault in (Fault.FLIP, Fault.ENOSPC):
        return True
    if fault is Fault.CRASH:
        raise InjectedCrash("FAULT: an injected crash")
    os.kill(os.getpid(), signal.SIGKILL if fault is Fault.KILL else signal.SIGSTOP)
    return False


def maybe_inject(point: Point, rank: int, step: int) -> bool:
    """Fire the configured fault if ``point``, ``rank`` and ``step`` match.

    FTMEM_FAULT fires once per process; an armed fault of FTMEM_FAULT_FILE once per run.
    Returns True when the fault is FLIP or ENOSPC: the caller corrupts its data or fails
    its write there. Raises :class:`InjectedCrash` when the fault is CRASH.
    """
    global _fired
    if not _loaded:
        _load()
    if _SPEC is not None and not _fired and _SPEC.matches(point, None, rank, step):
        _fired = True
        log.warning(
            "FAULT: %s fires: %s at %s (rank %d, step %d)",
            ENV_FAULT,
            _SPEC.fault.value,
            point.value,
            rank,
            step,
        )
        return _fire(_SPEC.fault)
    if _ARMED is not None:
        armed = _ARMED.check(point, rank, step)
        if armed is not None:
            return _fire(armed)
    return False
