"""Flush benchmark: ftmem's flush of a snapshot to disk (DCP format) against ``dcp.save``.

    python bench/flush.py --quick               # 0.25 GiB, 2 repeats; 1 training repeat
    python bench/flush.py                       # 0.5 and 2 GiB, 3 repeats; 5 training repeats
    python bench/flush.py --sizes 1 --repeats 5 --train-repeats 0 --no-write

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/flush.py

from bench import _baselines as baselines
from bench import _launch, _proc, _results
from ftmem.observe.timeline import read_events

PART = "flush"
EXPORT = "ftmem export_dcp"
FLUSH = "ftmem FLUSH (SMP worker)"
DCP = "dcp.save"
TSAVE = "torch.save"
SYSTEMS = (EXPORT, FLUSH, DCP, TSAVE)
_ODD = (" ERROR ", " WARNING ", "Traceback")  # the SMP log's lines a note repeats
PHASES = (
    "find_sources (SMP query)",
    "verify slot checksums (before)",
    "dcp.save inside export (incl. fsync)",
    "verify slot checksums (after)",
    "manifest: xxh3 of every file + fsync",
    "rest (layout, skeleton, dir fsyncs, rename)",
)


# ------------------------------------------------------------------------------ part 1


@dataclass
class SizeResult:
    """Everything measured for one state size."""

    size_gib: float
    nbytes: int = 0
    times: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    disk_bytes: dict[str, int] = field(default_factory=dict)
    phases: dict[str, list[float]] = field(default_factory=dict)
    faults: dict[str, list[int]] = field(default_factory=dict)
    """Minor page faults of the writing process during the write."""
    inner_cpu: list[float] = field(default_factory=list)
    """CPU seconds of export_dcp's own dcp.save call."""
    inner_faults: list[int] = field(default_factory=list)
    """Minor page faults during export_dcp's own dcp.save call."""
    mem: dict[str, list[int]] = field(default_factory=dict)
    """Peak anonymous memory the writing process added during the write (bytes)."""
    orders: list[list[str]] = field(default_factory=list)
    per_repeat: list[dict[str, float]] = field(default_factory=list)
    """Per repeat: seconds per system, and ``flush_smp_s`` (the SMP's own figure)."""
    once: dict[str, float] = field(default_factory=dict)
    """One-off figures in seconds: building the state, the first save, the warm-up FLUSH."""
    notes: list[str] = field(default_factory=list)
    """Leftovers and the SMP log's errors/warnings (plain text)."""
    error: str = ""


def dcp_import_seconds() -> float:
    """Seconds to import torch.distributed.checkpoint after torch, in a fresh process."""
    code = (
        "import time, torch; t = time.perf_counter(); "
        "from torch.distributed.checkpoint.filesystem import FileSystemWriter; "
        "from torch.distributed.checkpoint.state_dict_saver import save; "
        "print(time.perf_counter() - t)"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return float("nan")


def bench_size(size_gib: float, *, repeats: int, disk_root: Path, systems: list[str]) -> SizeResult:
    """Build a state of ``size_gib``, put it into an SMP, time every system ``repeats`` times."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import ftmem
    from ftmem.protocol import messages as m
    from ftmem.protocol.smp_client import SmpClient
    from ftmem.smp.spawn import start_smp
    from ftmem.tiers.checkpoints import checkpoint_name
    from ftmem.tiers.export import export_dcp, find_sources

    res = SizeResult(size_gib)
    free = shutil.disk_usage(disk_root).free
    need = size_gib * 2**30 * 3 + 2**30
    if free < need:
        res.error = f"skipped: {free / 2**30:.1f} GiB free in {disk_root}, need {need / 2**30:.1f}"
        return res
    t0 = time.perf_counter()
    state = baselines.build_state(size_gib)
    res.nbytes = state.nbytes
    res.once["state built"] = time.perf_counter() - t0
    run_id = "bf" + uuid.uuid4().hex[:10]
    run_dir = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-run-"))
    work = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-", dir=disk_root))
    tier = work / "smp-tier"
    os.environ["FTMEM_RUN_DIR"] = str(run_dir)
    os.environ["FTMEM_RUN_ID"] = run_id
    st = {"model": state.model, "optim": state.optimizer}
    log = run_dir / "smp.log"
    try:
        smp_args = ["--flush-dir", str(tier), "--flush-keep", "1"]
        start = {"start_timeout": timedelta(seconds=120), "log_path": log, "extra_args": smp_args}
        with start_smp(run_dir=run_dir, run_id=run_id, slots=2, **start) as smp:
            t0 = time.perf_counter()
            ftmem.save(st, step=1)  # skipped while the SMP allocates the slots...
            ok = ftmem.wait(timeout=600.0)  # ...and committed by wait()
            first = "first ftmem.save + ftmem.wait (the SMP allocates the slots)"
            res.once[first] = time.perf_counter() - t0
            if not ok:
                raise RuntimeError("the snapshot of step 1 was not committed")
            flush_out = tier / checkpoint_name(1)

            def flush_request() -> dict[str, Any]:
                with SmpClient(run_dir, timeout=timedelta(seconds=900)) as c:
                    return dict(c.request(m.Flush(step=1, tier="local")))

            worker_idle = 0
            if FLUSH in systems:
                # Warm-up: the worker imported torch at SMP start; this shows what else the
                # first flush costs (not counted).
                worker = _proc.worker_proc(smp.pid)
                deadline = time.monotonic() + 120
                while worker is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                    worker = _proc.worker_proc(smp.pid)
                time.sleep(1.0)
                # The worker's heap may keep what a flush freed: count its growth from idle.
                worker_idle = _proc.RssSampler(worker.pid if worker is not None else None).peak
                t0 = time.perf_counter()
                reply = flush_request()
                res.once["first FLUSH (warm-up, not counted)"] = time.perf_counter() - t0
                res.once["first FLUSH, the SMP's own figure"] = float(reply.get("seconds") or 0)
                shutil.rmtree(flush_out, ignore_errors=True)
                os.sync()
            last_reply: dict[str, Any] = {}

            def write_one(system: str, out: Path, timer: _proc.PhaseTimer) -> None:
                if system == EXPORT:
                    with timer.patched():
                        t0 = time.perf_counter()
                        sources = find_sources([run_dir])
                        timer.find = time.perf_counter() - t0
                        export_dcp(sources, out)
                elif system == FLUSH:
                    last_reply.clear()
                    last_reply.update(flush_request())
                elif system == DCP:
                    writer = FileSystemWriter(str(out), sync_files=True)
                    dcp_save(state.state_dicts(), storage_writer=writer, no_dist=True)
                else:
                    with open(out, "wb") as f:
                        torch.save(state.state_dicts(), f)
                        f.flush()
                        os.fsync(f.fileno())

            for i in range(repeats):
                k = i % len(systems)
                order = systems[k:] + systems[:k]
                res.orders.append(order)
                row: dict[str, float] = {}
                for system in order:
                    gc.collect()
                    os.sync()
                    out = work / f"{system.split()[0].replace('.', '_')}_{i}"
                    timer, flushing = _proc.PhaseTimer(), system == FLUSH
                    worker = _proc.worker_proc(smp.pid) if flushing else None
                    wcpu0 = _proc.proc_cpu(worker)
                    wpid = worker.pid if worker is not None else None
                    base = worker_idle if flushing else None
                    sampler = _proc.RssSampler(wpid if flushing else os.getpid(), base=base)
                    fpid = wpid or os.getpid()
                    flt0 = _proc.minflt(fpid)
                    cpu0 = _proc.cpu_self()
                    t0 = time.perf_counter()
                    with sampler:
                        write_one(system, out, timer)
                    dt = time.perf_counter() - t0
                    cpu = _proc.cpu_self() - cpu0
                    res.faults.setdefault(system, []).append(_proc.minflt(fpid) - flt0)
                    if system == FLUSH:
                        out = flush_out
                        cpu = _proc.proc_cpu(worker) - wcpu0
                    res.mem.setdefault(system, []).append(sampler.added)
                    res.times.setdefault(system, []).append(dt)
                    res.cpu.setdefault(system, []).append(cpu)
                    res.disk_bytes[system] = _proc.dir_bytes(out)
                    row[system] = dt
                    if system == EXPORT:
                        v = [*timer.verify, 0.0, 0.0][:2]
                        parts = [timer.find, v[0], timer.dcp, v[1], timer.manifest]
                        parts.append(dt - sum(parts))
                        res.inner_cpu.append(timer.dcp_cpu)
                        res.inner_faults.append(timer.dcp_faults)
                        for name, val in zip(PHASES, parts, strict=True):
                            res.phases.setdefault(name, []).append(val)
                    if system == FLUSH:
                        row["flush_smp_s"] = float(last_reply.get("seconds") or 0.0)
                    print(f"# [{size_gib:g} GiB] repeat {i} {system}: {dt:.2f} s", file=sys.stderr)
                    if out.is_dir():
                        shutil.rmtree(out)
                    else:
                        out.unlink()
                    os.sync()
                res.per_repeat.append(row)
            leftovers = sorted(p.name for p in work.iterdir() if p.name != "smp-tier")
            if tier.exists():
                leftovers += [f"smp-tier/{p.name}" for p in tier.iterdir()]
            if leftovers:
                res.notes.append(f"left in the disk dir (removed): {leftovers}")
    except Exception as exc:  # report what failed, keep what was measured
        res.error = f"{type(exc).__name__}: {exc}"
        print(f"# [{size_gib:g} GiB] FAILED: {res.error}", file=sys.stderr)
    finally:
        try:
            ftmem.close()
        finally:
            os.environ.pop("FTMEM_RUN_DIR", None)
            os.environ.pop("FTMEM_RUN_ID", None)
            text = log.read_text(errors="replace") if log.exists() else ""
            odd = [x for x in text.splitlines() if any(w in x for w in _ODD)]
            if odd:
                res.notes.append("SMP log errors/warnings: " + " | ".join(odd[:5]))
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            if left := _launch.remove_shm(run_id):
                res.notes.append(f"shared memory left behind (removed): {left}")
    gc.collect()
    return res


# ------------------------------------------------------------------------------ part 2


CONFIGS = ("no flush", "flush every 5")


@dataclass
class RunResult(_launch.JobRun):
    """One training job of part 2."""

    train_s: float = float("nan")
    flushes: list[tuple[float, int, float]] = field(default_factory=list)
    """(end time, step, seconds) of every 'flushed to' line of the SMP log."""
    failed: list[str] = field(default_factory=list)
    final_flush: list[int] = field(default_factory=list)
    train_end: float = float("nan")
    train_start: float = float("nan")
    status_flushes: int | None = None
    skipped: dict[int, int] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)
    polls: int = 0
    checkpoints_left: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def script_args(args: argparse.Namespace) -> list[str]:
    """The example and its arguments (model size, steps) of the training runs."""
    return [
        _launch.example(),
        *_launch.model_flags(args),
        *_launch.flags(steps=args.steps, log_every=1000),
    ]


def config_flags(config: str, tier: Path, args: argparse.Namespace) -> list[str]:
    flags = ["--ftmem-slots", "3"]
    if config != "no flush":
        flags += ["--ftmem-flush-dir", str(tier), "--ftmem-flush-every", str(args.flush_every)]
    return flags


def run_once(config: str, repeat: int, args: argparse.Namespace, root: Path) -> RunResult:
    """One single-node job of two ranks; bounded by ``args.run_timeout``."""
    res = RunResult(config, repeat, load_start=os.getloadavg()[0])
    rid = "bfl" + uuid.uuid4().hex[:10]
    tmp = Path(tempfile.mkdtemp(prefix=f"{config.split()[0]}{repeat}-", dir=root))
    run_dir, tier = tmp / "rd", tmp / "ckpt"
    launch = [
        *_launch.single_node_args(nproc=args.nproc, run_id=rid, run_dir=run_dir),
        *config_flags(config, tier, args),
        *script_args(args),
    ]
    agent: _launch.Agent | None = None
    poller = _launch.StatusPoller([run_dir])
    t0 = time.monotonic()
    try:
        agent = _launch.Agent(launch, tmp / "agent.log", _launch.job_env())
        _launch.wait_all([agent], timeout=args.run_timeout, poller=poller, poll_s=args.poll)
        res.wall_s = time.monotonic() - t0
        text = agent.text()
        res.read_step_times(text)
        if (rc := agent.popen.returncode) != 0 or len(res.rank_median) != args.nproc:
            res.error = f"exit code {rc}, step times of ranks {sorted(res.rank_median)}"
            res.notes.append("agent log tail: " + text[-1500:])
        else:
            res.ok = True
    except (TimeoutError, RuntimeError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        poller.close()
        if agent is not None:
            agent.stop()
    res.polls = poller.polls
    st = poller.last.get(0, {})
    fl = st.get("flush") or {}
    if fl.get("enabled"):
        res.status_flushes = int(fl.get("flushes") or 0)
    res.skipped = poller.skipped()
    res.slots = {int(r): len(rs.get("slots") or []) for r, rs in (st.get("ranks") or {}).items()}
    events = read_events([run_dir]).events
    commits = [e.time for e in events if e.event == "committed"]
    if commits:
        res.train_start, res.train_end = min(commits), max(commits)
    for e in events:
        if e.event == "flushed":
            res.flushes.append((e.time, int(e.fields["step"]), float(e.fields["seconds"])))
        elif e.event == "flush_failed":
            res.failed.append(f"step {e.fields.get('step')}: {e.fields.get('error')}")
    if tier.exists():
        res.checkpoints_left = sorted(p.name for p in tier.iterdir())
    _launch.clean_up(res, rid, tmp, args.keep_logs)
    return res


@dataclass(kw_only=True)
class FlushResult(_results.PartResult):
    """The flush part's results: throughput per size, and the training runs."""

    repeats: int
    flush_every: int
    steps: int
    nproc: int
    example_args: list[str]
    dcp_import_s: float | None = None
    """``import torch.distributed.checkpoint`` after ``import torch``, fresh process."""
    sizes: list[SizeResult] = field(default_factory=list)
    train: list[RunResult] = field(default_factory=list)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = _results.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="0.25 GiB, 2 repeats, 1 training repeat")
    p.add_argument("--sizes", default=None, help="GiB, comma-separated (default 0.5,2)")
    p.add_argument("--repeats", type=int, default=None, help="throughput repeats (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="subset of: " + ", ".join(SYSTEMS))
    p.add_argument("--disk-dir", type=Path, default=None, help="on a disk (default: $TMPDIR)")
    p.add_argument("--train-repeats", type=int, default=None, help="default 5 (--quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 60)")
    p.add_argument("--flush-every", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    _launch.add_model_args(p)
    _launch.add_job_args(p, run_timeout=300.0)
    return p


def run(argv: list[str]) -> FlushResult:
    """Parse ``argv``, measure throughput per size, then the training runs."""
    p = get_args_parser()
    args = p.parse_args(argv)
    sizes = [0.25] if args.quick else [float(s) for s in (args.sizes or "0.5,2").split(",") if s]
    args.repeats = args.repeats or (2 if args.quick else 3)
    if args.train_repeats is None:
        args.train_repeats = 1 if args.quick else 5
    args.steps = args.steps or 60
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not set(systems) <= set(SYSTEMS) or not systems:
        p.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    disk_root = Path(args.disk_dir or tempfile.gettempdir()).absolute()
    fstype, mp = _results.fs_type(disk_root)
    if fstype in ("tmpfs", "ramfs"):
        p.error(f"{disk_root} is on {fstype} ({mp}): give --disk-dir on a real disk")
    torch.set_num_threads(1)  # as the flush worker
    same = {k: getattr(args, k) for k in ("repeats", "flush_every", "steps", "nproc")}
    res = FlushResult(
        argv=argv, machine=_results.machine(disk_root), example_args=script_args(args), **same
    )
    for size in sizes:
        res.sizes.append(
            bench_size(size, repeats=args.repeats, disk_root=disk_root, systems=systems)
        )
        gc.collect()
    if args.train_repeats > 0:
        root = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-train-", dir=disk_root))
        try:
            for rep in range(args.train_repeats):
                res.train += [run_once(c, rep, args, root) for c in CONFIGS]
        finally:
            if not args.keep_logs:
                shutil.rmtree(root, ignore_errors=True)
    res.dcp_import_s = dcp_import_seconds()
    res.errors = [f"{r.size_gib:g} GiB: {r.error}" for r in res.sizes if r.error]
    res.errors += [f"{r.config} #{r.repeat}: {r.error}" for r in res.train if not r.ok]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    sys.exit(_results.script_main(PART, run))
