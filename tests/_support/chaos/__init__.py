"""The chaos runner: a multi-node run on loopback, a seeded schedule of faults of every kind,
and at the end the digest of a failure-free run.

Usage (from the repository root, ftmem installed; docs/chaos.md explains the report)::

    python -m tests._support.chaos --nodes 3 --faults 10 --seed 7
    python -m tests._support.chaos --nodes 4 --faults 100 --seed 1 --json report.json
    python -m tests._support.chaos --schedule report.json     # replay a printed schedule

It starts ``--nodes`` ``ftmem-launch`` agents (:class:`~.cluster.LoopbackCluster`,
``--nproc-per-node`` ranks each, erasure coding with ``--parity`` (m) when there are 3+
nodes, disk tiers in its work directory) training the test workload
(:mod:`tests._support.workload`), and injects the schedule one fault at a time. A fault is ``(step, delay, node, rank) -> kind``: once every
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

Layout: this module is the public face and the CLI (``__main__.py`` runs it); config.py
(:class:`ChaosConfig`), schedule.py (kinds, seeded schedules), runner.py (:class:`ChaosRunner`:
the runs, the waits, each recovery), inject.py (how each kind is injected), report.py (what
the runner observes, the report) and cluster.py (the nodes on loopback).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

from tests._support.chaos.config import ChaosConfig, RunFailed
from tests._support.chaos.report import ChaosReport, Outcome
from tests._support.chaos.runner import ChaosRunner
from tests._support.chaos.schedule import (
    DESCRIPTIONS,
    Kind,
    ScheduledFault,
    available_kinds,
    format_schedule,
    load_schedule,
    make_schedule,
)

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


def get_args_parser() -> argparse.ArgumentParser:
    """The ``python -m tests._support.chaos`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m tests._support.chaos", description=__doc__.split("\n")[0]
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
