"""Snapshot benchmark: ftmem against torch.save and torch.distributed.checkpoint, same run.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/snapshot.py                       # 0.5 and 2 GiB, 5 repeats
    python bench/snapshot.py --quick               # 0.25 GiB, 3 repeats (a smoke test)
    python bench/snapshot.py --sizes 0.5,2 --repeats 5 --out docs/benchmarks.md

For each state size it builds square ``nn.Linear`` layers whose parameters are a third of the
size, takes one AdamW step so ``exp_avg``/``exp_avg_sq`` exist, then measures, one system after
the other and freeing each one's files and buffers before the next:

* ``torch.save`` to /dev/shm and to disk + fsync; ``torch.load(weights_only=True)`` +
  ``load_state_dict`` from /dev/shm;
* ``dcp.save`` (sync, ``no_dist=True``) to /dev/shm and disk; ``dcp.load`` in place;
* ``dcp.async_save`` with one reused ``DefaultStager``, with async staging and without;
* ftmem with an SMP started in a temporary run directory: the stall (time blocked in
  ``ftmem.save`` plus at the optimizer-step fence after a simulated forward/backward), the
  background copy bandwidth (``ftmem.stats()["last_copy_s"]``) and ``ftmem.load`` in place.

It writes the tables into ``--out`` between ``<!-- bench:snapshot:start -->`` and
``<!-- bench:snapshot:end -->`` (the rest of the file is kept). Every number is measured.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

try:
    from bench import _baselines as baselines
    from bench import _report
    from bench import memory as node_memory
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _baselines as baselines  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]
    import memory as node_memory  # type: ignore[no-redef]

logger = logging.getLogger("bench.snapshot")

SECTION = "snapshot"
START_MARK, END_MARK = _report.markers(SECTION)
GOAL_SIZE_GIB = 2.0


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True, slots=True)
class Row:
    """One reported metric: a list of measurements and how to show them."""

    system: str
    metric: str
    values: tuple[float, ...]
    unit: str
    """"s" (durations, also shown per GiB) or "GB/s" (bandwidths)."""

    @property
    def median(self) -> float:
        """The median of the measurements."""
        return statistics.median(self.values)


def _rows_from(
    timings: baselines.Timings, system_of: Callable[[str], tuple[str, str]]
) -> list[Row]:
    rows = []
    for name, values in timings.values.items():
        system, metric = system_of(name)
        rows.append(Row(system=system, metric=metric, values=tuple(values), unit="s"))
    return rows


def _split_name(name: str) -> tuple[str, str]:
    """Split 'dcp.async_save (x) blocking' into ('dcp.async_save (x)', 'blocking')."""
    for system in (
        "dcp.async_save (async staging)",
        "dcp.async_save (sync staging)",
        "torch.save",
        "dcp.save",
    ):
        if name.startswith(system + " "):
            return system, name[len(system) + 1 :]
    if name.startswith("torch.load"):
        return "torch.load", name[len("torch.load") + 1 :]
    if name.startswith("dcp.load"):
        return "dcp.load", name[len("dcp.load") + 1 :]
    return name, ""


# --------------------------------------------------------------------------- simulated work


def make_simulator(kind: str, seconds: float) -> Callable[[], None]:
    """Return a stand-in for forward + backward lasting ``seconds``.

    ``compute`` runs 256x256 matmuls on the calling thread (one intra-op thread), leaving the
    other core to background copies, as a training rank would; ``sleep`` just sleeps.
    """
    if kind == "sleep":
        return lambda: time.sleep(seconds)
    a = torch.randn(256, 256) / 16

    def compute() -> None:
        x = a
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            x = torch.tanh(x @ a)

    return compute


# --------------------------------------------------------------------------- ftmem


@dataclass(kw_only=True, slots=True)
class FtmemResult:
    """What the ftmem part measured for one size."""

    rows: list[Row]
    notes: list[str]
    memory: node_memory.NodeMemory | None = None
    """Memory per node, read after each timed snapshot."""


def bench_ftmem(
    state: baselines.BenchState, *, repeats: int, simulate: Callable[[], None]
) -> FtmemResult:
    """Measure ftmem's stall, background copy and restore on ``state``.

    Starts an SMP in a temporary run directory (``FTMEM_RUN_DIR``), saves once as a warm-up
    (arena allocation and pre-faulting; reported, not counted), then per repeat: ``save``,
    ``simulate()``, ``optimizer.step()`` (ftmem's fence runs as a step pre-hook; a hook of ours
    registered after it stamps the time the fence let go; gradients are None so the step itself
    does nothing), ``handle.wait()`` for the commit and ``ftmem.stats()``. Then ``ftmem.load``
    in place, ``repeats`` times, and one check that a load really restores clobbered data.

    After each timed snapshot it also reads the node's memory (:mod:`bench.memory`).

    Resource handling: the SMP is stopped and the run directory removed on exit, and
    ``ftmem.close()`` is called even when a measurement fails.
    """
    import ftmem
    from ftmem.smp.spawn import start_smp

    out = baselines.Timings()
    notes: list[str] = []
    run_dir = tempfile.mkdtemp(prefix="ftmem-bench-run-")
    run_id = "bs" + uuid.uuid4().hex[:10]  # its own shared-memory names
    os.environ["FTMEM_RUN_DIR"] = run_dir
    os.environ["FTMEM_RUN_ID"] = run_id
    st = {"model": state.model, "optim": state.optimizer}
    slots = 2
    mem = node_memory.NodeMemory(state_bytes=state.nbytes, slots=slots)
    anon_before = node_memory.proc_memory(os.getpid())["RssAnon"]
    try:
        t0 = time.perf_counter()
        with start_smp(run_dir=run_dir, run_id=run_id, slots=slots) as smp:
            notes.append(f"SMP start (readiness handshake): {time.perf_counter() - t0:.3f} s")
            logger.info("SMP pid %s in %s", smp.pid, run_dir)
            t0 = time.perf_counter()
            h = ftmem.save(st, step=1)  # skipped: the SMP allocates the slots meanwhile
            t_call = time.perf_counter() - t0
            ok = ftmem.wait(timeout=300.0)  # ...and wait() commits the skipped newest step
            notes.append(
                f"warm-up save (the SMP allocates and pre-faults the slots; not counted): "
                f"{t_call:.3f} s in save, {time.perf_counter() - t0:.3f} s until committed "
                f"(committed={ok}, skipped={h.skipped})"
            )
            _ftmem_saves(
                ftmem,
                st,
                state,
                repeats=repeats,
                simulate=simulate,
                out=out,
                after_commit=lambda: mem.read(
                    smp_pid=smp.pid, run_id=run_id, rank_anon_before=anon_before
                ),
            )
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = ftmem.load(st)
                out.add("load in place", time.perf_counter() - t0)
                if got != repeats + 1:
                    notes.append(f"ftmem.load returned step {got}, expected {repeats + 1}")
            notes.append(_check_restore(ftmem, st, state))
    finally:
        try:
            ftmem.close()
        finally:
            os.environ.pop("FTMEM_RUN_DIR", None)
            os.environ.pop("FTMEM_RUN_ID", None)
            shutil.rmtree(run_dir, ignore_errors=True)
    notes += [f"{k}: {v}" for k, v in out.notes.items()]
    bandwidth = out.values.pop("background copy", [])
    rows = [Row(system="ftmem", metric=k, values=tuple(v), unit="s") for k, v in out.values.items()]
    if bandwidth:
        rows.append(
            Row(system="ftmem", metric="background copy", values=tuple(bandwidth), unit="GB/s")
        )
    return FtmemResult(rows=rows, notes=notes, memory=mem if mem.shm else None)


def _ftmem_saves(
    ftmem: Any,
    st: dict[str, Any],
    state: baselines.BenchState,
    *,
    repeats: int,
    simulate: Callable[[], None],
    out: baselines.Timings,
    after_commit: Callable[[], None] | None = None,
) -> None:
    """Run ``repeats`` save / forward-backward / optimizer.step cycles into ``out``.

    "background copy" is recorded in GB/s; skipped or uncommitted snapshots are not counted.
    ``after_commit`` runs after each committed snapshot, outside the timed parts.
    """
    released: list[float] = []
    hook = state.optimizer.register_step_pre_hook(lambda *_: released.append(time.perf_counter()))
    skipped = 0
    try:
        for i in range(repeats):
            t0 = time.perf_counter()
            h = ftmem.save(st, step=i + 2)
            t_save = time.perf_counter() - t0
            simulate()
            released.clear()
            t1 = time.perf_counter()
            state.optimizer.step()  # ftmem's fence hook runs first, then ours stamps `released`
            t_fence = released[0] - t1
            t2 = time.perf_counter()
            ok = h.wait(timeout=120.0)
            t_wait = time.perf_counter() - t2
            s = ftmem.stats()
            if h.skipped or not ok:
                skipped += 1
                continue
            out.add("stall (save + fence)", t_save + t_fence)
            out.add("  blocked in save", t_save)
            out.add("  blocked at fence", t_fence)
            out.add('stats()["last_stall_s"]', float(s["last_stall_s"]))
            out.add("commit wait after step (handle.wait)", t_wait)
            if s.get("last_copy_s"):
                out.add("background copy", state.nbytes / float(s["last_copy_s"]) / 1e9)
            if after_commit is not None:
                after_commit()
        out.notes["ftmem.stats() after the last save"] = str(s)
    finally:
        hook.remove()
    if skipped:
        out.notes["skipped"] = f"{skipped} of {repeats} snapshots skipped or uncommitted"


def _check_restore(ftmem: Any, st: dict[str, Any], state: baselines.BenchState) -> str:
    """Clobber one weight and one moment, load, and say whether both came back."""
    weight = next(iter(state.model.parameters()))
    moment = state.optimizer.state[weight]["exp_avg_sq"]
    want_w, want_m = weight.detach().clone(), moment.clone()
    with torch.no_grad():
        weight.fill_(123.0)
        moment.fill_(-1.0)
    ftmem.load(st)
    weight = next(iter(state.model.parameters()))
    moment = state.optimizer.state[weight]["exp_avg_sq"]
    ok = torch.equal(weight, want_w) and torch.equal(moment, want_m)
    verdict = "ok" if ok else "MISMATCH"
    return f"restore check (clobber a weight and an exp_avg_sq, load, compare): {verdict}"


# --------------------------------------------------------------------------- one size


@dataclass(kw_only=True, slots=True)
class SizeResult:
    """Everything measured for one state size."""

    size_gib: float
    nbytes: int
    rows: list[Row]
    notes: list[str]
    memory: node_memory.NodeMemory | None = None
    """Memory per node while ftmem held snapshots of this state (None: not measured)."""

    def find(self, system: str, metric: str) -> Row | None:
        """The row of ``system`` whose metric is ``metric`` (leading spaces ignored)."""
        return _find(self.rows, system, metric)


def bench_size(
    size_gib: float,
    *,
    repeats: int,
    disk_root: str | None,
    simulate: Callable[[], None],
    with_ftmem: bool,
    with_baselines: bool,
    skip_sync_staging: bool = False,
) -> SizeResult:
    """Build a state of ``size_gib`` and measure every system on it, freeing files in between.

    ``skip_sync_staging`` leaves out ``dcp.async_save`` without async staging (the tuned
    configuration, with async staging, is always measured).
    """
    state = baselines.build_state(size_gib)
    memory = None
    rows: list[Row] = []
    notes: list[str] = []
    if with_baselines:
        timings = baselines.Timings()
        shm_dir, disk_dir = baselines.make_temp_dirs(disk_root)
        try:
            logger.info("[%.2f GiB] torch.save / torch.load", size_gib)
            baselines.bench_torch_save(
                state, shm_dir=shm_dir, disk_dir=disk_dir, repeats=repeats, out=timings
            )
            gc.collect()
            logger.info("[%.2f GiB] dcp.save / dcp.load", size_gib)
            baselines.bench_dcp_save(
                state, shm_dir=shm_dir, disk_dir=disk_dir, repeats=repeats, out=timings
            )
            gc.collect()
            for async_staging in (True, False)[: 1 if skip_sync_staging else 2]:
                logger.info("[%.2f GiB] dcp.async_save async_staging=%s", size_gib, async_staging)
                baselines.bench_dcp_async_save(
                    state,
                    disk_dir=disk_dir,
                    repeats=repeats,
                    async_staging=async_staging,
                    simulate=simulate,
                    out=timings,
                )
                gc.collect()
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)
            shutil.rmtree(disk_dir, ignore_errors=True)
        rows += _rows_from(timings, _split_name)
        notes += [f"{k}: {v}" for k, v in timings.notes.items()]
    if with_ftmem:
        logger.info("[%.2f GiB] ftmem", size_gib)
        try:
            result = bench_ftmem(state, repeats=repeats, simulate=simulate)
            rows += result.rows
            notes += [f"ftmem {n}" for n in result.notes]
            memory = result.memory
        except Exception as e:  # report what failed, keep the baseline figures
            logger.exception("ftmem measurement failed")
            notes.append(f"ftmem measurement FAILED: {type(e).__name__}: {e}")
    nbytes = state.nbytes
    del state
    gc.collect()
    return SizeResult(size_gib=size_gib, nbytes=nbytes, rows=rows, notes=notes, memory=memory)


@dataclass(kw_only=True, slots=True)
class E2eResult:
    """Median step times of examples/train_gpt.py without and with ftmem snapshots."""

    args: list[str]
    plain: list[float]
    ftmem: list[float]
    notes: list[str]


def bench_e2e(args: list[str], *, rounds: int, with_ftmem: bool) -> E2eResult:
    """Run the example ``rounds`` times without and (alternating) with a snapshot every step.

    Each ftmem run gets a fresh SMP and run directory, so it starts from step 0.
    """
    result = E2eResult(args=args, plain=[], ftmem=[], notes=[])
    for _ in range(rounds):
        result.plain.append(baselines.bench_train_example(args, run_dir=None))
        if not with_ftmem:
            continue
        try:
            from ftmem.smp.spawn import start_smp

            run_dir = tempfile.mkdtemp(prefix="ftmem-bench-e2e-")
            try:
                with start_smp(run_dir=run_dir):
                    result.ftmem.append(baselines.bench_train_example(args, run_dir=run_dir))
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
        except Exception as e:  # keep the plain figures; say what failed
            logger.exception("end-to-end ftmem run failed")
            result.notes.append(f"ftmem run FAILED: {type(e).__name__}: {e}")
            break
    return result


def render_e2e(e2e: E2eResult) -> list[str]:
    """Render the end-to-end comparison as Markdown lines."""
    cmd = "python examples/train_gpt.py " + " ".join(e2e.args)
    out = ["### End to end: examples/train_gpt.py, one process", ""]
    out += [
        f"`{cmd}` with `--no-ftmem`, and with a snapshot after every step (fresh SMP per run); "
        "each run's median step time (the first step, which allocates the arenas, is one of "
        "the steps), runs alternating.",
        "",
        "| run | median step time per run | median |",
        "|---|---|---|",
    ]
    for name, values in (("no snapshot", e2e.plain), ("ftmem every step", e2e.ftmem)):
        if values:
            runs = ", ".join(f"{v:.4f}" for v in values)
            out.append(f"| {name} | {runs} s | {statistics.median(values):.4f} s |")
    if e2e.plain and e2e.ftmem:
        diff = statistics.median(e2e.ftmem) - statistics.median(e2e.plain)
        rel = diff / statistics.median(e2e.plain)
        out += ["", f"Difference of the medians: {diff * 1e3:+.1f} ms per step ({rel:+.1%})."]
    out += [f"- {n}" for n in e2e.notes]
    return [*out, ""]


# --------------------------------------------------------------------------- report


def machine_facts(disk_root: str, load_at_start: float) -> list[str]:
    """Return bullet lines describing the machine and software."""
    base = _report.machine_facts(disk_root)
    return [
        *base[:2],
        f"{base[2]}; torch intra-op threads: {torch.get_num_threads()}",
        *base[3:],
        f"1-minute load average at start / end: {load_at_start:.2f} / {os.getloadavg()[0]:.2f} "
        "(the machine may be shared: compare systems within this run only)",
    ]


def _fmt_row(row: Row, gib: float) -> str:
    lo, hi = min(row.values), max(row.values)
    if row.unit == "GB/s":
        return (
            f"| {row.system} | {row.metric} | {row.median:.2f} GB/s | {lo:.2f}-{hi:.2f} | "
            f"{row.median / 1.073741824:.2f} GiB/s |"
        )
    return (
        f"| {row.system} | {row.metric} | {row.median:.4f} s | {lo:.4f}-{hi:.4f} | "
        f"{row.median / gib:.4f} s/GiB |"
    )


def _find(rows: list[Row], system: str, metric: str) -> Row | None:
    for r in rows:
        if r.system == system and r.metric.strip() == metric:
            return r
    return None


def goals_table(result: SizeResult) -> list[str]:
    """Return the Goals table for ``result`` (the size nearest 2 GiB)."""
    gib = result.nbytes / 2**30
    rows = result.rows
    stall = _find(rows, "ftmem", "stall (save + fence)")
    copy = _find(rows, "ftmem", "background copy")
    load = _find(rows, "ftmem", "load in place")

    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("met" if ok else "missed")

    lines = [
        f"Goals, checked on the {gib:.2f} GiB state (medians):",
        "",
        "| goal | measured | verdict |",
        "|---|---|---|",
    ]
    if stall:
        per = stall.median / gib
        lines.append(f"| stall <= 0.01 s/GiB | {per:.4f} s/GiB | {verdict(per <= 0.01)} |")
    else:
        lines.append("| stall <= 0.01 s/GiB | - | not measured |")
    ratios = stall_ratios(result)
    if ratios:
        lines.append(
            f"| stall <= 1/5 of tuned dcp.async_save's (same run; both readings, see below) | "
            f"{_ratio_text(ratios)} | {verdict(max(ratios.values()) <= STALL_RATIO_GOAL)} |"
        )
    else:
        lines.append("| stall <= 1/5 of tuned dcp.async_save's (same run) | - | not measured |")
    if copy:
        lines.append(
            f"| background copy >= 10 GB/s | {copy.median:.2f} GB/s | "
            f"{verdict(copy.median >= 10)} |"
        )
    else:
        lines.append("| background copy >= 10 GB/s | - | not measured |")
    if load:
        per = load.median / gib
        lines.append(f"| load <= 0.1 s/GiB | {per:.4f} s/GiB | {verdict(per <= 0.1)} |")
    else:
        lines.append("| load <= 0.1 s/GiB | - | not measured |")
    speedup = restore_speedup(result)
    if speedup is not None:
        lines.append(
            f"| restore >= {RESTORE_SPEEDUP_GOAL:g}x faster than dcp.load in place (same run) | "
            f"{speedup:.1f}x | {verdict(speedup >= RESTORE_SPEEDUP_GOAL)} |"
        )
    if ratios:
        lines += [
            "",
            "dcp.async_save's stall is read two ways, and the goal counts as met only if both "
            "meet it: the time blocked in the call ('blocking': with async staging it returns "
            "before copying anything), and that plus the wait for staging that must come "
            "before `optimizer.step()` may change the tensors ('stall with fence', the same "
            "pattern as ftmem's stall).",
        ]
    return lines


STALL_GOAL_S_PER_GIB = 0.01
RESTORE_GOAL_S_PER_GIB = 0.1
RESTORE_SPEEDUP_GOAL = 6.0
STALL_RATIO_GOAL = 0.2
_DCP_ASYNC = "dcp.async_save (async staging)"


def stall_ratios(result: SizeResult) -> dict[str, float]:
    """ftmem's stall over tuned dcp.async_save's, per reading of DCP's stall (medians).

    Keys: ``blocking`` (DCP's time in the call) and ``with fence`` (that plus the wait for
    staging before the optimizer step); a reading that was not measured is left out.
    """
    stall = result.find("ftmem", "stall (save + fence)")
    out: dict[str, float] = {}
    for key, metric in (("blocking", "blocking"), ("with fence", "stall with fence")):
        dcp = result.find(_DCP_ASYNC, metric)
        if stall is not None and dcp is not None and dcp.median > 0:
            out[key] = stall.median / dcp.median
    return out


def restore_speedup(result: SizeResult) -> float | None:
    """dcp.load's time over ftmem.load's (in place, medians), None if either is missing."""
    ftmem_load = result.find("ftmem", "load in place")
    dcp_load = result.find("dcp.load", "in place (/dev/shm)")
    if ftmem_load is None or dcp_load is None or ftmem_load.median <= 0:
        return None
    return dcp_load.median / ftmem_load.median


def _ratio_text(ratios: dict[str, float]) -> str:
    return "; ".join(f"{v:.2f}x of DCP's {k}" for k, v in ratios.items())


def render(
    results: list[SizeResult],
    *,
    command: str,
    facts: list[str],
    repeats: int,
    sim: str,
    e2e: E2eResult | None = None,
) -> str:
    """Render the benchmark section (between the markers) as Markdown."""
    out = [START_MARK, "## Snapshot: ftmem vs torch.save vs DCP", ""]
    out += ["Every figure below was measured in the run of this command:", ""]
    out += ["```", command, "```", ""]
    out += [f"- {f}" for f in facts]
    out += [
        f"- each figure: median of {repeats} repeats, with min-max; per-GiB columns divide the "
        "median by the state size (params + AdamW exp_avg + exp_avg_sq, fp32)",
        f"- forward/backward stand-in between a save and `optimizer.step()`: {sim}",
        "- torch.save/dcp.save to /dev/shm and to the disk dir (file fsync'd); restores read "
        "the /dev/shm copy; dcp.async_save writes to the disk dir with one reused "
        "`DefaultStager` (thread executor; pinned memory and non-blocking copies need an "
        "accelerator, so off); 'until staged'/'until done' count from the call; 'stall with "
        "fence' = blocking + waiting for staging after the forward/backward stand-in, the same "
        "pattern as ftmem's stall",
        "",
    ]
    for r in results:
        gib = r.nbytes / 2**30
        out += [f"### {gib:.2f} GiB state (requested {r.size_gib:g} GiB)", ""]
        out += ["| system | metric | median | min-max | per GiB |", "|---|---|---|---|---|"]
        out += [_fmt_row(row, gib) for row in r.rows]
        out += [""]
        if r.notes:
            out += [f"- {n}" for n in r.notes]
            out += [""]
    if e2e is not None:
        out += render_e2e(e2e)
    if results:
        goal = min(results, key=lambda r: abs(r.nbytes / 2**30 - GOAL_SIZE_GIB))
        out += ["### Goals", "", *goals_table(goal), ""]
    out.append(END_MARK)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- CLI


def get_args_parser() -> argparse.ArgumentParser:
    """Return the benchmark's argument parser."""
    p = argparse.ArgumentParser(description="ftmem snapshot benchmark vs torch.save and DCP")
    p.add_argument("--sizes", default="0.5,2", help="comma-separated state sizes in GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 3 repeats")
    _report.add_output_args(p)
    p.add_argument("--disk-dir", default=None, help="directory on disk (default: $TMPDIR)")
    p.add_argument("--fwd-bwd-s", type=float, default=1.0, help="forward/backward stand-in (s)")
    p.add_argument("--simulate", choices=("compute", "sleep"), default="compute")
    p.add_argument(
        "--e2e-rounds",
        type=int,
        default=2,
        help="end-to-end runs of examples/train_gpt.py per variant (0: none)",
    )
    p.add_argument(
        "--e2e-args",
        default="--steps 12 --d-model 768 --n-layers 4 --vocab 8192",
        help="arguments for the end-to-end runs (~0.5 GB of state by default)",
    )
    p.add_argument("--skip-ftmem", action="store_true", help="baselines only")
    p.add_argument("--skip-baselines", action="store_true", help="ftmem only")
    p.add_argument(
        "--skip-sync-staging",
        action="store_true",
        help="leave out dcp.async_save without async staging (not the tuned configuration)",
    )
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, measure every size (and the optional end-to-end runs), render.

    ``command`` replaces the command line shown in the section (the suite passes its own).
    The outcome's data is the list of :class:`SizeResult`.
    """
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(1)
    sizes = [0.25] if args.quick else [float(s) for s in args.sizes.split(",") if s]
    repeats = 3 if args.quick and args.repeats == 5 else args.repeats
    if repeats < 1 or not sizes:
        raise ValueError("need at least one size and one repeat")
    disk_root = args.disk_dir or tempfile.gettempdir()
    simulate = make_simulator(args.simulate, args.fwd_bwd_s)
    sim = (
        f"{args.fwd_bwd_s:g} s of 256x256 matmuls on the main thread"
        if args.simulate == "compute"
        else f"time.sleep({args.fwd_bwd_s:g})"
    )
    load_at_start = os.getloadavg()[0]
    results = []
    for size in sizes:
        results.append(
            bench_size(
                size,
                repeats=repeats,
                disk_root=disk_root,
                simulate=simulate,
                with_ftmem=not args.skip_ftmem,
                with_baselines=not args.skip_baselines,
                skip_sync_staging=args.skip_sync_staging,
            )
        )
    e2e = None
    if args.e2e_rounds > 0:
        e2e_args = "--steps 8" if args.quick else args.e2e_args
        logger.info("end to end: examples/train_gpt.py %s", e2e_args)
        e2e = bench_e2e(e2e_args.split(), rounds=args.e2e_rounds, with_ftmem=not args.skip_ftmem)
    section = render(
        results,
        command=command or _report.shown_command("snapshot.py", argv),
        facts=machine_facts(disk_root, load_at_start),
        repeats=repeats,
        sim=sim,
        e2e=e2e,
    )
    failed = any("FAILED" in n for r in results for n in r.notes)
    return _report.Outcome(name=SECTION, section=section, args=args, data=results, ok=not failed)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the section and write it into ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _report.finish(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
