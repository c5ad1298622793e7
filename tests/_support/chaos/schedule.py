"""The chaos runner's schedule: fault kinds, one scheduled fault, seeded random schedules.

A schedule is declarative and replayable: :func:`make_schedule` draws it from a seed, it
prints as a table (:func:`format_schedule`) and round-trips through JSON
(:meth:`ScheduledFault.to_json`, :func:`load_schedule`). See docs/chaos.md.
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ftmem import faults


class Kind(enum.Enum):
    """What a scheduled fault does."""

    RANK_KILL = "rank_kill"
    RANK_STOP = "rank_stop"
    SMP_KILL = "smp_kill"
    NODE_LOSS = "node_loss"
    SAVE_KILL = "save_kill"
    PROTECT_KILL = "protect_kill"
    ENCODE_KILL = "encode_kill"
    FLUSH_KILL = "flush_kill"
    FLUSH_ENOSPC = "flush_enospc"
    RESTORE_KILL = "restore_kill"


DESCRIPTIONS = {
    Kind.RANK_KILL: "SIGKILL of a rank",
    Kind.RANK_STOP: "SIGSTOP of a rank (a hang: the launcher's hang timeout kills it)",
    Kind.SMP_KILL: "SIGKILL of a node's SMP",
    Kind.NODE_LOSS: "SIGKILL of a whole node (agent, SMP, ranks, shm), then a replacement",
    Kind.SAVE_KILL: "SIGKILL of a rank inside a save's copy (in_copy) or before its commit",
    Kind.PROTECT_KILL: "SIGKILL of an SMP as an EC round starts (in_protect)",
    Kind.ENCODE_KILL: "SIGKILL of an SMP inside EC encoding, peers waiting (in_encode)",
    Kind.FLUSH_KILL: "SIGKILL of a flush worker inside a flush (in_flush)",
    Kind.FLUSH_ENOSPC: "a full disk inside a flush (in_flush, ENOSPC)",
    Kind.RESTORE_KILL: "SIGKILL of a rank inside ftmem.load (in_restore), after a rank kill",
}
"""One line per kind (docs/chaos.md has the details)."""

_NEEDS_EC = {Kind.NODE_LOSS, Kind.PROTECT_KILL, Kind.ENCODE_KILL}
_NEEDS_FLUSH = {Kind.FLUSH_KILL, Kind.FLUSH_ENOSPC}
DISK_ONLY = _NEEDS_FLUSH
"""Kinds after which the ranks keep training: recovered = the node's next good flush."""


@dataclass(frozen=True, slots=True)
class ScheduledFault:
    """One entry of the schedule: at ``step`` (+ ``delay_s``), on ``node``'s ``local_rank``."""

    index: int
    kind: Kind
    step: int
    """Injected once every rank has logged this step (after the previous fault recovered)."""
    delay_s: float
    """Then this many seconds later (lands the fault at a random point of the step)."""
    node: int | None
    """Node index; None: any node (the first one to reach the point)."""
    local_rank: int = 0
    """The node's rank (index among its ranks) for rank kinds."""
    point: str = ""
    """The fault point for armed kinds (``in_copy`` or ``before_commit`` for saves)."""
    also_lost: tuple[int, ...] = ()
    """(node_loss with m >= 2) more nodes lost at the same moment."""

    def target(self) -> str:
        """``n1/0`` (node and local rank), ``n2`` or ``any``."""
        if self.node is None:
            return "any"
        nodes = "+".join(f"n{n}" for n in (self.node, *self.also_lost))
        if self.kind in (Kind.RANK_KILL, Kind.RANK_STOP, Kind.SAVE_KILL, Kind.RESTORE_KILL):
            return f"{nodes}/{self.local_rank}"
        return nodes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the schedule file's entries)."""
        d = asdict(self)
        d["kind"] = self.kind.value
        d["also_lost"] = list(self.also_lost)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ScheduledFault:
        """Parse :meth:`to_json`'s output (ValueError/KeyError on a malformed entry)."""
        return cls(
            index=int(d["index"]),
            kind=Kind(d["kind"]),
            step=int(d["step"]),
            delay_s=float(d["delay_s"]),
            node=None if d.get("node") is None else int(d["node"]),
            local_rank=int(d.get("local_rank", 0)),
            point=str(d.get("point", "")),
            also_lost=tuple(int(n) for n in d.get("also_lost", ())),
        )


def available_kinds(nodes: int, parity: int, flush_every: int) -> list[Kind]:
    """The kinds a run of this shape can survive (EC kinds need m >= 1; node loss a node
    other than node 0; disk kinds a flush tier)."""
    out = []
    for k in Kind:
        if k in _NEEDS_EC and (parity < 1 or nodes < 3):
            continue
        if k in _NEEDS_FLUSH and flush_every < 1:
            continue
        out.append(k)
    return out


def make_schedule(
    *,
    seed: int,
    faults_n: int,
    nodes: int,
    nproc: int,
    parity: int,
    flush_every: int,
    kinds: list[Kind] | None = None,
    first_step: int = 8,
    gap: tuple[int, int] = (5, 10),
    max_delay_s: float = 0.5,
) -> list[ScheduledFault]:
    """A seeded random schedule of ``faults_n`` faults; every kind appears at least once when
    ``faults_n`` allows it, in a random order. The same arguments give the same schedule."""
    rng = random.Random(seed)
    pool = kinds or available_kinds(nodes, parity, flush_every)
    if not pool:
        raise ValueError("no fault kind fits this run")
    if faults_n >= len(pool):
        picks = list(pool) + [rng.choice(pool) for _ in range(faults_n - len(pool))]
        rng.shuffle(picks)
    else:
        picks = rng.sample(pool, faults_n)
    out: list[ScheduledFault] = []
    step = first_step - gap[0]
    for i, kind in enumerate(picks):
        step += rng.randint(*gap)
        node: int | None = rng.randrange(nodes)
        point = ""
        also: tuple[int, ...] = ()
        if kind is Kind.NODE_LOSS:
            lost = rng.sample(range(1, nodes), min(nodes - 1, rng.randint(1, max(1, parity))))
            node, also = lost[0], tuple(sorted(lost[1:]))
        elif kind is Kind.ENCODE_KILL:
            node = None  # whichever node encodes first (with small snapshots, only some do)
        elif kind is Kind.SAVE_KILL:
            point = rng.choice([faults.Point.IN_COPY.value, faults.Point.BEFORE_COMMIT.value])
        out.append(
            ScheduledFault(
                index=i + 1,
                kind=kind,
                step=step,
                delay_s=round(rng.uniform(0.0, max_delay_s), 2),
                node=node,
                local_rank=rng.randrange(nproc),
                point=point,
                also_lost=also,
            )
        )
    return out


def load_schedule(path: Path) -> tuple[list[ScheduledFault], int | None]:
    """A schedule written by ``--json`` (or a bare list of entries) and its seed."""
    doc = json.loads(path.read_text())
    entries = doc["schedule"] if isinstance(doc, dict) else doc
    seed = doc.get("seed") if isinstance(doc, dict) else None
    return [ScheduledFault.from_json(e) for e in entries], seed


def format_schedule(schedule: list[ScheduledFault]) -> str:
    """The schedule as a table (printed before the run, so a failing seed can be replayed)."""
    lines = [f"{'#':>3} {'step':>4} {'+delay':>6} {'kind':<13} {'target':<8} point"]
    for f in schedule:
        lines.append(
            f"{f.index:>3} {f.step:>4} {f.delay_s:>6.2f} {f.kind.value:<13} {f.target():<8} "
            f"{f.point}"
        )
    return "\n".join(lines)
