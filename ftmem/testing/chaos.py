"""The chaos runner: a multi-node run on loopback, a seeded schedule of faults of every kind,
and at the end the digest of a failure-free run.

Usage (ftmem installed; docs/chaos.md explains the report)::

    python -m ftmem.testing.chaos --nodes 3 --faults 10 --seed 7
    python -m ftmem.testing.chaos --nodes 4 --faults 100 --seed 1 --json report.json
    python -m ftmem.testing.chaos --schedule report.json     # replay a printed schedule

It starts ``--nodes`` ``ftmem-launch`` agents (:class:`~ftmem.testing.cluster.LoopbackCluster`,
``--nproc-per-node`` ranks each, erasure coding with ``--parity`` (m) when there are 3+
nodes, disk tiers in its work directory) training the package's own workload
(:mod:`ftmem.testing.workload`: no repository checkout needed), and injects the
schedule one fault at a time. A fault is ``(step, delay, node, rank) -> kind``: once every
rank has logged step ``step``, wait ``delay`` seconds (so faults land at random points of a
step: inside a copy, an EC round, a flush), inject, then wait until the run has recovered
(every rank stepping again, or for disk faults the node's next good flush) before the next
fault, so the run can survive each one (never more than m nodes down; a node is lost only
once every node holds a protected step). Node 0 hosts the rendezvous store, a single point
of failure by torch's design, so it is never lost as a whole (its ranks and SMP are).

Kinds (:class:`Kind`): rank SIGKILL, rank SIGSTOP (a hang, found by the launcher's
``--ftmem-hang-timeout``), SMP SIGKILL, whole node SIGKILL + replacement agent, and faults
at named points of ftmem's code armed once per run through ``FTMEM_FAULT_FILE``
(:mod:`ftmem.faults`): inside a save's copy or before its commit, at the start of an
EC round, inside EC encoding, inside a flush (kill, or a full disk: ENOSPC), inside a
restore. The report gives, per fault, when it fired, the recovery time (fault -> every rank
stepping again, as the runner saw it in the logs, and the agents' own detect -> resumed from
their ``events.jsonl``), the steps lost, and at the end whether the final digest equals a
failure-free run's of the same world size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from ftmem import faults
from ftmem.testing._chaos_report import (
    REBUILT_RE,
    ChaosReport,
    LogWatch,
    Outcome,
    digests,
    events_since,
)
from ftmem.testing._chaos_schedule import (
    DESCRIPTIONS,
    DISK_ONLY,
    Kind,
    ScheduledFault,
    available_kinds,
    format_schedule,
    load_schedule,
    make_schedule,
)
from ftmem.testing.cluster import ClusterConfig, LoopbackCluster
from ftmem.testing.workload import SCRIPT

__all__ = [
    "DESCRIPTIONS",
    "ChaosConfig",
    "ChaosReport",
    "ChaosRunner",
    "Kind",
    "Outcome",
    "RunFailed",
    "ScheduledFault",
    "available_kinds",
    "format_schedule",
    "load_schedule",
    "main",
    "make_schedule",
]

log = logging.getLogger(__name__)

TINY_MODEL = [
    "--d-model=32",
    "--n-layers=1",
    "--n-heads=2",
    "--vocab=64",
    "--seq-len=16",
    "--batch-size=2",
    "--log-every=1",
]
"""Model arguments for ``examples/train_gpt.py`` as ``script`` (``model_args``): tens of
milliseconds per step on one core. The default workload's own defaults are as small."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """Shape of a chaos run (the CLI's flags)."""

    nodes: int = 3
    """``ftmem-launch`` agents (nodes) of the faulty run."""
    nproc: int = 1
    """Ranks per node."""
    parity: int = 1
    """Erasure coding's m (0: off); needs at least m + 2 nodes."""
    flush_every: int = 5
    """``--ftmem-flush-every`` (0: no disk tiers, no disk faults)."""
    hang_timeout_s: float = 5.0
    """``--ftmem-hang-timeout``: how long a SIGSTOPped rank goes unnoticed."""
    step_delay_s: float = 0.2
    """The script's ``--step-delay``: time for the runner to act within a step."""
    tail_steps: int = 15
    """Steps trained after the last fault's step (room for the last faults' recovery and
    for the flushes that show that the disk faults were recovered from)."""
    model_args: list[str] = field(default_factory=list)
    """More arguments of the script (its model's size: e.g. :data:`TINY_MODEL` for
    ``examples/train_gpt.py``)."""
    script: Path = SCRIPT
    """The training script: by default the package's workload
    (:data:`ftmem.testing.workload.SCRIPT`). It must take ``--steps``, ``--pg-timeout`` and
    ``--step-delay``, print ``[rank R] resumed from step N``, log ``[rank R] <logger> INFO:
    step N loss`` every step and end with ``[rank R] digest``."""
    recovery_timeout_s: float = 300.0
    """Longest wait for one fault to fire and the run to recover (else the run fails)."""
    timeout_s: float = 3600.0
    """Longest whole run (reference run included)."""
    reference: dict[int, str] | None = None
    """Digests of a failure-free run of the same world size (None: run one first)."""
    workdir: Path | None = None
    """Where everything goes (default: a new /tmp/chaos-* directory)."""
    keep: bool | None = None
    """Keep the work directory (logs, events, disk tiers) after the run: always (True),
    never (False), or only when the run failed (None)."""
    agent_args: list[str] = field(default_factory=list)
    """More ``ftmem-launch`` arguments."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nproc < 1 or self.parity < 0 or self.flush_every < 0:
            raise ValueError("nodes and nproc must be >= 1, parity and flush_every >= 0")
        if self.parity > 0 and self.nodes < self.parity + 2:
            raise ValueError(f"m={self.parity} needs at least {self.parity + 2} nodes")
        if self.recovery_timeout_s <= 0 or self.timeout_s <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def world(self) -> int:
        """Ranks in the run."""
        return self.nodes * self.nproc


@dataclass
class _DiskCheck:
    """A disk fault whose recovery (the node's next good flush) is still to be seen."""

    outcome: Outcome
    node: int
    step: int
    """The step whose flush failed."""
    t: float
    checked: bool = False
    """Whether the ranks kept training until the next fault was checked."""


class RunFailed(Exception):
    """The faulty run cannot go on (an agent exited, a wait ran out): the report says why."""


class ChaosRunner:
    """Runs one schedule against one faulty run (see the module docstring).

    Resource handling: :meth:`run` owns every process it starts; it stops them all (and
    removes the runs' shared memory) before returning, whatever happened (also on
    KeyboardInterrupt), and empties or removes the work directory as ``config.keep`` says
    (default: kept, and named in the report, only when the run failed).
    Error handling: nothing is raised for a fault that misbehaves or a run that fails; the
    report says what happened (:attr:`ChaosReport.error`, each :class:`Outcome`).
    """

    def __init__(
        self, config: ChaosConfig, schedule: list[ScheduledFault], seed: int | None = None
    ) -> None:
        self.config = config
        self.schedule = schedule
        self.seed = seed
        self.steps = max([f.step for f in schedule], default=0) + config.tail_steps
        self.watch = LogWatch(config.world)
        self._cluster: LoopbackCluster | None = None
        self._t0 = 0.0
        self._deadline = 0.0
        self._disk: list[_DiskCheck] = []
        """Disk faults whose recovery (the node's next good flush) is not seen yet."""
        self._next_disk_poll = 0.0
        self._schedule_done = False
        self._tails = ""
        self.run_ids: list[str] = []
        """Run ids this runner used (reference, faulty run)."""

    # -- the run ---------------------------------------------------------------------------
    def script(self, delay: bool = True) -> list[str]:
        """The script's command line (``--step-delay`` only for the faulty run)."""
        args = [str(self.config.script), f"--steps={self.steps}", "--pg-timeout=120"]
        if delay and self.config.step_delay_s > 0:
            args.append(f"--step-delay={self.config.step_delay_s}")
        return [*args, *self.config.model_args]

    def run(self) -> ChaosReport:
        """Run the reference (unless given), the faulty run and the schedule; the report."""
        c = self.config
        made = c.workdir is None
        self._tails = ""
        workdir = c.workdir or Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
        report = ChaosReport(
            seed=self.seed,
            config={k: v for k, v in asdict(c).items() if k not in ("reference", "workdir")},
            steps=self.steps,
            workdir=str(workdir),
        )
        report.config["script"] = str(c.script)
        report.run_ids = self.run_ids
        start = time.monotonic()
        self._deadline = start + c.timeout_s
        try:
            report.reference = c.reference or self._reference(workdir / "ref")
            self._faulty_run(workdir, report)
        except RunFailed as exc:
            report.error = str(exc)
        except KeyboardInterrupt:
            report.error = "interrupted"
        finally:
            report.wall_s = time.monotonic() - start
            if not report.ok:
                report.log_tails = self._tails
            keep = c.keep if c.keep is not None else not report.ok
            if not keep:
                if made:
                    shutil.rmtree(workdir, ignore_errors=True)
                else:
                    self._clean(workdir)
                report.workdir = ""
        return report

    @staticmethod
    def _clean(workdir: Path) -> None:
        """Empty a work directory the caller gave (it stays, empty)."""
        for p in workdir.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _reference(self, workdir: Path) -> dict[int, str]:
        """Digests of a failure-free single-node run with the same world size."""
        workdir.mkdir(parents=True)
        cfg = ClusterConfig(
            workdir=workdir, nodes=1, nproc=self.config.world, parity=0, script=self.script(False)
        )
        cluster = LoopbackCluster(cfg)
        self.run_ids.append(cluster.run_id)
        try:
            agent = cluster.start(0)
            code = agent.wait(timedelta(seconds=max(1.0, self._deadline - time.monotonic())))
            text = agent.text()
        finally:
            alive, left = cluster.close()
        if code != 0 or alive or left:
            raise RunFailed(
                f"the reference run failed (exit {code}, left {alive} {left}):\n{text[-3000:]}"
            )
        ref = digests(text)
        if len(ref) != self.config.world:
            raise RunFailed(f"the reference run printed digests of {sorted(ref)} only")
        log.info("reference digests: %s", ref)
        return ref

    def _faulty_run(self, workdir: Path, report: ChaosReport) -> None:
        c = self.config
        cfg = ClusterConfig(
            workdir=workdir,
            nodes=c.nodes,
            nproc=c.nproc,
            parity=c.parity,
            flush_every=c.flush_every,
            hang_timeout=c.hang_timeout_s,
            script=self.script(),
            extra_args=["--ftmem-status-interval=0.5", *c.agent_args],
        )
        cluster = self._cluster = LoopbackCluster(cfg)
        self.run_ids.append(cluster.run_id)
        try:
            cluster.start_all()
            self._t0 = time.time()
            report.outcomes = [Outcome(f, note="not reached") for f in self.schedule]
            for outcome in report.outcomes:
                fault, outcome.note = outcome.fault, ""
                log.info("fault %d/%d: %s", fault.index, len(self.schedule), fault)
                self._one(fault, outcome)
                if fault.kind not in DISK_ONLY:
                    log.info("fault %d: %s", fault.index, outcome)
            self._schedule_done = True
            self._wait(lambda: not self._disk or self._all_exited(), c.recovery_timeout_s)
            for d in self._disk:
                d.outcome.error = f"node {d.node} flushed no step after the failed one ({d.step})"
            self._finish(report)
        finally:
            self._tails = "\n".join(
                f"--- {a.name} ({a.log_path.name}) ---\n" + "\n".join(a.text().splitlines()[-60:])
                for a in cluster.all_agents
            )
            alive, left = cluster.close()
            if alive or left:
                report.leftovers = f"processes {sorted(alive)}, shm files {left}"
            self._cluster = None

    def _finish(self, report: ChaosReport) -> None:
        cluster = self._require_cluster()
        for i in sorted(cluster.agents):
            left = max(1.0, self._deadline - time.monotonic())
            report.exit_codes.append(cluster.agents[i].wait(timedelta(seconds=left)))
        for i in sorted(cluster.agents):
            text = cluster.agents[i].text()
            report.digests.update(digests(text))
        if any(code != 0 for code in report.exit_codes):
            tails = "\n".join(
                f"--- {a.name} ---\n{a.text()[-2000:]}" for a in cluster.agents.values()
            )
            raise RunFailed(f"agents exited with {report.exit_codes}:\n{tails}")

    # -- waiting ---------------------------------------------------------------------------
    def _require_cluster(self) -> LoopbackCluster:
        assert self._cluster is not None, "no faulty run"
        return self._cluster

    def _poll(self) -> None:
        cluster = self._require_cluster()
        self.watch.poll([a.log_path for a in cluster.all_agents])
        for i, agent in cluster.agents.items():
            code = agent.poll()
            if code is None or (code == 0 and self._schedule_done):
                continue
            if code == 0:
                raise RunFailed(
                    f"the run finished before the schedule did (node {i}'s agent exited 0): "
                    "faults landed later than their steps; use a larger --gap"
                )
            raise RunFailed(
                f"node {i}'s agent exited with {code} during the schedule; "
                f"tail:\n{agent.text()[-3000:]}"
            )
        if time.monotonic() > self._deadline:
            raise RunFailed(f"the run took longer than {self.config.timeout_s} s")
        if self._disk and time.monotonic() >= self._next_disk_poll:
            self._next_disk_poll = time.monotonic() + 0.5
            self._check_disk()

    def _wait(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        """Poll (logs, agents) until ``cond()``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._poll()
            if cond():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def _all_exited(self) -> bool:
        return all(a.poll() is not None for a in self._require_cluster().agents.values())

    def _pause(self, seconds: float) -> None:
        self._wait(lambda: False, seconds)

    # -- one fault -------------------------------------------------------------------------
    def _one(self, f: ScheduledFault, o: Outcome) -> None:
        c = self.config
        if not self._wait(lambda: self.watch.progress() >= f.step, c.recovery_timeout_s):
            raise RunFailed(f"fault {f.index}: the run never reached step {f.step}")
        if f.kind is Kind.NODE_LOSS and not self._wait(self._protected, c.recovery_timeout_s):
            raise RunFailed(f"fault {f.index}: no step protected on every node, cannot lose one")
        self._pause(f.delay_s)
        if self.watch.newest() >= self.steps - 2:
            raise RunFailed(
                f"fault {f.index} would land in the run's last steps ({self.watch.newest()} of "
                f"{self.steps}): faults landed later than their steps; use a larger --gap"
            )
        for d in self._disk:  # a disk fault must not stop the ranks (until the next fault)
            if not d.checked and self.watch.restarted_since(d.t):
                d.outcome.error = "the ranks restarted after a disk fault"
            d.checked = True
        cluster = self._require_cluster()
        node = f.node if f.node is not None else 0
        if f.kind in (Kind.RANK_KILL, Kind.RANK_STOP, Kind.SAVE_KILL, Kind.RESTORE_KILL):
            pids = cluster.rank_pids(node)
            if len(pids) <= f.local_rank:
                o.error = f"node {node} has ranks {pids}: no local rank {f.local_rank}"
                return
            o.rank = sorted(pids)[f.local_rank]
        handler = {
            Kind.RANK_KILL: self._signal_rank,
            Kind.RANK_STOP: self._signal_rank,
            Kind.SMP_KILL: self._kill_smp,
            Kind.NODE_LOSS: self._lose_node,
            Kind.RESTORE_KILL: self._restore_kill,
        }.get(f.kind, self._armed)
        t = handler(f, o)
        if t is None:
            return
        o.at_s = round(t - self._t0, 2)
        if f.kind in DISK_ONLY:
            self._wait_flushed(f, o, t)
        else:
            self._wait_recovered(o, t)

    def _signal_rank(self, f: ScheduledFault, o: Outcome) -> float | None:
        cluster = self._require_cluster()
        assert o.rank is not None and f.node is not None
        pid = cluster.rank_pids(f.node).get(o.rank)
        if pid is None:
            o.error = f"rank {o.rank} is not running"
            return None
        o.progress = self.watch.newest()
        t = time.time()
        sig = signal.SIGKILL if f.kind is Kind.RANK_KILL else signal.SIGSTOP
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            o.error = f"rank {o.rank} (pid {pid}) was gone"
            return None
        o.fired, o.fired_where = True, f"pid {pid} {sig.name}"
        return t

    def _kill_smp(self, f: ScheduledFault, o: Outcome) -> float | None:
        assert f.node is not None
        pid = self._require_cluster().smp_pid(f.node)
        if pid is None:
            o.error = f"node {f.node} has no SMP"
            return None
        o.progress = self.watch.newest()
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        o.fired, o.fired_where = True, f"SMP pid {pid}"
        return t

    def _lose_node(self, f: ScheduledFault, o: Outcome) -> float | None:
        cluster = self._require_cluster()
        assert f.node is not None
        lost = (f.node, *f.also_lost)
        o.progress = self.watch.newest()
        t = time.time()
        for i in lost:
            cluster.lose(i)
        for i in lost:
            cluster.start(i)
        o.fired, o.fired_where = True, f"nodes {list(lost)} lost and replaced"
        return t

    def _arm(self, f: ScheduledFault, o: Outcome, point: faults.Point, fault: faults.Fault) -> str:
        cluster = self._require_cluster()
        fid = f"f{f.index}"
        faults.arm(
            cluster.fault_file,
            faults.ArmedFault(
                id=fid,
                point=point,
                fault=fault,
                node=None if f.node is None else cluster.node_name(f.node),
                rank=o.rank,
            ),
        )
        return fid

    def _wait_fired(self, fid: str, o: Outcome) -> float | None:
        cluster = self._require_cluster()
        ok = self._wait(
            lambda: faults.fired(cluster.fault_file, fid) is not None,
            self.config.recovery_timeout_s,
        )
        if not ok and faults.disarm(cluster.fault_file, fid):
            o.error = f"armed fault {fid} did not fire within {self.config.recovery_timeout_s} s"
            return None
        info = faults.fired(cluster.fault_file, fid) or {}
        o.fired = True
        o.fired_where = (
            f"{info.get('point')} on {info.get('node')} rank {info.get('rank')} "
            f"step {info.get('step')} pid {info.get('pid')}"
        )
        return float(info.get("time", time.time()))

    def _armed(self, f: ScheduledFault, o: Outcome) -> float | None:
        point = {
            Kind.SAVE_KILL: faults.Point(f.point or faults.Point.IN_COPY.value),
            Kind.PROTECT_KILL: faults.Point.IN_PROTECT,
            Kind.ENCODE_KILL: faults.Point.IN_ENCODE,
            Kind.FLUSH_KILL: faults.Point.IN_FLUSH,
            Kind.FLUSH_ENOSPC: faults.Point.IN_FLUSH,
        }[f.kind]
        fault = faults.Fault.ENOSPC if f.kind is Kind.FLUSH_ENOSPC else faults.Fault.KILL
        fid = self._arm(f, o, point, fault)
        t = self._wait_fired(fid, o)
        o.progress = self.watch.newest()
        return t

    def _restore_kill(self, f: ScheduledFault, o: Outcome) -> float | None:
        """Arm in_restore for the target rank, then SIGKILL it: its restart's load dies."""
        fid = self._arm(f, o, faults.Point.IN_RESTORE, faults.Fault.KILL)
        t = self._signal_rank(replace(f, kind=Kind.RANK_KILL), o)
        if t is None:
            faults.disarm(self._require_cluster().fault_file, fid)
            return None
        o.fired = False
        kill_where = o.fired_where
        if self._wait_fired(fid, o) is None:
            return None
        o.fired_where = f"{kill_where}, then {o.fired_where}"
        return t

    def _protected(self) -> bool:
        """Every node's SMP holds a protected step no older than the last resume."""
        cluster = self._require_cluster()
        floor = min((r.resumed_step or 0) for r in self.watch.ranks.values())
        for i in cluster.agents:
            st = cluster.status(i)
            p = None if st is None else st.get("exchange", {}).get("protected_step")
            if not isinstance(p, int) or p < floor:
                return False
        return True

    def _wait_recovered(self, o: Outcome, t: float) -> None:
        """Wait until every rank resumed after ``t`` and logged 2 steps since."""
        if not self._wait(
            lambda: self.watch.stepping_since(t, steps=2), self.config.recovery_timeout_s
        ):
            raise RunFailed(
                f"fault {o.fault.index} ({o.fault.kind.value}): the ranks were not all "
                f"stepping again within {self.config.recovery_timeout_s} s"
            )
        # The moment the last rank logged its first step after resuming, as seen here.
        o.recovery_s = round(max(r.stepped_at for r in self.watch.ranks.values()) - t, 2)
        o.resumed_step = self.watch.resumed_step_since(t)
        if o.progress is not None and o.resumed_step is not None:
            o.steps_lost = max(0, o.progress - o.resumed_step)
        cluster = self._require_cluster()
        dirs = list(cluster.config.workdir.glob("n*-rd"))
        agent = [
            float(e["detect_to_resumed_s"])
            for e in events_since(dirs, "resumed", t)
            if isinstance(e.get("detect_to_resumed_s"), (int, float))
        ]
        o.agent_resumed_s = round(max(agent), 2) if agent else None
        if o.fault.kind is Kind.NODE_LOSS:
            notes = []
            for i in (o.fault.node, *o.fault.also_lost):
                if i is None:
                    continue
                m = REBUILT_RE.search(cluster.agents[i].text())
                notes.append(f"n{i} rebuilt step {m.group(1)}" if m else f"n{i} not rebuilt")
            o.note = ", ".join(notes)

    def _wait_flushed(self, f: ScheduledFault, o: Outcome, t: float) -> None:
        """(disk kinds) Note the failed flush; :meth:`_check_disk` sees the node's next good
        flush while the schedule goes on (the ranks keep training: nothing to wait for)."""
        info = faults.fired(self._require_cluster().fault_file, f"f{f.index}") or {}
        assert f.node is not None
        o.steps_lost = 0
        self._disk.append(_DiskCheck(o, f.node, int(info.get("step", 0) or 0), t))

    def _check_disk(self) -> None:
        cluster = self._require_cluster()
        for d in list(self._disk):
            st = cluster.status(d.node, timeout=timedelta(seconds=1))
            last = None if st is None else st.get("flush", {}).get("last_step")
            if isinstance(last, int) and last > d.step:
                self._disk.remove(d)
                d.outcome.recovery_s = round(time.time() - d.t, 2)
                d.outcome.note = f"flush of step {d.step} failed; step {last} flushed next"
                log.info("fault %d: %s", d.outcome.fault.index, d.outcome)


def get_args_parser() -> argparse.ArgumentParser:
    """The ``python -m ftmem.testing.chaos`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m ftmem.testing.chaos", description=__doc__.split("\n")[0]
    )
    p.add_argument("--nodes", type=int, default=3, help="ftmem-launch agents (nodes)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    p.add_argument("--faults", type=int, default=10, help="faults in the schedule")
    p.add_argument("--seed", type=int, default=None, help="schedule seed (default: random)")
    p.add_argument("--parity", type=int, default=1, help="erasure-coding m (0: off)")
    p.add_argument(
        "--kinds",
        default="",
        help=f"comma-separated kinds (default: all that fit): {[k.value for k in Kind]}",
    )
    p.add_argument(
        "--gap",
        default="5:10",
        help="steps between faults, MIN:MAX (a fault lands a few steps after its step: "
        "an armed point is reached later, recovery needs 2 steps; gaps absorb that)",
    )
    p.add_argument("--first-step", type=int, default=8, help="step of the first fault")
    p.add_argument("--flush-every", type=int, default=5, help="flush every N steps (0: off)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="--ftmem-hang-timeout (s)")
    p.add_argument("--step-delay", type=float, default=0.2, help="script's --step-delay (s)")
    p.add_argument("--recovery-timeout", type=float, default=300.0, help="per fault (s)")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="whole run (s)")
    p.add_argument("--schedule", type=Path, default=None, help="replay this JSON schedule")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    p.add_argument(
        "--keep",
        action="store_true",
        default=None,
        help="keep the work directory (default: only when the run failed)",
    )
    p.add_argument("--print-schedule", action="store_true", help="print the schedule and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the chaos runner from the command line; 0 if the report's verdict is OK."""
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    lo, _, hi = args.gap.partition(":")
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    config = ChaosConfig(
        nodes=args.nodes,
        nproc=args.nproc_per_node,
        parity=args.parity if args.nodes >= 3 else 0,
        flush_every=args.flush_every,
        hang_timeout_s=args.hang_timeout,
        step_delay_s=args.step_delay,
        recovery_timeout_s=args.recovery_timeout,
        timeout_s=args.timeout,
        keep=args.keep,
    )
    if args.schedule is not None:
        schedule, seed = load_schedule(args.schedule)
    else:
        kinds = [Kind(k) for k in args.kinds.split(",") if k] or None
        schedule = make_schedule(
            seed=seed,
            faults_n=args.faults,
            nodes=config.nodes,
            nproc=config.nproc,
            parity=config.parity,
            flush_every=config.flush_every,
            kinds=kinds,
            first_step=args.first_step,
            gap=(int(lo), int(hi or lo)),
        )
    print(f"chaos schedule (seed {seed}; replay: --seed {seed} with the same flags):")
    print(format_schedule(schedule), flush=True)
    if args.print_schedule:
        return 0
    report = ChaosRunner(config, schedule, seed).run()
    print(report.format(), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
