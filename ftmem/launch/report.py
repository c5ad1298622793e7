"""One log line per failure and per recovery, and the final report.

Every line starts with ``[node/rank]``; the same events go to the JSON-lines event log
(:class:`ftmem.launch.monitor.EventLog`) so a timeline can be plotted.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ftmem.launch.monitor import EventLog, RankProcess, current_progress
from ftmem.protocol.status import RankProgress

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Recovery:
    """A failure being recovered from: when it was detected and what it was."""

    detected: float
    """``time.time()`` of the detection."""
    what: str
    committed: int | None
    """The node's newest step committed by all its ranks at the detection."""
    stopped: float | None = None
    """When elastic had stopped the surviving ranks (None: no rank failure, e.g. membership)."""
    rendezvous: float | None = None
    """When the new rendezvous round completed."""
    started: float | None = None
    """When the new ranks were started (spawned or handed to standbys)."""


def restart_phases(
    rec: Recovery, times: list[tuple[float | None, float | None, float | None]]
) -> dict[str, float | None]:
    """Split a recovery into its phases, in seconds (pure; a phase not measured is None).

    ``times`` holds, per rank of the node, when it first spoke to the SMP (``ftmem.load``
    called: the script's imports, process group and model are behind it), when its restore
    was done, and its first progress after the restore. Each phase ends when the slowest
    rank ends it: detect -> stop (survivors stopped) -> rendezvous -> start (ranks spawned or
    handed to standbys) -> script (-> ``ftmem.load`` called) -> load -> first step.
    """

    def latest(i: int) -> float | None:
        values = [t[i] for t in times]
        if not values or any(v is None for v in values):
            return None
        return max(v for v in values if v is not None)

    marks = [
        ("stop", rec.stopped),
        ("rendezvous", rec.rendezvous),
        ("start", rec.started),
        ("script", latest(0)),
        ("load", latest(1)),
        ("first_step", latest(2)),
    ]
    out: dict[str, float | None] = {}
    prev: float | None = rec.detected
    for name, end in marks:
        out[name] = None if end is None or prev is None else round(end - prev, 4)
        prev = end
    return out


def tail_lines(path: str | None, lines: int = 20) -> list[str]:
    """The last ``lines`` lines of a file (empty if there is none)."""
    if not path or not os.path.isfile(path):
        return []
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in f.readlines()[-lines:]]
    except OSError:
        return []


def report_resumed(
    node: str,
    generation: int,
    rec: Recovery,
    procs: list[RankProcess],
    progress: dict[int, RankProgress],
    events: EventLog,
) -> None:
    """Log (and record) that every local rank reported progress again after a failure.

    The resume moment is the newest of the ranks' progress reports at the poll that saw
    them all (the 0.1 s polling during a recovery bounds the error); it is split into
    detect -> spawn (stop, rendezvous, SMP restart) and spawn -> stepping (start-up,
    ``import torch``, ``ftmem.load``, the first step).
    """
    times = [current_progress(p, progress.get(p.rank)) for p in procs]
    resumed = max(t for t in times if t is not None)
    reported = [progress.get(p.rank) for p in procs]
    mine = [
        r if r is not None and r.pid == p.pid else None
        for p, r in zip(procs, reported, strict=True)
    ]
    phase_times = [
        (r.hello_time, r.restored_time, r.first_progress_time)
        if r is not None
        else (None, None, None)
        for r in mine
    ]
    phases = restart_phases(rec, phase_times)
    firsts = [t[2] for t in phase_times]
    if all(t is not None for t in firsts):
        resumed = max(t for t in firsts if t is not None)
    spawned = min(p.start_time for p in procs)
    steps = [progress[p.rank].last_progress_step for p in procs if p.rank in progress]
    first = min((s for s in steps if s is not None), default=None)
    restored_steps = sorted(
        {r.restored_step for r in mine if r is not None and r.restored_step is not None}
    )
    restored: int | str | None = (
        restored_steps[0]
        if len(restored_steps) == 1
        else (str(restored_steps) if restored_steps else None)
    )
    total = resumed - rec.detected
    log.warning(
        "[%s] RESUMED after %s: generation %d, %d local rank(s) restored step %s and are "
        "stepping again (step %s when seen; newest committed before the failure, as last "
        "seen: %s); detect->resumed %.2f s "
        "(detect->spawn %.2f s, spawn->stepping %.2f s; phases: %s)",
        node,
        rec.what,
        generation,
        len(procs),
        restored,
        first,
        rec.committed,
        total,
        spawned - rec.detected,
        resumed - spawned,
        ", ".join(f"{k} {v:.2f} s" for k, v in phases.items() if v is not None) or "n/a",
    )
    events.write(
        "resumed",
        after=rec.what,
        generation=generation,
        step=first,
        restored_step=restored,
        committed_before=rec.committed,
        detect_to_resumed_s=round(total, 3),
        detect_to_spawn_s=round(spawned - rec.detected, 3),
        spawn_to_stepping_s=round(resumed - spawned, 3),
        phases=phases,
    )


def report_started(
    node: str,
    generation: int,
    procs: list[RankProcess],
    events: EventLog,
    *,
    from_standby: list[int],
    in_process: list[int],
    **fields: object,
) -> None:
    """Log (and record, ``ranks_started``) a generation's ranks started: their pids, those
    handed to standbys and those that rejoined in process; ``fields`` go to the event."""
    events.write(
        "ranks_started",
        generation=generation,
        ranks=[p.rank for p in procs],
        pids=[p.pid for p in procs],
        from_standby=from_standby,
        in_process=in_process,
        **fields,
    )
    log.info(
        "[%s] generation %d: started ranks %s (pids %s%s%s)",
        node,
        generation,
        [p.rank for p in procs],
        [p.pid for p in procs],
        f"; from standbys: ranks {from_standby}" if from_standby else "",
        f"; rejoined in process: ranks {in_process}" if in_process else "",
    )


def log_joining(node: str, settings: object | None) -> None:
    """``joining the rendezvous``, with the node range and join timeout of the c10d/etcd-v2
    handler's ``settings`` (None: another handler)."""
    if settings is None:
        log.info("[%s] joining the rendezvous", node)
        return
    log.info(
        "[%s] joining the rendezvous: %d-%d nodes, join timeout %.0f s",
        node,
        getattr(settings, "min_nodes", 0),
        getattr(settings, "max_nodes", 0),
        settings.timeout.join.total_seconds(),  # type: ignore[attr-defined]
    )


def record_standbys(events: EventLog, event: str, standbys: list[Any], **fields: object) -> None:
    """Record standby ranks that started (``standbys_started``) or are warm
    (``standbys_ready``, with their warm-up times), if any."""
    if not standbys:
        return
    if event == "standbys_ready":
        fields["warm_up_s"] = [round(s.warm_up_s, 3) for s in standbys]
    events.write(
        event,
        **fields,
        pids=[s.pid for s in standbys],
        local_ranks=[s.local_rank for s in standbys],
    )
