"""``ftmem timeline``'s reading of a run's event logs.

Reads, from every run directory given (one per node), the agent's ``events.jsonl`` and the
SMP's ``smp-events.jsonl`` (format in docs/api.md), and turns them into *marks*
(:func:`marks_of`, pure): each commit, protection and flush of a step; each failure, its
detection, the restart of the ranks, the restore of a step and the resume of training.
:func:`format_summary` prints them as text; :mod:`ftmem.observe.timeline_plot` draws them.

Lines that are not JSON objects with a numeric ``time`` and a string ``event`` are skipped and
counted, never fatal: a log cut short by a killed process still draws.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from ftmem.errors import ProtocolError
from ftmem.events import AGENT_EVENTS_NAME, SMP_EVENTS_NAME, previous
from ftmem.typed_json import Pattern, build

log = logging.getLogger(__name__)

FAILURE_EVENTS = frozenset({"failed", "hang", "smp_died", "protection_failed", "unrecoverable"})
"""Agent events that are a failure of this node (their time is the detection)."""
_INFO_EVENTS = frozenset(
    {
        "smp_start",
        "smp_stop",
        "standbys_started",
        "standbys_ready",
        "sync",
        "rebuild_failed",
        "protect_failed",
        "peers_synced",
        "peers_failed",
        "stall",
        "fenced",
        "dropped",
        "store_unreachable",
        "store_reachable",
        "reshape_failed",
    }
)
"""Events listed by ``--text`` but not drawn."""


@dataclass(frozen=True, slots=True)
class Event:
    """One parsed line of an event log."""

    time: float
    node: str
    event: str
    source: str
    """``agent`` (events.jsonl) or ``smp`` (smp-events.jsonl)."""
    fields: dict[str, Any]


@dataclass(slots=True)
class Loaded:
    """What :func:`read_events` found."""

    events: list[Event] = field(default_factory=list)
    malformed: int = 0
    """Lines skipped because they were not a valid event."""
    files: list[Path] = field(default_factory=list)
    """The files read."""
    missing: list[Path] = field(default_factory=list)
    """Paths given that held no event log."""


@dataclass(frozen=True, slots=True)
class Mark:
    """Something to draw: a category at a time on a node's lane."""

    time: float
    node: str
    category: str
    label: str
    step: int | None = None
    rank: int | None = None
    start: float | None = None
    """For spans (a hang, a recovery): when it began."""
    data: dict[str, Any] = field(default_factory=dict)
    """The event's fields (commits: ``stall_s``, ``copy_s``, ``bytes``...)."""


@dataclass(frozen=True, slots=True)
class _Head:
    """What every event line holds (its other fields are the event's own)."""

    time: float
    event: Annotated[str, Pattern(r"(?s).+")]
    node: Any = None


def parse_line(line: str, source: str, default_node: str) -> Event | None:
    """Parse one line of an event log; None if it is not a valid event (pure)."""
    line = line.strip()
    if not line:
        return None
    try:
        doc = json.loads(line)
        head = build(_Head, doc, strict=False)
    except (ValueError, RecursionError, ProtocolError):
        return None
    fields = {k: v for k, v in doc.items() if k not in ("time", "event", "node")}
    return Event(
        head.time, str(head.node) if head.node else default_node, head.event, source, fields
    )


def _source_of(path: Path) -> str:
    return "smp" if path.name.startswith("smp-") else "agent"


def read_events(paths: Iterable[Path]) -> Loaded:
    """Read the event logs of run directories (or event-log files), oldest event first.

    A directory contributes its ``events.jsonl`` and ``smp-events.jsonl``, each after its
    older part (``.1``, :func:`ftmem.events.previous`) if the log was begun again; a file is
    read as is. Unreadable files are logged and counted as missing; bad lines are counted.
    """
    out = Loaded()
    for path in paths:
        logs = (path / AGENT_EVENTS_NAME, path / SMP_EVENTS_NAME)
        files = (
            [f for current in logs for f in (previous(current), current) if f.is_file()]
            if path.is_dir()
            else [path]
        )
        if not files:
            out.missing.append(path)
        for f in files:
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                log.warning("cannot read %s: %s", f, exc)
                out.missing.append(f)
                continue
            out.files.append(f)
            node = f.parent.name if path.is_dir() else f.stem
            for line in text.splitlines():
                ev = parse_line(line, _source_of(f), node)
                if ev is None:
                    out.malformed += bool(line.strip())
                else:
                    out.events.append(ev)
    out.events.sort(key=lambda e: e.time)
    return out


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def finite_number(v: Any) -> float | None:
    """``v`` as a float if it is a finite int or float (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def _mark(e: Event, category: str, label: str, **kw: Any) -> Mark:
    kw.setdefault("time", e.time)
    kw.setdefault("step", _int(e.fields.get("step")))
    kw.setdefault("rank", _int(e.fields.get("rank")))
    return Mark(node=e.node, category=category, label=label, **kw)


def _failure_marks(e: Event) -> list[Mark]:
    f = e.fields
    what = {
        "failed": f"rank {f.get('rank')}: {f.get('what')}",
        "hang": f"rank {f.get('rank')} hung (last step {f.get('last_step')})",
        "smp_died": f"SMP pid {f.get('pid')} died",
        "protection_failed": f"protection thread stopped: {f.get('error')}",
        "unrecoverable": f"unrecoverable: {f.get('reason')}",
    }[e.event]
    idle = finite_number(f.get("idle_s")) if e.event == "hang" else None
    onset = e.time - idle if idle is not None else e.time
    committed = _int(f.get("committed"))
    return [
        _mark(e, "failure", what, time=onset, step=committed),
        _mark(e, "detection", f"detected: {what}", start=onset, step=committed),
    ]


def marks_of(events: Sequence[Event]) -> list[Mark]:
    """Turn events into marks (pure; events oldest first). Unknown events are left out."""
    out: list[Mark] = []
    started: set[str] = set()
    smp_up: set[str] = set()
    for e in events:
        f, k = e.fields, e.event
        if k == "smp_start" and e.node in smp_up:
            label = "a new SMP started: the previous one ended without smp_stop (killed?)"
            out.append(_mark(e, "failure", label))
        if k == "smp_start":
            smp_up.add(e.node)
        elif k == "smp_stop":
            smp_up.discard(e.node)
        if k == "committed":
            out.append(_mark(e, "commit", f"rank {f.get('rank')} step {f.get('step')}", data=f))
        elif k in ("protected", "flushed"):
            out.append(_mark(e, k, f"step {f.get('step')} {k}", data=f))
        elif k in FAILURE_EVENTS:
            out += _failure_marks(e)
        elif k == "restart":
            label = f"restart ({f.get('reason')}): another node failed, left or joined"
            out.append(_mark(e, "failure", label, step=_int(f.get("committed"))))
        elif k == "no_progress_stop":
            out.append(_mark(e, "stop", f"stopped: {f.get('reason')}"))
        elif k == "machine_lost":
            label = (
                f"machine {f.get('peer')} lost: no rendezvous keep-alive for {f.get('bound_s')} s"
            )
            out.append(_mark(e, "failure", label))
        elif k in ("not_enough_machines", "store_lost"):
            out.append(_mark(e, "stop", f"stopped: {k.replace('_', ' ')} {_brief(f)}".rstrip()))
        elif k == "state":
            out.append(_mark(e, "info", f"agent {f.get('previous')} -> {f.get('state')}"))
        elif k == "ranks_started":
            cat = "restart" if e.node in started else "start"
            started.add(e.node)
            standby = f.get("from_standby")
            extra = f", from standbys: ranks {standby}" if standby else ""
            kept = f.get("in_process")
            extra += f", rejoined in process: ranks {kept}" if kept else ""
            out.append(_mark(e, cat, f"ranks started (generation {f.get('generation')}{extra})"))
        elif k == "discard_newer":
            out.append(_mark(e, "restore", f"rank {f.get('rank')} restored step {f.get('step')}"))
        elif k == "reshape":
            grows = (_int(f.get("new_nodes")) or 0) > (_int(f.get("old_nodes")) or 0)
            how = "grows" if grows else "shrinks"
            lost = f.get("lost")
            label = f"the job {how}: {f.get('old_nodes')} -> {f.get('new_nodes')} nodes" + (
                f" (lost slots {lost})" if lost else ""
            )
            out.append(_mark(e, "restart", label))
        elif k == "rebuilt_lost":
            label = (
                f"lost slots' step {f.get('step')} rebuilt by the survivors in "
                f"{f.get('seconds')} s (guests here: {f.get('slots')})"
            )
            out.append(_mark(e, "restore", label))
        elif k == "rebuilt":
            label = f"rebuilt step {f.get('step')} from peers in {f.get('seconds')} s"
            out.append(_mark(e, "restore", label))
        elif k == "resumed":
            total = finite_number(f.get("detect_to_resumed_s"))
            raw = f.get("phases")
            phases: dict[str, Any] = raw if isinstance(raw, dict) else {}
            split = ", ".join(
                f"{k} {v:.2f} s" for k, v in phases.items() if finite_number(v) is not None
            )
            label = (
                f"at step {f.get('step')} after {f.get('after')}: detect->resumed {total} s "
                f"(detect->spawn {f.get('detect_to_spawn_s')} s, "
                f"spawn->stepping {f.get('spawn_to_stepping_s')} s)"
                + (f"; phases: {split}" if split else "")
            )
            start = None if total is None else e.time - total
            out.append(_mark(e, "resume", label, start=start, data=f))
        elif k in _INFO_EVENTS:
            out.append(_mark(e, "info", f"{k.replace('_', ' ')} {_brief(f)}".rstrip()))
    out.sort(key=lambda m: m.time)  # a hang's onset lies before its detection
    return out


def _brief(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, "", [], {}))[:120]


def since_filter(marks: Sequence[Mark], t0: float, since: float | None) -> list[Mark]:
    """Marks at or after ``t0 + since`` (``since`` < 0: the last ``-since`` seconds)."""
    if since is None or not marks:
        return list(marks)
    cut = t0 + since if since >= 0 else max(m.time for m in marks) + since
    return [m for m in marks if m.time >= cut]


@dataclass(slots=True)
class NodeSummary:
    """Per-node figures of :func:`summarize`."""

    node: str
    first: float
    last: float
    commits: int = 0
    ranks: set[int] = field(default_factory=set)
    steps: list[int] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    copy_s: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    protected: list[int] = field(default_factory=list)
    flushed: list[int] = field(default_factory=list)
    incidents: list[Mark] = field(default_factory=list)
    """Every other mark (starts, failures, detections, restarts, restores, resumes, the
    SMP's start, stop and sync), in time order."""


def summarize(marks: Sequence[Mark]) -> dict[str, NodeSummary]:
    """Per-node counts and figures of ``marks`` (pure)."""
    out: dict[str, NodeSummary] = {}
    for m in marks:
        s = out.setdefault(m.node, NodeSummary(m.node, m.time, m.time))
        s.first, s.last = min(s.first, m.time), max(s.last, m.time)
        if m.category == "commit":
            s.commits += 1
            if m.rank is not None:
                s.ranks.add(m.rank)
            if m.step is not None:
                s.steps.append(m.step)
            for key, dst in (("stall_s", s.stall_s), ("copy_s", s.copy_s)):
                v = finite_number(m.data.get(key))
                if v is not None:
                    dst.append(v)
            n = _int(m.data.get("bytes"))
            if n is not None:
                s.nbytes.append(n)
        elif m.category == "protected" and m.step is not None:
            s.protected.append(m.step)
        elif m.category == "flushed" and m.step is not None:
            s.flushed.append(m.step)
        else:
            s.incidents.append(m)
    return out


def _med_ms(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values) * 1e3:.2f} ms, max {max(values) * 1e3:.2f} ms"


def _steps(values: list[int]) -> str:
    return f"{len(values)} (steps {min(values)}-{max(values)})" if values else "0"


def format_summary(loaded: Loaded, marks: Sequence[Mark], t0: float) -> str:
    """The text of ``ftmem timeline --text``: per node, counts, then every incident in order."""
    lines = [
        f"{len(loaded.files)} file(s), {len(loaded.events)} events, "
        f"{loaded.malformed} malformed line(s) skipped"
        + (f"; no event log in: {', '.join(map(str, loaded.missing))}" if loaded.missing else "")
    ]
    for node, s in sorted(summarize(marks).items()):
        lines.append("")
        lines.append(f"node {node}: {s.first - t0:.2f} s to {s.last - t0:.2f} s")
        ranks = ",".join(map(str, sorted(s.ranks))) or "-"
        lines.append(f"  commits: {s.commits} by ranks {ranks}, {_steps(sorted(set(s.steps)))}")
        if s.commits:
            mib = statistics.median(s.nbytes) / 2**20 if s.nbytes else 0.0
            lines.append(
                f"  stall in save: {_med_ms(s.stall_s)}; background copy: {_med_ms(s.copy_s)}; "
                f"{mib:.1f} MiB per snapshot (median)"
            )
        lines.append(f"  protected: {_steps(s.protected)}; flushed: {_steps(s.flushed)}")
        for m in s.incidents:
            lines.append(f"  {m.time - t0:9.2f} s  {m.category.upper():<9}  {m.label}")
    return "\n".join(lines)
