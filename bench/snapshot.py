"""Snapshot benchmark: ftmem against torch.save and torch.distributed.checkpoint, same run.

    python bench/snapshot.py                       # 0.5 and 2 GiB, 5 repeats
    python bench/snapshot.py --quick               # 0.25 GiB, 3 repeats
    python bench/snapshot.py --sizes 1 --repeats 9 --simulate sleep --json /tmp/snap.json
    python bench/snapshot.py --skip-baselines --simulate sleep --fwd-bwd-s 0.2 --repeats 3
                                                   # ftmem alone: stall, restore, memory per node

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/snapshot.py

import torch

from bench import _baselines as baselines
from bench import _launch, _render, _results
from bench import _stats as st
from bench._figures import Fig, Goal, fig, figs, ge, kv, le, rows, table
from bench._proc import proc_memory
from bench._stats import GiB, fmt, stat

logger = logging.getLogger("bench.snapshot")

PART = "snapshot"


@dataclass(kw_only=True)
class Figure:
    """One metric of one system: a value per repeat."""

    system: str
    metric: str
    unit: str  # `s` (durations) or `GB/s` (bandwidths).
    values: list[float]


@dataclass(kw_only=True)
class NodeMemory:
    """Readings of one node's memory for one state size (one entry per snapshot read)."""

    state_bytes: int = field(
        metadata=fig("state", get=lambda m: f"{m['state_bytes'] / GiB:.2f} GiB")
    )
    slots: int = field(metadata=fig("slots per rank"))  # Snapshot slots per rank in the SMP.
    shm: list[int] = field(
        default_factory=list,
        metadata=fig("shared memory (x state)", get=lambda m: _x_state(m["shm"], m)),
    )
    """Bytes allocated to the run's files in /dev/shm."""
    smp_rss: list[int] = field(default_factory=list, metadata=fig("SMP RSS", how="mib"))
    smp_shmem: list[int] = field(default_factory=list, metadata=fig("SMP RssShmem", how="mib"))
    smp_anon: list[int] = field(default_factory=list, metadata=fig("SMP RssAnon", how="mib"))
    rank_anon_added: list[int] = field(
        default_factory=list, metadata=fig("rank RssAnon added", how="mib")
    )
    """Anonymous memory the rank gained since before its first ``ftmem.save``."""

    def read(self, *, smp_pid: int, run_id: str, rank_anon_before: int) -> None:
        """Take one reading (after a committed snapshot)."""
        smp = proc_memory(smp_pid)
        self.shm.append(_launch.shm_bytes(run_id)[0])
        self.smp_rss.append(smp["VmRSS"])
        self.smp_anon.append(smp["RssAnon"])
        self.smp_shmem.append(smp["RssShmem"])
        self.rank_anon_added.append(proc_memory(os.getpid())["RssAnon"] - rank_anon_before)


@dataclass(kw_only=True)
class SizeResult:
    """Everything measured on one state size."""

    size_gib: float  # The size asked for.
    nbytes: int  # The state's bytes (params + AdamW exp_avg + exp_avg_sq).
    figures: list[Figure] = field(default_factory=list)
    once: dict[str, float] = field(default_factory=dict)
    """One-off figures in seconds: warm-up calls, the SMP's start."""
    restore_ok: bool | None = None
    """A load restored a clobbered weight and moment bitwise (None: not checked)."""
    stats_after: dict[str, Any] = field(default_factory=dict)
    """``ftmem.stats()`` after the last timed save."""
    skipped: int = 0  # Timed snapshots skipped or not committed (not in the figures).
    memory: NodeMemory | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class SnapshotResult(_results.PartResult):
    """The snapshot part's results."""

    repeats: int
    simulate: str  # `compute` (256x256 matmuls on the main thread) or `sleep`.
    fwd_bwd_s: float
    sizes: list[SizeResult] = field(default_factory=list)


def _figures(res: SizeResult, out: baselines.Timings) -> None:
    res.figures += [
        Figure(system=s, metric=m, unit="s", values=v) for (s, m), v in out.values.items()
    ]


def bench_ftmem(
    state: baselines.BenchState, res: SizeResult, *, repeats: int, simulate: Callable[[], None]
) -> None:
    """ftmem's stall, background copy, restore and memory per node into ``res``, with an SMP
    of its own after an uncounted warm-up save. The SMP is stopped, ``ftmem.close()`` called and
    the run directory removed, on failure too."""
    import ftmem
    from ftmem.smp.spawn import start_smp

    out, copy = baselines.Timings(), []
    run_dir = tempfile.mkdtemp(prefix="ftmem-bench-run-")
    run_id = "bs" + uuid.uuid4().hex[:10]  # its own shared-memory names
    os.environ["FTMEM_RUN_DIR"], os.environ["FTMEM_RUN_ID"] = run_dir, run_id
    sd = {"model": state.model, "optim": state.optimizer}
    mem = NodeMemory(state_bytes=state.nbytes, slots=2)
    anon_before = proc_memory(os.getpid())["RssAnon"]
    try:
        t0 = time.perf_counter()
        with start_smp(run_dir=run_dir, run_id=run_id, slots=mem.slots) as smp:
            res.once["ftmem SMP start (readiness handshake)"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            h = ftmem.save(sd, step=1)  # skipped: the SMP allocates the slots meanwhile
            res.once["ftmem warm-up save: in save"] = time.perf_counter() - t0
            newest = 1  # the newest committed step, which load must restore
            if not ftmem.wait(timeout=300.0):  # ...and wait() commits the newest step
                res.errors.append("the warm-up snapshot was not committed")
            res.once["ftmem warm-up save: until committed"] = time.perf_counter() - t0
            res.once["ftmem warm-up save: skipped in save"] = float(h.skipped)
            released: list[float] = []  # registered after ftmem's fence hook: runs after it
            hook = state.optimizer.register_step_pre_hook(
                lambda *_: released.append(time.perf_counter())
            )
            try:
                for i in range(repeats):
                    t0 = time.perf_counter()
                    h = ftmem.save(sd, step=i + 2)
                    t_save = time.perf_counter() - t0
                    simulate()
                    released.clear()
                    t1 = time.perf_counter()
                    state.optimizer.step()  # the fence, then `released` stamped
                    t_fence = released[0] - t1
                    t2 = time.perf_counter()
                    ok = h.wait(timeout=120.0)
                    t_wait = time.perf_counter() - t2
                    s = ftmem.stats()
                    if h.skipped or not ok:  # (no slot ready yet, as on a loaded host)
                        res.skipped += 1
                        continue
                    newest = i + 2
                    out.add("ftmem", "stall (save + fence)", t_save + t_fence)
                    out.add("ftmem", "  blocked in save", t_save)
                    out.add("ftmem", "  blocked at fence", t_fence)
                    out.add("ftmem", 'stats()["last_stall_s"]', float(s["last_stall_s"]))
                    out.add("ftmem", "commit wait after step (handle.wait)", t_wait)
                    if s.get("last_copy_s"):
                        copy.append(state.nbytes / float(s["last_copy_s"]) / 1e9)
                    mem.read(smp_pid=smp.pid, run_id=run_id, rank_anon_before=anon_before)
                res.stats_after = {k: v for k, v in s.items() if isinstance(v, int | float | str)}
            finally:
                hook.remove()
            for _ in range(repeats):
                t0 = time.perf_counter()
                got = ftmem.load(sd)
                out.add("ftmem", "load in place", time.perf_counter() - t0)
                if got != newest:
                    res.errors.append(f"ftmem.load returned step {got}, expected {newest}")
            res.restore_ok = baselines.check_restore(lambda: ftmem.load(sd), state)
    finally:
        try:
            ftmem.close()
        finally:
            os.environ.pop("FTMEM_RUN_DIR", None)
            os.environ.pop("FTMEM_RUN_ID", None)
            shutil.rmtree(run_dir, ignore_errors=True)
    _figures(res, out)
    if copy:
        res.figures.append(
            Figure(system="ftmem", metric="background copy", unit="GB/s", values=copy)
        )
    res.memory = mem if mem.shm else None


def bench_size(
    size_gib: float, args: argparse.Namespace, simulate: Callable[[], None]
) -> SizeResult:
    """Build a state of ``size_gib`` and measure every system on it, freeing files in between."""
    state = baselines.build_state(size_gib)
    res = SizeResult(size_gib=size_gib, nbytes=state.nbytes)
    if not args.skip_baselines:
        out = baselines.Timings()
        shm_dir = tempfile.mkdtemp(prefix="ftmem-bench-", dir="/dev/shm")
        disk_dir = tempfile.mkdtemp(prefix="ftmem-bench-", dir=args.disk_dir)
        kw = {"disk_dir": disk_dir, "repeats": args.repeats, "out": out}
        try:
            logger.info("[%.2f GiB] torch.save, dcp.save", size_gib)
            baselines.bench_torch_save(state, shm_dir=shm_dir, **kw)
            gc.collect()
            baselines.bench_dcp_save(state, shm_dir=shm_dir, **kw)
            gc.collect()
            for async_staging in (True, False)[: 1 if args.skip_sync_staging else 2]:
                logger.info("[%.2f GiB] dcp.async_save async_staging=%s", size_gib, async_staging)
                baselines.bench_dcp_async_save(
                    state, async_staging=async_staging, simulate=simulate, **kw
                )
                gc.collect()
        finally:
            shutil.rmtree(shm_dir, ignore_errors=True)
            shutil.rmtree(disk_dir, ignore_errors=True)
        _figures(res, out)
        res.once.update(out.once)
    if not args.skip_ftmem:
        logger.info("[%.2f GiB] ftmem", size_gib)
        try:
            bench_ftmem(state, res, repeats=args.repeats, simulate=simulate)
        except Exception as e:  # keep the baseline figures; say what failed
            logger.exception("ftmem measurement failed")
            res.errors.append(f"ftmem: {type(e).__name__}: {e}")
    del state
    gc.collect()
    return res


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = _results.parser(__doc__)
    p.add_argument("--sizes", default="0.5,2", help="comma-separated state sizes in GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 3 repeats")
    p.add_argument("--disk-dir", default=None, help="directory on disk (default: $TMPDIR)")
    p.add_argument("--fwd-bwd-s", type=float, default=1.0, help="forward/backward stand-in (s)")
    p.add_argument("--simulate", choices=("compute", "sleep"), default="compute")
    p.add_argument("--skip-ftmem", action="store_true", help="baselines only")
    p.add_argument("--skip-baselines", action="store_true", help="ftmem only")
    sync = "leave out dcp.async_save without async staging (not the tuned configuration)"
    p.add_argument("--skip-sync-staging", action="store_true", help=sync)
    return p


def run(argv: list[str]) -> SnapshotResult:
    """Parse ``argv`` and measure every size."""
    args = get_args_parser().parse_args(argv)
    torch.set_num_threads(1)
    sizes = [0.25] if args.quick else [float(s) for s in args.sizes.split(",") if s]
    args.repeats = 3 if args.quick and args.repeats == 5 else args.repeats
    if args.repeats < 1 or not sizes:
        raise ValueError("need at least one size and one repeat")
    args.disk_dir = args.disk_dir or tempfile.gettempdir()
    same = {k: getattr(args, k) for k in ("repeats", "simulate", "fwd_bwd_s")}
    result = SnapshotResult(argv=argv, machine=_results.machine(args.disk_dir), **same)
    simulate = baselines.make_simulator(args.simulate, args.fwd_bwd_s)
    for size in sizes:
        r = bench_size(size, args, simulate)
        result.sizes.append(r)
        result.errors += [f"{r.nbytes / 2**30:.2f} GiB: {e}" for e in r.errors]
        if r.restore_ok is False:
            result.errors.append(f"{r.nbytes / 2**30:.2f} GiB: the restore check failed")
    _results.finish(result.machine)
    return result


# ------------------------------------------------------------------------------ the sections


def _x_state(values: list[float], m: dict[str, Any]) -> str:
    mib = Fig("", how="mib").show(values)
    return f"{mib} ({stat(st.scale(values, 1 / m['state_bytes']), '.2f', 'x')})"


def _node_total(m: dict[str, Any]) -> str:
    parts = (m["shm"], m["smp_anon"], m["rank_anon_added"])
    return _x_state([sum(x) for x in zip(*parts, strict=True)], m)


def _figure_row(f: dict[str, Any], nbytes: int) -> list[str]:
    v, med, gbs = f["values"], st.median(f["values"]), f["unit"] == "GB/s"
    spec = ".2f" if gbs else ".4f"
    per = fmt(med and med / 1.073741824, ".2f", " GiB/s")
    if not gbs:
        per = fmt(med and med * GiB / nbytes, ".4f", " s/GiB")
    rng = f"{fmt(st.low(v), spec)}-{fmt(st.high(v), spec)}"
    return [f["system"], f["metric"], fmt(med, spec, f" {f['unit']}"), rng, per]


def sections(r: dict[str, Any]) -> dict[str, list[str]]:
    """Sections ``snapshot`` (every figure per size) and ``memory`` (per node)."""
    how = f"time.sleep({r['fwd_bwd_s']:g})"
    if r["simulate"] == "compute":
        how = f"{r['fwd_bwd_s']:g} s of 256x256 matmuls on the main thread"
    out = [
        f"- each figure: median of {r['repeats']} repeats, with min-max; per GiB divides the "
        "median by the state size (params + AdamW exp_avg + exp_avg_sq, fp32)",
        f"- forward/backward stand-in between a save and `optimizer.step()`: {how}",
        "",
    ]
    for s in r["sizes"]:
        out += [f"### {s['nbytes'] / GiB:.2f} GiB state (requested {s['size_gib']:g} GiB)", ""]
        body = [_figure_row(f, s["nbytes"]) for f in s["figures"]]
        out += table(["system", "metric", "median", "min-max", "per GiB"], body)
        once = [
            [k, bool(v) if "skipped" in k else fmt(v, ".3f", " s")] for k, v in s["once"].items()
        ]
        once += [
            ["ftmem restore check (clobber a weight and a moment, load, compare)", s["restore_ok"]],
            ["ftmem timed snapshots skipped or not committed", s["skipped"]],
        ]
        out += kv(once, ("one-off figure", "value"))
        if s["stats_after"]:
            out += [f"`ftmem.stats()` after the last save: `{s['stats_after']}`", ""]
    memory = [
        "- one rank (this process) snapshots the benchmark state into an SMP; read after every "
        "committed snapshot once both slots hold one; median (min-max) over those readings",
        "- memory per node = shared memory (/dev/shm) + SMP RssAnon + the rank's added RssAnon",
        "",
        *rows(
            [*figs(NodeMemory), Fig("memory per node (x state)", get=_node_total)],
            [s["memory"] for s in r["sizes"] if s.get("memory")],
        ),
    ]
    return {"snapshot": out, "memory": memory}


def figure(size: dict[str, Any], system: str, metric: str) -> list[float]:
    """The per-repeat values of one metric of one system ([] if not measured)."""
    for f in size["figures"]:
        if f["system"] == system and f["metric"].strip() == metric:
            return list(f["values"])
    return []


def largest(r: dict[str, Any] | None) -> dict[str, Any] | None:
    """The largest state size of a snapshot result with figures."""
    sizes = [s for s in (r or {}).get("sizes", []) if s.get("figures")]
    return max(sizes, key=lambda s: s["nbytes"]) if sizes else None


_ASYNC = "dcp.async_save (async staging)"
GOALS = (
    ("stall per snapshot (save + fence)", "<= 0.01 s/GiB"),
    ("stall, ftmem / tuned dcp.async_save (blocking; + staging wait)", "<= 0.2 (both)"),
    ("background copy", ">= 10 GB/s"),
    ("restore in place (ftmem.load)", "<= 0.1 s/GiB"),
    ("restore, dcp.load / ftmem.load", ">= 6x"),
)


def goals(r: dict[str, Any] | None) -> list[Goal]:
    """Stall, stall against a tuned dcp.async_save, background copy, restore, its speed-up."""
    big = largest(r)
    if big is None:
        return [Goal(PART, g, t) for g, t in GOALS]
    n = big["nbytes"]
    gib = n / GiB
    stall = figure(big, "ftmem", "stall (save + fence)")
    rat = [
        st.ratio(st.median(stall), st.median(figure(big, _ASYNC, m)))
        for m in ("blocking", "stall with fence")
    ]
    copy, load = figure(big, "ftmem", "background copy"), figure(big, "ftmem", "load in place")
    speed = st.ratio(st.median(figure(big, "dcp.load", "in place (/dev/shm)")), st.median(load))
    values = [
        (stat(st.per_gib(stall, n), ".4f", " s/GiB"), le(st.median(stall), 0.01 * gib)),
        (" ; ".join(fmt(x, ".2f", "x") for x in rat), None if None in rat else max(rat) <= 0.2),  # type: ignore[type-var]
        (stat(copy, ".2f", " GB/s"), None if not copy else (st.median(copy) or 0.0) >= 10.0),
        (stat(st.per_gib(load, n), ".4f", " s/GiB"), le(st.median(load), 0.1 * gib)),
        (fmt(speed, ".1f", "x"), ge(speed, 6.0)),
    ]
    src = f"snapshot, {gib:.2f} GiB"
    return [Goal(PART, g, t, m, ok, src) for (g, t), (m, ok) in zip(GOALS, values, strict=True)]


_TORCH_LOAD = ("torch.load", "+ load_state_dict (/dev/shm)")
_FTMEM = (("ftmem", "stall (save + fence)"), ("ftmem", "load in place"))
HEADLINE = (  # label, the stall's (system, metric), the restore's (or None)
    ("torch.save (disk, fsync)", ("torch.save", "disk+fsync"), _TORCH_LOAD),
    ("dcp.save (disk, fsync)", ("dcp.save", "disk+fsync"), ("dcp.load", "in place (/dev/shm)")),
    ("dcp.async_save, tuned: blocking call", (_ASYNC, "blocking"), None),
    ("dcp.async_save, tuned: + staging wait", (_ASYNC, "stall with fence"), None),
    ("**ftmem** (save + fence; load in place)", *_FTMEM),
)


def headline(r: dict[str, Any] | None) -> list[str]:
    """The summary's headline table: stall and restore per GiB on the largest state."""
    if (big := largest(r)) is None:
        return []
    n = big["nbytes"]
    body = [
        [
            label,
            stat(st.per_gib(figure(big, *stall), n), ".4f", " s/GiB"),
            stat(st.per_gib(figure(big, *restore), n) if restore else [], ".3f", " s/GiB"),
        ]
        for label, stall, restore in HEADLINE
    ]
    title = f"### Headline: {n / GiB:.2f} GiB of model + AdamW state, one process"
    return [title, "", *table(["system", "stall per snapshot", "restore"], body)]


if __name__ == "__main__":
    sys.exit(_render.script_main(PART, run))
