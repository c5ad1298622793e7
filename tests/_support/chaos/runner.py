"""The chaos runner's loop: a reference run, the faulty run, and the schedule injected into
it one fault at a time, each recovery measured before the next (see :mod:`tests._support.chaos`).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from ftmem import faults
from ftmem.protocol.status import ProtectionStatus
from tests._support.chaos.cluster import ClusterConfig, LoopbackCluster
from tests._support.chaos.config import ChaosConfig, RunFailed
from tests._support.chaos.inject import Injector
from tests._support.chaos.report import (
    REBUILT_RE,
    ChaosReport,
    LogWatch,
    Outcome,
    events_since,
)
from tests._support.chaos.schedule import DISK_ONLY, Kind, ScheduledFault
from tests._support.workload import digests

log = logging.getLogger(__name__)


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
        self._injector: Injector | None = None
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
        self._injector = Injector(cluster, self.watch, self._wait, c.recovery_timeout_s)
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
            self._cluster = self._injector = None

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
        assert self._injector is not None, "no faulty run"
        t = self._injector.inject(f, o)
        if t is None:
            return
        o.at_s = round(t - self._t0, 2)
        if f.kind in DISK_ONLY:
            self._wait_flushed(f, o, t)
        else:
            self._wait_recovered(o, t)

    def _protected(self) -> bool:
        """Every node's SMP holds a protected step no older than the last resume."""
        cluster = self._require_cluster()
        floor = min((r.resumed_step or 0) for r in self.watch.ranks.values())
        for i in cluster.agents:
            ex = self._protection_status(i)
            p = None if ex is None else ex.protected_step
            if p is None or p < floor:
                return False
        return True

    def _protection_status(self, i: int) -> ProtectionStatus | None:
        """Node ``i``'s exchange status, typed (None: its SMP did not answer, or sent a
        malformed one)."""
        st = self._require_cluster().status(i)
        return None if st is None else st.protection

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
            last = None if st is None else st.flush.last_step
            if last is not None and last > d.step:
                self._disk.remove(d)
                d.outcome.recovery_s = round(time.time() - d.t, 2)
                d.outcome.note = f"flush of step {d.step} failed; step {last} flushed next"
                log.info("fault %d: %s", d.outcome.fault.index, d.outcome)
