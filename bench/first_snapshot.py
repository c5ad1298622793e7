"""First snapshots of a large state: how long the training loop is held up, and when the first
snapshot is safe. ftmem (a snapshot every step from step 1, a fresh SMP) against the first
``dcp.async_save`` of the same state (a fresh stager), alternating in one run.

    python bench/first_snapshot.py                          # 2 GiB, 3 runs each
    python bench/first_snapshot.py --size-gib 0.5 --runs 1 --out /tmp/b.md

Each run builds the state (``nn.Linear`` layers with AdamW state, as bench/snapshot.py) and
takes ``--steps`` steps of ``--fwd-bwd-s`` (a sleep: the cores stay free for the background
work) plus a real ``optimizer.step()``. Figures per run: the longest step and the steps held
up by more than 50 ms over the run's median step, the longest ``save()`` call, and the time
from the first save call to the first snapshot committed (ftmem) or written (DCP).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/first_snapshot.py

import torch

from bench import _baselines as baselines
from bench import _render, _results

logger = logging.getLogger("bench.first_snapshot")

HELD_UP_S = 0.05
"""A step is held up when it takes this much longer than the run's median step."""


def _step(state: baselines.BenchState, fwd_bwd_s: float) -> None:
    time.sleep(fwd_bwd_s)
    state.optimizer.step()


def _loop(
    state: baselines.BenchState,
    steps: int,
    fwd_bwd_s: float,
    save: Callable[[int], None],
    is_safe: Callable[[], bool],
    wait_safe: Callable[[], bool],
) -> dict[str, Any]:
    """``steps`` timed steps, each followed by ``save(step)``; the first snapshot is safe when
    ``is_safe()`` (asked after each save) first says so, else when ``wait_safe()`` returns
    True after the last step (False: no snapshot was taken)."""
    walls, saves, first_safe = [], [], None
    t_first = time.perf_counter()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        _step(state, fwd_bwd_s)
        t1 = time.perf_counter()
        save(step)
        saves.append(time.perf_counter() - t1)
        walls.append(time.perf_counter() - t0)
        if first_safe is None and is_safe():
            first_safe = time.perf_counter() - t_first
    if first_safe is None and wait_safe():
        first_safe = time.perf_counter() - t_first
    return {"walls": walls, "saves": saves, "first_safe": first_safe}


def run_ftmem(state: baselines.BenchState, steps: int, fwd_bwd_s: float) -> dict[str, Any]:
    """Steps with ``ftmem.save`` every step against a fresh SMP (stopped after)."""
    import ftmem
    from ftmem.config import ClientConfig
    from ftmem.smp.spawn import start_smp

    run_dir = Path(tempfile.mkdtemp(prefix="ftmem-first-"))
    run_id = "bf" + uuid.uuid4().hex[:10]
    sd = {"model": state.model, "optim": state.optimizer}
    first: list[Any] = []  # the first save that was not skipped

    def save(step: int) -> None:
        handle = ckpt.save(sd, step=step)
        if not handle.skipped and not first:
            first.append(handle)

    smp = start_smp(
        run_dir=run_dir, run_id=run_id, parent_pid=os.getpid(), log_path=run_dir / "smp.log"
    )
    ckpt = None
    try:
        ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        return _loop(
            state,
            steps,
            fwd_bwd_s,
            save,
            lambda: bool(first) and first[0].done(),
            lambda: bool(first) and first[0].wait(120),
        )
    finally:
        if ckpt is not None:
            ckpt.close()
        smp.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_dcp(
    state: baselines.BenchState, steps: int, fwd_bwd_s: float, disk_dir: str
) -> dict[str, Any]:
    """Steps with one ``dcp.async_save`` at step 1 (a fresh stager: its first checkpoint)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

    path = os.path.join(disk_dir, f"dcp-first-{uuid.uuid4().hex[:8]}")
    stager = baselines.cpu_stager(async_staging=True)
    written: list[Any] = []  # the future of the checkpoint written to disk

    def save(step: int) -> None:
        if step == 1:
            sd = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}
            resp = dcp_async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)
            written.append(resp.upload_completion if isinstance(resp, AsyncSaveResponse) else resp)

    def wait_safe() -> bool:
        written[0].result()
        return True

    try:
        return _loop(
            state, steps, fwd_bwd_s, save, lambda: bool(written) and written[0].done(), wait_safe
        )
    finally:
        stager.close()
        shutil.rmtree(path, ignore_errors=True)


def summarize(run: dict[str, Any]) -> dict[str, float]:
    """The figures of one run."""
    walls = run["walls"]
    median = statistics.median(walls)
    return {
        "median_step": median,
        "max_step": max(walls),
        "held_up": sum(1 for w in walls if w > median + HELD_UP_S),
        "max_save": max(run["saves"]),
        "first_safe": run["first_safe"] if run["first_safe"] is not None else float("nan"),
    }


def section(
    args: argparse.Namespace,
    nbytes: int,
    rows: dict[str, list[dict[str, float]]],
    load: tuple[float, float],
) -> str:
    """The Markdown section (with its markers)."""
    start, end = _render.markers("first-snapshot")

    def cell(system: str, key: str, fmt: str) -> str:
        values = [r[key] for r in rows[system]]
        return ", ".join(format(v, fmt) for v in values)

    lines = [
        start,
        "## First snapshots of a large state: ftmem vs the first `dcp.async_save`",
        "",
        f"`python bench/first_snapshot.py --size-gib {args.size_gib:g} --runs {args.runs} "
        f"--steps {args.steps} --fwd-bwd-s {args.fwd_bwd_s:g}`: a {nbytes / 2**30:.2f} GiB "
        "state (model + AdamW), one process, a step of a sleep plus a real `optimizer.step()`; "
        "ftmem saves every step from step 1 into a fresh SMP, DCP saves once at step 1 with a "
        "fresh stager (to /tmp). Runs alternate; one value per run. "
        f"Machine load (1-min average) {load[0]:.2f} at the start, {load[1]:.2f} at the end.",
        "",
        "| system | median step (s) | longest step (s) | steps held up > 50 ms | longest call (s) "
        "| first snapshot safe after (s) |",
        "|---|---|---|---|---|---|",
    ]
    for system in rows:
        lines.append(
            f"| {system} | {cell(system, 'median_step', '.3f')} | {cell(system, 'max_step', '.3f')}"
            f" | {cell(system, 'held_up', '.0f')} | {cell(system, 'max_save', '.3f')}"
            f" | {cell(system, 'first_safe', '.2f')} |"
        )
    lines += [end, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--fwd-bwd-s", type=float, default=0.1)
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    p.add_argument("--out", type=Path, default=_results.DEFAULT_OUT)
    p.add_argument("--no-write", action="store_true", help="print the section only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)  # the rank's one core; the other is the background's
    load0 = os.getloadavg()[0]
    state = baselines.build_state(args.size_gib)
    for p_ in state.model.parameters():
        p_.grad = torch.zeros_like(p_)
    rows: dict[str, list[dict[str, float]]] = {"ftmem": [], "dcp.async_save": []}
    for i in range(args.runs):
        for system in rows:
            if system == "ftmem":
                run = run_ftmem(state, args.steps, args.fwd_bwd_s)
            else:
                run = run_dcp(state, args.steps, args.fwd_bwd_s, args.disk_dir)
            rows[system].append(summarize(run))
            logger.info("run %d %s: %s", i + 1, system, rows[system][-1])
    text = section(args, state.nbytes, rows, (load0, os.getloadavg()[0]))
    print(text)
    if not args.no_write:
        _render.write_section(args.out, "first-snapshot", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
