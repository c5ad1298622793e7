"""``ftmem flush`` and ``ftmem assemble``: persist the newest snapshot now, with progress.

``ftmem flush`` asks every SMP given (one run directory per node on this machine) to flush
the same step: ``--step``, or the newest step every rank of every SMP has committed. The
requests run at once, since in a multi-node run the node of rank 0 waits for the other
nodes' parts before it writes the global metadata. While they run, a progress bar per SMP
shows the stage, the tier and the bytes written (the SMPs' status). On other hosts run
``ftmem flush --step N`` there with the same N.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path

from ftmem.protocol import messages as m
from ftmem.protocol.status import FlushRunning

_BAR = 24


def common_step(run_dirs: list[Path]) -> int | None:
    """The newest step committed by every rank of every SMP in ``run_dirs`` (None: none)."""
    from ftmem.protocol.smp_client import SmpClient

    common: set[int] | None = None
    for rd in run_dirs:
        with SmpClient(rd, timeout=timedelta(seconds=10)) as c:
            for rank in c.status().ranks:
                steps = {s.step for s in c.query(rank)}
                common = steps if common is None else common & steps
    return max(common) if common else None


def _bar(running: FlushRunning, tiers: list[str]) -> str:
    where = Path(tiers[running.tier]).name if running.tier < len(tiers) else "?"
    done, total = running.done, running.total
    if done is None or total is None or total <= 0:
        return f"{running.stage} {where}"
    frac = min(1.0, done / total)
    fill = int(frac * _BAR)
    if running.unit == "ranks":
        amount = f"{done}/{total} ranks"
    else:
        amount = f"{done / 2**20:.0f}/{total / 2**20:.0f} MiB"
    return f"{running.stage:<18} [{'#' * fill}{'.' * (_BAR - fill)}] {frac:4.0%} {amount} ({where})"


def run_flush(args: argparse.Namespace) -> int:
    """Flush the same step on every SMP of ``args.run_dir``; print the durable paths."""
    from ftmem.errors import FtmemError
    from ftmem.protocol.smp_client import SmpClient

    run_dirs: list[Path] = list(args.run_dir)
    step = args.step
    if step < 0 and len(run_dirs) > 1:
        try:
            found = common_step(run_dirs)
        except FtmemError as exc:
            print(f"ftmem flush: {exc}", file=sys.stderr)
            return 1
        if found is None:
            print("ftmem flush: no step is committed by every rank", file=sys.stderr)
            return 1
        step = found

    def ask(rd: Path) -> m.FlushReply:
        with SmpClient(rd, timeout=timedelta(seconds=args.timeout)) as c:
            return c.call(m.Flush(step=step, tier=args.tier))

    t0 = time.monotonic()
    shown: dict[Path, str] = {}
    tty = sys.stderr.isatty()
    with ThreadPoolExecutor(len(run_dirs)) as pool:
        asked = [pool.submit(ask, rd) for rd in run_dirs]
        while wait(asked, 0.5).not_done:
            for rd in run_dirs:
                try:
                    with SmpClient(rd, timeout=timedelta(seconds=2)) as c:
                        fl = c.status().flush
                except FtmemError:
                    continue
                running = fl.running
                if running is None:
                    continue
                now = f"{rd.name} step {running.step}: {_bar(running, list(fl.tiers))}"
                if now != shown.get(rd):
                    shown[rd] = now
                    cr = "\r" if tty and len(run_dirs) == 1 else ""
                    print(f"{cr}[{time.monotonic() - t0:6.1f}s] {now}", file=sys.stderr)
    code = 0
    for rd, fut in zip(run_dirs, asked, strict=True):
        try:
            res = fut.result()
        except FtmemError as exc:
            print(f"ftmem flush: {rd}: {exc}", file=sys.stderr)
            code = 1
            continue
        for path in res.paths:
            print(path)
        print(
            f"{rd.name}: step {res.step} durable in {len(res.paths)} tier(s) after {res.seconds} s",
            file=sys.stderr,
        )
    return code


def run_assemble(args: argparse.Namespace) -> int:
    """Assemble the nodes' parts of a step found in ``args.tier`` into one DCP checkpoint."""
    from ftmem.errors import FtmemError
    from ftmem.tiers.assemble import assemble
    from ftmem.tiers.checkpoints import list_checkpoints

    parts = [c for c in list_checkpoints(args.tier, parts=True)[0] if c.is_part]
    if not parts:
        print(f"ftmem assemble: no parts in {args.tier}", file=sys.stderr)
        return 1
    step = args.step if args.step >= 0 else max(c.step for c in parts)
    world = next((c.world_size for c in parts if c.step == step), 0)
    if not world:
        print(f"ftmem assemble: no parts of step {step} in {args.tier}", file=sys.stderr)
        return 1
    try:
        ck = assemble(args.tier, step, world, args.timeout)
    except (FtmemError, OSError) as exc:
        print(f"ftmem assemble: {exc}", file=sys.stderr)
        return 1
    print(ck.path)
    return 0
