"""How the chaos runner injects each kind of fault into a running :class:`LoopbackCluster`.

Signals (rank SIGKILL / SIGSTOP, SMP SIGKILL), whole nodes lost and replaced, and faults
armed at named points of ftmem's code (:mod:`ftmem.faults`) that fire when a process
reaches them. Each injection fills in its :class:`Outcome` (what fired where) and returns
when it hit (``time.time()``), or None when it could not be injected (the outcome's
``error`` says why).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace

from ftmem import faults
from tests._support.chaos.cluster import LoopbackCluster
from tests._support.chaos.report import LogWatch, Outcome
from tests._support.chaos.schedule import Kind, ScheduledFault

_RANK_KINDS = (Kind.RANK_KILL, Kind.RANK_STOP, Kind.SAVE_KILL, Kind.RESTORE_KILL)
"""Kinds aimed at one rank (the fault's local rank on its node)."""

Wait = Callable[[Callable[[], bool], float], bool]
"""The runner's poll loop: wait until a condition holds; False after the timeout (s)."""


class Injector:
    """Injects scheduled faults into one faulty run.

    ``wait`` is the runner's poll loop (it also watches the logs and the agents while an
    armed fault has not fired yet); ``timeout_s`` bounds the wait for an armed fault.
    """

    def __init__(
        self, cluster: LoopbackCluster, watch: LogWatch, wait: Wait, timeout_s: float
    ) -> None:
        self.cluster = cluster
        self.watch = watch
        self._wait = wait
        self._timeout_s = timeout_s

    def inject(self, f: ScheduledFault, o: Outcome) -> float | None:
        """Inject ``f``; when it hit (``time.time()``), or None (``o.error`` says why)."""
        node = f.node if f.node is not None else 0
        if f.kind in _RANK_KINDS:
            pids = self.cluster.rank_pids(node)
            if len(pids) <= f.local_rank:
                o.error = f"node {node} has ranks {pids}: no local rank {f.local_rank}"
                return None
            o.rank = sorted(pids)[f.local_rank]
        handler = {
            Kind.RANK_KILL: self._signal_rank,
            Kind.RANK_STOP: self._signal_rank,
            Kind.SMP_KILL: self._kill_smp,
            Kind.NODE_LOSS: self._lose_node,
            Kind.RESTORE_KILL: self._restore_kill,
        }.get(f.kind, self._armed)
        return handler(f, o)

    def _signal_rank(self, f: ScheduledFault, o: Outcome) -> float | None:
        assert o.rank is not None and f.node is not None
        pid = self.cluster.rank_pids(f.node).get(o.rank)
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
        pid = self.cluster.smp_pid(f.node)
        if pid is None:
            o.error = f"node {f.node} has no SMP"
            return None
        o.progress = self.watch.newest()
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        o.fired, o.fired_where = True, f"SMP pid {pid}"
        return t

    def _lose_node(self, f: ScheduledFault, o: Outcome) -> float | None:
        assert f.node is not None
        lost = (f.node, *f.also_lost)
        o.progress = self.watch.newest()
        t = time.time()
        for i in lost:
            self.cluster.lose(i)
        for i in lost:
            self.cluster.start(i)
        o.fired, o.fired_where = True, f"nodes {list(lost)} lost and replaced"
        return t

    def _arm(self, f: ScheduledFault, o: Outcome, point: faults.Point, fault: faults.Fault) -> str:
        fid = f"f{f.index}"
        faults.arm(
            self.cluster.fault_file,
            faults.ArmedFault(
                id=fid,
                point=point,
                fault=fault,
                node=None if f.node is None else self.cluster.node_name(f.node),
                rank=o.rank,
            ),
        )
        return fid

    def _wait_fired(self, fid: str, o: Outcome) -> float | None:
        fault_file = self.cluster.fault_file
        ok = self._wait(lambda: faults.fired(fault_file, fid) is not None, self._timeout_s)
        if not ok and faults.disarm(fault_file, fid):
            o.error = f"armed fault {fid} did not fire within {self._timeout_s} s"
            return None
        info = faults.fired(fault_file, fid) or {}
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
            faults.disarm(self.cluster.fault_file, fid)
            return None
        o.fired = False
        kill_where = o.fired_where
        if self._wait_fired(fid, o) is None:
            return None
        o.fired_where = f"{kill_where}, then {o.fired_where}"
        return t
