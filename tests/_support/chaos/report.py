"""What the chaos runner observes and reports: each rank's progress from the agents' logs,
the agents' event logs, each fault's outcome, and the run's report (table, per-kind summary,
JSON). See docs/chaos.md.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests._support.chaos.schedule import Kind, ScheduledFault
from tests._support.workload import RESUMED_RE, STEP_RE

REBUILT_RE = re.compile(r"REBUILT step (\d+) of this node")
"""An agent whose SMP rebuilt its node's snapshot from its peers."""


@dataclass
class Outcome:
    """What happened to one scheduled fault."""

    fault: ScheduledFault
    rank: int | None = None
    """Global rank of the target (rank kinds)."""
    at_s: float | None = None
    """When it was injected (or fired), seconds since the faulty run started."""
    fired: bool = False
    fired_where: str = ""
    progress: int | None = None
    """Newest step any rank had logged when the fault hit."""
    resumed_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    """Fault -> every rank stepping again (or, disk kinds, -> the node's next good flush)."""
    agent_resumed_s: float | None = None
    """The agents' own detect -> resumed (max over nodes, from their events.jsonl)."""
    note: str = ""
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        d = asdict(self)
        d["fault"] = self.fault.to_json()
        return d


@dataclass
class ChaosReport:
    """The result of a run: the schedule's outcomes and the digest comparison."""

    seed: int | None
    config: dict[str, Any]
    steps: int
    outcomes: list[Outcome] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)
    reference: dict[int, str] = field(default_factory=dict)
    exit_codes: list[int | None] = field(default_factory=list)
    wall_s: float = 0.0
    error: str = ""
    leftovers: str = ""
    workdir: str = ""
    run_ids: list[str] = field(default_factory=list)
    """Run ids of the reference and the faulty run (their shared-memory file prefixes)."""
    log_tails: str = ""
    """(failed runs) The last lines of every agent's log."""

    @property
    def digest_equal(self) -> bool:
        """Every rank ended with the failure-free digest."""
        return bool(self.reference) and self.digests == self.reference

    @property
    def ok(self) -> bool:
        """Every fault fired and was recovered from, the run ended cleanly, digests equal."""
        return (
            not self.error
            and not self.leftovers
            and self.digest_equal
            and all(o.fired and not o.error for o in self.outcomes)
            and all(c == 0 for c in self.exit_codes)
        )

    def by_kind(self) -> dict[str, dict[str, Any]]:
        """Per kind: count, fired, recovery median/max, steps lost in total."""
        out: dict[str, dict[str, Any]] = {}
        for kind in Kind:
            os_ = [o for o in self.outcomes if o.fault.kind is kind]
            if not os_:
                continue
            rec = [o.recovery_s for o in os_ if o.recovery_s is not None]
            agent = [o.agent_resumed_s for o in os_ if o.agent_resumed_s is not None]
            out[kind.value] = {
                "count": len(os_),
                "fired": sum(o.fired for o in os_),
                "recovered": len(rec),
                "recovery_median_s": round(statistics.median(rec), 2) if rec else None,
                "recovery_max_s": round(max(rec), 2) if rec else None,
                "agent_resumed_median_s": round(statistics.median(agent), 2) if agent else None,
                "steps_lost": sum(o.steps_lost or 0 for o in os_),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole report as JSON (``--json``); ``schedule`` replays with ``--schedule``."""
        return {
            "seed": self.seed,
            "config": self.config,
            "steps": self.steps,
            "schedule": [o.fault.to_json() for o in self.outcomes],
            "outcomes": [o.to_json() for o in self.outcomes],
            "by_kind": self.by_kind(),
            "digest_equal": self.digest_equal,
            "digests": {str(k): v for k, v in self.digests.items()},
            "reference": {str(k): v for k, v in self.reference.items()},
            "exit_codes": self.exit_codes,
            "wall_s": round(self.wall_s, 1),
            "error": self.error,
            "leftovers": self.leftovers,
            "ok": self.ok,
        }

    def format(self) -> str:
        """The human-readable report (docs/chaos.md explains each column)."""

        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        lines = [
            f"chaos report: seed {self.seed}, {self.config.get('nodes')} nodes x "
            f"{self.config.get('nproc')} rank(s), m={self.config.get('parity')}, "
            f"{self.steps} steps, {len(self.outcomes)} faults, {self.wall_s:.0f} s",
            f"{'#':>3} {'step':>4} {'at_s':>6} {'kind':<13} {'target':<8} {'rank':>4} "
            f"{'fired':<5} {'recov_s':>7} {'agent_s':>7} {'lost':>4}  note",
        ]
        for o in self.outcomes:
            lines.append(
                f"{o.fault.index:>3} {o.fault.step:>4} {f(o.at_s):>6} {o.fault.kind.value:<13} "
                f"{o.fault.target():<8} {'-' if o.rank is None else o.rank:>4} "
                f"{'yes' if o.fired else 'NO':<5} {f(o.recovery_s):>7} "
                f"{f(o.agent_resumed_s):>7} {'-' if o.steps_lost is None else o.steps_lost:>4}  "
                f"{o.note}{' ERROR: ' + o.error if o.error else ''}"
            )
        lines.append("by kind:")
        lines.append(
            f"  {'kind':<13} {'n':>3} {'fired':>5} {'recov':>5} {'median_s':>8} {'max_s':>6} "
            f"{'agent_med_s':>11} {'lost':>4}"
        )
        for kind, v in self.by_kind().items():
            lines.append(
                f"  {kind:<13} {v['count']:>3} {v['fired']:>5} {v['recovered']:>5} "
                f"{f(v['recovery_median_s']):>8} {f(v['recovery_max_s']):>6} "
                f"{f(v['agent_resumed_median_s']):>11} {v['steps_lost']:>4}"
            )
        rec = [o.recovery_s for o in self.outcomes if o.recovery_s is not None]
        lost = sum(o.steps_lost or 0 for o in self.outcomes)
        if rec:
            lines.append(
                f"recovery: median {statistics.median(rec):.1f} s, max {max(rec):.1f} s over "
                f"{len(rec)} faults; steps lost in total: {lost}"
            )
        if self.digest_equal:
            verdict = f"EQUAL to the failure-free run ({len(self.digests)} ranks)"
        else:
            verdict = f"DIFFERENT: got {self.digests}, failure-free {self.reference}"
        lines.append(f"final digest: {verdict}; agents' exit codes {self.exit_codes}")
        if self.error:
            lines.append(f"RUN FAILED: {self.error}")
        if self.leftovers:
            lines.append(f"LEFT BEHIND: {self.leftovers}")
        if self.workdir:
            lines.append(f"logs: {self.workdir}")
        elif self.log_tails:
            lines.append(f"agents' logs (tails):\n{self.log_tails}")
        lines.append("verdict: " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


@dataclass
class _RankView:
    last_step: int = 0
    resumed_at: float = 0.0
    resumed_step: int | None = None
    steps_since_resume: int = 0
    stepped_at: float = 0.0
    """When its first step after the last resume was seen."""


class LogWatch:
    """Follows every agent's log (ranks' output is tee'd there) and tracks each rank: the
    step it last logged, when (wall clock, as seen here) it last printed ``resumed from``."""

    def __init__(self, world: int) -> None:
        self.ranks = {r: _RankView() for r in range(world)}
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def poll(self, paths: list[Path]) -> None:
        """Read what the logs gained since the last poll."""
        now = time.time()
        for p in paths:
            try:
                with open(p, "rb") as f:
                    f.seek(self._offsets.get(p, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._offsets[p] = self._offsets.get(p, 0) + len(data)
            *lines, rest = (self._partial.pop(p, b"") + data).split(b"\n")
            self._partial[p] = rest
            for raw in lines:
                self._line(raw.decode(errors="replace"), now)

    def _line(self, line: str, now: float) -> None:
        m = STEP_RE.search(line)
        if m:
            r = self.ranks.get(int(m.group(1)))
            if r is not None:
                r.last_step = int(m.group(2))
                r.steps_since_resume += 1
                if r.steps_since_resume == 1:
                    r.stepped_at = now
            return
        m = RESUMED_RE.search(line)
        if m:
            r = self.ranks.get(int(m.group(1)))
            if r is not None:
                r.resumed_at, r.resumed_step = now, int(m.group(2))
                r.last_step, r.steps_since_resume = int(m.group(2)), 0

    def progress(self) -> int:
        """The step every rank has logged (the minimum over ranks)."""
        return min(r.last_step for r in self.ranks.values())

    def newest(self) -> int:
        """The newest step any rank has logged."""
        return max(r.last_step for r in self.ranks.values())

    def stepping_since(self, t: float, steps: int = 1) -> bool:
        """Every rank resumed after ``t`` and has logged ``steps`` steps since."""
        return all(r.resumed_at >= t and r.steps_since_resume >= steps for r in self.ranks.values())

    def restarted_since(self, t: float) -> bool:
        """Some rank printed ``resumed from`` after ``t``."""
        return any(r.resumed_at >= t for r in self.ranks.values())

    def resumed_step_since(self, t: float) -> int | None:
        """The step the ranks resumed from after ``t`` (the minimum), or None."""
        steps = [r.resumed_step for r in self.ranks.values() if r.resumed_at >= t]
        return min((s for s in steps if s is not None), default=None)


def events_since(run_dirs: list[Path], kind: str, t: float) -> list[dict[str, Any]]:
    """Events of ``kind`` written at or after ``t`` in the ``events.jsonl`` of ``run_dirs``."""
    out = []
    for d in run_dirs:
        try:
            text = (d / "events.jsonl").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and ev.get("event") == kind and ev.get("time", 0) >= t:
                out.append(ev)
    return out
