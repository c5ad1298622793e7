"""Flush benchmark: ftmem's flush of a snapshot to disk (DCP format) against ``dcp.save``.

    python bench/flush.py --quick               # 0.25 GiB, 2 repeats; 1 training repeat
    python bench/flush.py                       # 0.5 and 2 GiB, 3 repeats; 5 training repeats
    python bench/flush.py --sizes 1 --repeats 5 --train-repeats 0 --no-write

How it measures: docs/benchmarks.md, "How the parts measure". Section ``bench:flush``,
rendered by ``bench/flush_tables.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/flush.py

from bench import _baselines as baselines
from bench import _launch, _render, _results
from bench._proc import proc_memory
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
    "dcp.save with ftmem's writer: slots read, checked, written, fsync'd",
    "manifest (data files hashed while written) + fsync",
    "rest (layout, skeleton, dir fsyncs, rename)",
)


# ------------------------------------------------------------------------------ process readings


def minflt(pid: int | None) -> int:
    """Minor page faults of process ``pid`` so far (all its threads; /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10 of stat(5): minflt
    except (OSError, IndexError, ValueError):
        return 0


def cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` (this one: process_time); NaN if unknown."""
    if pid == os.getpid():
        return time.process_time()
    try:
        return sum(psutil.Process(pid).cpu_times()[:2]) if pid is not None else float("nan")
    except psutil.Error:
        return float("nan")


def rss_anon(pid: int | None) -> int:
    """Anonymous resident memory of ``pid`` (bytes; leaves out shared-memory mappings)."""
    return 0 if pid is None else proc_memory(pid)["RssAnon"]


def flush_worker(smp_pid: int) -> int | None:
    """The pid of the SMP's flush worker (``python -m ftmem.tiers.flush_worker``), if it runs."""
    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(smp_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ftmem.tiers.flush_worker" in " ".join(c.cmdline()):
                    return c.pid
    return None


class Usage:
    """What process ``pid`` spent in ``with`` blocks, summed over them: seconds, CPU seconds,
    minor page faults; with ``rss``, the peak :func:`rss_anon` (sampled every 20 ms) above
    ``base`` (default: at entry), which is what a write allocated (bytes)."""

    def __init__(self, pid: int | None, rss: bool = False, base: int | None = None) -> None:
        self.pid, self.rss, self.base = pid, rss, base
        self.s = self.cpu = 0.0
        self.faults = self.mem = 0

    def __enter__(self) -> Usage:
        if self.rss:
            self.peak, self.done = rss_anon(self.pid), threading.Event()
            self.base = self.peak if self.base is None else self.base
            self.sampler = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
            self.sampler.start()
        self.t0, self.cpu0, self.flt0 = time.perf_counter(), cpu_of(self.pid), minflt(self.pid)
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, rss_anon(self.pid))

    def __exit__(self, *exc: object) -> None:
        self.s += time.perf_counter() - self.t0
        self.cpu += cpu_of(self.pid) - self.cpu0
        self.faults += minflt(self.pid) - self.flt0
        if self.rss:
            self.done.set()
            self.sampler.join(timeout=5)
            self.mem = max(0, max(self.peak, rss_anon(self.pid)) - (self.base or 0))


def counted(owner: Any, name: str, usage: Usage) -> Any:
    """A context manager that counts every call of ``owner.name`` in ``usage``."""
    orig = getattr(owner, name)

    def call(*a: Any, **k: Any) -> Any:
        with usage:
            return orig(*a, **k)

    return mock.patch.object(owner, name, call)


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
    faults: dict[str, list[int]] = field(default_factory=dict)  # Of the writer, minor.
    inner_cpu: list[float] = field(default_factory=list)  # Of export_dcp's own dcp.save call.
    inner_faults: list[int] = field(default_factory=list)  # Of export_dcp's own dcp.save call.
    mem: dict[str, list[int]] = field(default_factory=dict)  # Peak added RssAnon of the writer.
    orders: list[list[str]] = field(default_factory=list)
    per_repeat: list[dict[str, float]] = field(default_factory=list)
    """Per repeat: seconds per system, and ``flush_smp_s`` (the SMP's own figure)."""
    once: dict[str, float] = field(default_factory=dict)  # One-off figures (seconds).
    notes: list[str] = field(default_factory=list)  # Leftovers, the SMP log's errors/warnings.
    error: str = ""


def dcp_import_seconds() -> float:
    """Seconds to import torch.distributed.checkpoint after torch, in a fresh process."""
    code = (
        "import time, torch; t = time.perf_counter(); "
        "from torch.distributed.checkpoint.filesystem import FileSystemWriter; "
        "from torch.distributed.checkpoint.state_dict_saver import save; "
        "print(time.perf_counter() - t)"
    )
    cmd = [sys.executable, "-c", code]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return float("nan")


def bench_size(size_gib: float, *, repeats: int, disk_root: Path, systems: list[str]) -> SizeResult:
    """Build a state of ``size_gib``, put it into an SMP, time every system ``repeats`` times."""
    import torch.distributed.checkpoint.state_dict_saver as saver
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import ftmem
    import ftmem.tiers.export as export
    from ftmem.protocol import messages as m
    from ftmem.protocol.smp_client import SmpClient
    from ftmem.smp.spawn import start_smp
    from ftmem.tiers.checkpoints import checkpoint_name

    res = SizeResult(size_gib)
    free, need = shutil.disk_usage(disk_root).free, size_gib * 2**30 * 3 + 2**30
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
    tier, log = work / "smp-tier", run_dir / "smp.log"
    os.environ["FTMEM_RUN_DIR"], os.environ["FTMEM_RUN_ID"] = str(run_dir), run_id
    try:
        smp_args = ["--flush-dir", str(tier), "--flush-keep", "1"]
        start = {"start_timeout": timedelta(seconds=120), "log_path": log, "extra_args": smp_args}
        with start_smp(run_dir=run_dir, run_id=run_id, slots=2, **start) as smp:
            t0 = time.perf_counter()
            ftmem.save({"model": state.model, "optim": state.optimizer}, step=1)  # skipped while
            ok = ftmem.wait(timeout=600.0)  # the SMP allocates the slots, committed by wait()
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
                deadline = time.monotonic() + 120
                while flush_worker(smp.pid) is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(1.0)
                # The worker's heap may keep what a flush freed: count its growth from idle.
                worker_idle = rss_anon(flush_worker(smp.pid))
                t0 = time.perf_counter()
                reply = flush_request()
                res.once["first FLUSH (warm-up, not counted)"] = time.perf_counter() - t0
                res.once["first FLUSH, the SMP's own figure"] = float(reply.get("seconds") or 0)
                shutil.rmtree(flush_out, ignore_errors=True)
                os.sync()

            def write_one(system: str, out: Path, calls: list[Usage]) -> dict[str, Any]:
                if system == EXPORT:
                    wrapped = [
                        (export, "find_sources"),
                        (saver, "save"),
                        (export, "write_manifest"),
                    ]
                    with contextlib.ExitStack() as stack:
                        for usage, (owner, name) in zip(calls, wrapped, strict=True):
                            stack.enter_context(counted(owner, name, usage))
                        export.export_dcp(export.find_sources([run_dir]), out)
                elif system == FLUSH:
                    return flush_request()
                elif system == DCP:
                    writer = FileSystemWriter(str(out), sync_files=True)
                    saver.save(state.state_dicts(), storage_writer=writer, no_dist=True)
                else:
                    with open(out, "wb") as f:
                        torch.save(state.state_dicts(), f)
                        f.flush()
                        os.fsync(f.fileno())
                return {}

            for i in range(repeats):
                k = i % len(systems)
                res.orders.append(systems[k:] + systems[:k])
                res.per_repeat.append({})
                for system in res.orders[-1]:
                    gc.collect()
                    os.sync()
                    out = work / f"{system.split()[0].replace('.', '_')}_{i}"
                    pid = flush_worker(smp.pid) if system == FLUSH else os.getpid()
                    calls = [Usage(os.getpid()) for _ in range(3)]  # export_dcp's own calls
                    with Usage(pid, rss=True, base=worker_idle if system == FLUSH else None) as u:
                        reply = write_one(system, out, calls)
                    for key, value in (("times", u.s), ("cpu", u.cpu), ("faults", u.faults)):
                        getattr(res, key).setdefault(system, []).append(value)
                    res.mem.setdefault(system, []).append(u.mem)
                    out = flush_out if system == FLUSH else out
                    res.disk_bytes[system] = sum(
                        p.stat().st_size for p in [out, *out.rglob("*")] if p.is_file()
                    )
                    res.per_repeat[-1][system] = u.s
                    if system == EXPORT:
                        parts = [c.s for c in calls]
                        for name, val in zip(PHASES, [*parts, u.s - sum(parts)], strict=True):
                            res.phases.setdefault(name, []).append(val)
                        res.inner_cpu.append(calls[1].cpu)
                        res.inner_faults.append(calls[1].faults)
                    if system == FLUSH:
                        res.per_repeat[-1]["flush_smp_s"] = float(reply.get("seconds") or 0.0)
                    print(f"# [{size_gib:g} GiB] repeat {i} {system}: {u.s:.2f} s", file=sys.stderr)
                    if out.is_dir():
                        shutil.rmtree(out)
                    else:
                        out.unlink()
                    os.sync()
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
            if odd := [x for x in text.splitlines() if any(w in x for w in _ODD)]:
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
    """(end time, step, seconds) of every ``flushed`` event of the SMP."""
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
    steps = _launch.flags(steps=args.steps, log_every=1000)
    return [_launch.example(), *_launch.model_flags(args), *steps]


def run_once(config: str, repeat: int, args: argparse.Namespace, root: Path) -> RunResult:
    """One single-node job of two ranks; bounded by ``args.run_timeout``."""
    res = RunResult(config, repeat, load_start=os.getloadavg()[0])
    rid = "bfl" + uuid.uuid4().hex[:10]
    tmp = Path(tempfile.mkdtemp(prefix=f"{config.split()[0]}{repeat}-", dir=root))
    run_dir, tier = tmp / "rd", tmp / "ckpt"
    launch = _launch.single_node_args(nproc=args.nproc, run_id=rid, run_dir=run_dir)
    launch += ["--ftmem-slots", "3"]
    if config != "no flush":
        launch += ["--ftmem-flush-dir", str(tier), "--ftmem-flush-every", str(args.flush_every)]
    agent: _launch.Agent | None = None
    poller = _launch.StatusPoller([run_dir])
    t0 = time.monotonic()
    try:
        agent = _launch.Agent([*launch, *script_args(args)], tmp / "agent.log", _launch.job_env())
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
    status = poller.last.get(0, {})
    if (status.get("flush") or {}).get("enabled"):
        res.status_flushes = int(status["flush"].get("flushes") or 0)
    res.skipped = poller.skipped()
    res.slots = {int(r): len(x.get("slots") or []) for r, x in (status.get("ranks") or {}).items()}
    events = read_events([run_dir]).events
    if commits := [e.time for e in events if e.event == "committed"]:
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
    dcp_import_s: float | None = None  # import torch.distributed.checkpoint after torch
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
    machine = _results.machine(disk_root)
    res = FlushResult(argv=argv, machine=machine, example_args=script_args(args), **same)
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
    sys.exit(_render.script_main(PART, run))
