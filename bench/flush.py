"""Flush benchmark: ftmem's flush of a snapshot to disk (DCP format) against ``dcp.save``.

Usage (from the repository root; ftmem importable, e.g. ``pip install -e .``):

    python bench/flush.py --quick               # 0.25 GiB, 2 repeats; 1 training repeat
    python bench/flush.py                       # 0.5 and 2 GiB, 3 repeats; 5 training repeats
    python bench/flush.py --sizes 1 --repeats 5 --train-repeats 0 --no-write

Issue 5 asks for two figures, both measured in one run:

1. **Throughput** (goal: >= 1.5x ``dcp.save`` fsync'd, same state, same run). For each size it
   builds square ``nn.Linear`` layers + AdamW state (``bench/_baselines.build_state``, as
   ``bench/snapshot.py`` does), starts an SMP (``start_smp``, with a ``--flush-dir`` on the
   disk) and gets the state into it the real way: ``ftmem.save(state, step=1)`` + ``wait()``
   in this process (one rank, no process group). Then, per repeat, in an order rotated from
   one repeat to the next, each system writes the same state to the disk directory:

   * **ftmem export_dcp**: ``export_dcp(find_sources([run_dir]), out)`` in this process (what
     the flush worker runs: checksums of the slot before and after, ``dcp.save(no_dist=True)``
     with ``FileSystemWriter(sync_files=True)``, the manifest's xxh3 of every file, fsyncs,
     rename), with a breakdown of its phases (timing wrappers around its calls);
   * **ftmem FLUSH (SMP worker)**: a FLUSH request to the SMP (what ``ftmem flush`` sends),
     from the request to the reply that the checkpoint is durable; the SMP's worker process
     (nice 10, one torch thread) does the writing. A first FLUSH, not counted, warms it up;
   * **dcp.save**: ``dcp.save(state_dicts, storage_writer=FileSystemWriter(dir,
     sync_files=True), no_dist=True)`` of the live model/optimizer state dicts;
   * **torch.save**: ``torch.save`` to one file + fsync.

   Each result directory is removed (and ``os.sync()`` run) before the next write. The page
   cache is not dropped (that needs root's ``/proc/sys/vm/drop_caches``, not writable here):
   the sources are in memory anyway (live tensors, or the slot in /dev/shm), and every write
   goes through the page cache and is fsync'd to the disk.

2. **Step time while flushing**: ``examples/train_gpt.py`` on one node with two ranks under
   ``python -m launcher`` (``ftmem-launch``, c10d rendezvous on 127.0.0.1), a snapshot every
   step, without a flush dir and with ``--ftmem-flush-dir D --ftmem-flush-every 5``, in turn in
   every repeat (both with ``--ftmem-slots 3``, the launcher's default when flushing, so the
   flush is the only difference). Measured: each rank's ``median step time``; flushes from the
   SMP log (``flushed to``, with their durations; those that ended before the last training
   step count as "during training"); failed flushes; the ranks' skipped snapshots and the
   flush counters from the SMP's STATUS, polled while the job runs.

Resource handling: the SMP of part 1 is stopped and its run and disk directories removed even on
error; every launcher agent runs in its own session and at the end of a run (also on error or
timeout) gets SIGTERM, then its process group and every descendant seen get SIGKILL. Every wait
is bounded.

The markdown goes to stdout and, unless ``--no-write``, into ``--out`` between
``<!-- bench:flush:start -->`` and ``<!-- bench:flush:end -->`` (the rest of the file is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch

try:
    from bench import _baselines as baselines
    from bench import _launch, _report
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _baselines as baselines  # type: ignore[no-redef]
    import _launch  # type: ignore[no-redef]
    import _report  # type: ignore[no-redef]

REPO = _launch.REPO
EXAMPLE = _launch.EXAMPLE
SECTION = "flush"
START_MARK, END_MARK = _report.markers(SECTION)
GOAL_RATIO = 1.5
MiB = 1 << 20

EXPORT = "ftmem export_dcp"
FLUSH = "ftmem FLUSH (SMP worker)"
DCP = "dcp.save"
TSAVE = "torch.save"
SYSTEMS = (EXPORT, FLUSH, DCP, TSAVE)
PHASES = (
    "find_sources (SMP query)",
    "verify slot checksums (before)",
    "dcp.save inside export (incl. fsync)",
    "verify slot checksums (after)",
    "manifest: xxh3 of every file + fsync",
    "rest (layout, skeleton, dir fsyncs, rename)",
)

STEP_RE = _launch.MEDIAN_RE
MEAN_RE = _launch.MEAN_RE
TS = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
LAST_STEP_RE = re.compile(TS + r" \[rank \d+\] train_gpt INFO: step (\d+) loss")
MODEL_RE = re.compile(TS + r" \[rank \d+\] train_gpt INFO: model:")
FLUSHED_RE = re.compile(
    TS + r" INFO \S+: \[[^\]]*/flush\] step (\d+) flushed to \d+ tier\(s\) in ([0-9.]+) s"
)
FAILED_RE = re.compile(TS + r" ERROR \S+: \[[^\]]*/flush\] flush of step (\d+) failed: (.*)")
FINAL_RE = re.compile(r"final flush of step (\d+)")


def _ts(s: str) -> float:
    return datetime.datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _med(xs: list[float]) -> float:
    return _report.median(xs)


def _mm(xs: list[float], fmt: str) -> str:
    return _report.stat(xs, fmt)


def _cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _minflt(pid: int | None) -> int:
    """Minor page faults of process ``pid`` so far (all its threads; /proc/<pid>/stat)."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[7])  # field 10 of stat(5): minflt
    except (OSError, IndexError, ValueError):
        return 0


def _fs_type(path: str) -> tuple[str, str]:
    return _report.fs_type(path)


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


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
    notes: list[str] = field(default_factory=list)
    error: str = ""


class _PhaseTimer:
    """Wraps export_dcp's calls (module attributes) to time its phases; restores them on exit."""

    def __init__(self) -> None:
        self.find = 0.0
        self.verify: list[float] = []
        self.dcp = 0.0
        self.dcp_cpu = 0.0
        self.dcp_faults = 0
        self.manifest = 0.0

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        import torch.distributed.checkpoint.state_dict_saver as saver

        import ftmem.tiers.export as export

        orig_verify, orig_manifest, orig_save = (
            export.verify_snapshot,
            export.write_manifest,
            saver.save,
        )

        def verify(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_verify(*a, **k)
            finally:
                self.verify.append(time.perf_counter() - t0)

        def manifest(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig_manifest(*a, **k)
            finally:
                self.manifest += time.perf_counter() - t0

        def save(*a: Any, **k: Any) -> Any:
            t0, c0, f0 = time.perf_counter(), _cpu_self(), _minflt(os.getpid())
            try:
                return orig_save(*a, **k)
            finally:
                self.dcp += time.perf_counter() - t0
                self.dcp_cpu += _cpu_self() - c0
                self.dcp_faults += _minflt(os.getpid()) - f0

        export.verify_snapshot = verify  # type: ignore[assignment]
        export.write_manifest = manifest  # type: ignore[assignment]
        saver.save = save  # type: ignore[assignment]  # export_dcp imports it at call time
        try:
            yield
        finally:
            export.verify_snapshot = orig_verify  # type: ignore[assignment]
            export.write_manifest = orig_manifest  # type: ignore[assignment]
            saver.save = orig_save  # type: ignore[assignment]


def _worker_proc(smp_pid: int) -> psutil.Process | None:
    """The SMP's flush worker (``python -m ftmem.tiers.flush_worker``), if it runs."""
    try:
        for c in psutil.Process(smp_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "ftmem.tiers.flush_worker" in " ".join(c.cmdline()):
                    return c
    except psutil.Error:
        pass
    return None


def _proc_cpu(p: psutil.Process | None) -> float:
    if p is None:
        return float("nan")
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return float("nan")


class RssSampler:
    """Samples a process's anonymous resident memory (``RssAnon``) in a thread; keeps the peak.

    Anonymous memory leaves out the slot's shared-memory mapping, so the peak above the start
    is what the write allocated (buffers, copies of tensors).
    """

    def __init__(self, pid: int | None, interval: float = 0.02, base: int | None = None) -> None:
        self.pid = pid
        self.interval = interval
        self.peak = self._read()
        self.start = self.peak if base is None else base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _read(self) -> int:
        if self.pid is None:
            return 0
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._read())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.peak = max(self.peak, self._read())

    @property
    def added(self) -> int:
        """Peak minus the value at the start, or ``base`` if given (bytes)."""
        return max(0, self.peak - self.start)


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


def bench_size(
    size_gib: float, *, repeats: int, disk_root: Path, systems: list[str], log: Callable
) -> SizeResult:
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
    res.notes.append(f"state built in {time.perf_counter() - t0:.1f} s")
    run_id = "bf" + uuid.uuid4().hex[:10]
    run_dir = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-run-"))
    work = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-", dir=disk_root))
    tier = work / "smp-tier"
    os.environ["FTMEM_RUN_DIR"] = str(run_dir)
    os.environ["FTMEM_RUN_ID"] = run_id
    st = {"model": state.model, "optim": state.optimizer}
    try:
        with start_smp(
            run_dir=run_dir,
            run_id=run_id,
            slots=2,
            start_timeout=timedelta(seconds=120),
            log_path=run_dir / "smp.log",
            extra_args=["--flush-dir", str(tier), "--flush-keep", "1"],
        ) as smp:
            t0 = time.perf_counter()
            ftmem.save(st, step=1)  # skipped while the SMP allocates the slots...
            ok = ftmem.wait(timeout=600.0)  # ...and committed by wait()
            res.notes.append(
                f"ftmem.save + ftmem.wait (first save: the SMP allocates the slots): "
                f"{time.perf_counter() - t0:.2f} s, committed={ok}"
            )
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
                worker = _worker_proc(smp.pid)
                deadline = time.monotonic() + 120
                while worker is None and time.monotonic() < deadline:
                    time.sleep(0.2)
                    worker = _worker_proc(smp.pid)
                time.sleep(1.0)
                # The worker's heap may keep what a flush freed: count its growth from idle.
                worker_idle = RssSampler(worker.pid if worker is not None else None).peak
                t0 = time.perf_counter()
                reply = flush_request()
                res.notes.append(
                    f"first FLUSH (warm-up, not counted): {time.perf_counter() - t0:.2f} s "
                    f"(SMP's figure {reply.get('seconds')} s)"
                )
                shutil.rmtree(flush_out, ignore_errors=True)
                os.sync()
            last_reply: dict[str, Any] = {}

            def write_one(system: str, out: Path, timer: _PhaseTimer) -> None:
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
                    timer = _PhaseTimer()
                    worker = _worker_proc(smp.pid) if system == FLUSH else None
                    wcpu0 = _proc_cpu(worker)
                    sampler = (
                        RssSampler(worker.pid if worker is not None else None, base=worker_idle)
                        if system == FLUSH
                        else RssSampler(os.getpid())
                    )
                    fpid = worker.pid if worker is not None else os.getpid()
                    flt0 = _minflt(fpid)
                    cpu0 = _cpu_self()
                    t0 = time.perf_counter()
                    with sampler:
                        write_one(system, out, timer)
                    dt = time.perf_counter() - t0
                    cpu = _cpu_self() - cpu0
                    res.faults.setdefault(system, []).append(_minflt(fpid) - flt0)
                    if system == FLUSH:
                        out = flush_out
                        cpu = _proc_cpu(worker) - wcpu0
                    res.mem.setdefault(system, []).append(sampler.added)
                    res.times.setdefault(system, []).append(dt)
                    res.cpu.setdefault(system, []).append(cpu)
                    res.disk_bytes[system] = _dir_bytes(out)
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
                    log(
                        f"[{size_gib:g} GiB] repeat {i} {system}: {dt:.2f} s, "
                        f"{res.nbytes / dt / 1e9:.3f} GB/s"
                    )
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
        log(f"[{size_gib:g} GiB] FAILED: {res.error}")
    finally:
        try:
            ftmem.close()
        finally:
            os.environ.pop("FTMEM_RUN_DIR", None)
            os.environ.pop("FTMEM_RUN_ID", None)
            smp_log = run_dir / "smp.log"
            if smp_log.exists():
                text = smp_log.read_text(errors="replace")
                odd = [
                    ln
                    for ln in text.splitlines()
                    if " ERROR " in ln or " WARNING " in ln or "Traceback" in ln
                ]
                if odd:
                    res.notes.append("SMP log errors/warnings: " + " | ".join(odd[:5]))
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            for p in os.listdir("/dev/shm"):
                if p.startswith(f"ftmem-{run_id}-"):
                    res.notes.append(f"shared memory left behind (removed): {p}")
                    with contextlib.suppress(OSError):
                        os.unlink(f"/dev/shm/{p}")
    gc.collect()
    return res


# ------------------------------------------------------------------------------ part 2


CONFIGS = ("no flush", "flush every 5")


@dataclass
class RunResult:
    config: str
    repeat: int
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    load_start: float = 0.0
    rank_median: dict[int, float] = field(default_factory=dict)
    rank_mean: dict[int, float] = field(default_factory=dict)
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

    @property
    def step_s(self) -> float:
        """The median over the ranks of each rank's median step time."""
        return statistics.median(self.rank_median.values())

    def during(self) -> list[tuple[float, int, float]]:
        """Flushes that ended before the last training step was logged."""
        return [f for f in self.flushes if f[0] <= self.train_end]


def script_args(args: argparse.Namespace) -> list[str]:
    return [
        str(EXAMPLE.relative_to(REPO)),
        "--d-model",
        str(args.d_model),
        "--n-layers",
        str(args.n_layers),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--log-every",
        "1000",
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
        for r, v in STEP_RE.findall(text):
            res.rank_median[int(r)] = float(v)
        for r, v in MEAN_RE.findall(text):
            res.rank_mean[int(r)] = float(v)
        ends = [_ts(t) for t, _ in LAST_STEP_RE.findall(text)]
        starts = [_ts(t) for t in MODEL_RE.findall(text)]
        if ends:
            res.train_end = max(ends)
        if starts:
            res.train_start = min(starts)
        if agent.popen.returncode != 0 or len(res.rank_median) != args.nproc:
            res.error = (
                f"exit code {agent.popen.returncode}, step times of ranks {sorted(res.rank_median)}"
            )
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
    smp_log = run_dir / "smp.log"
    if smp_log.exists():
        text = smp_log.read_text(errors="replace")
        res.flushes = [(_ts(t), int(s), float(d)) for t, s, d in FLUSHED_RE.findall(text)]
        res.failed = [f"step {s}: {e}" for _, s, e in FAILED_RE.findall(text)]
        res.final_flush = [int(s) for s in FINAL_RE.findall(text)]
    if tier.exists():
        res.checkpoints_left = sorted(p.name for p in tier.iterdir())
    leftovers = _launch.remove_shm(rid)
    if leftovers:
        res.notes.append(f"shared memory left behind (removed): {leftovers}")
    if args.keep_logs:
        print(f"# {config} {repeat}: logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


# ------------------------------------------------------------------------------ report


def machine_facts(disk_root: Path, load_start: float) -> list[str]:
    """Bullet lines about the machine, the software and the disk directory."""
    fstype, mp = _fs_type(str(disk_root))
    try:
        dev = next(p.device for p in psutil.disk_partitions(all=True) if p.mountpoint == mp)
    except StopIteration:
        dev = "?"
    du = shutil.disk_usage(disk_root)
    base = _report.machine_facts()
    return [
        *base[:2],
        f"{base[2]}, xxhash {_report.version_of('xxhash')}; torch intra-op threads here: "
        f"{torch.get_num_threads()}",
        f"disk dir: {disk_root} on {dev} ({fstype} at {mp}; {du.free / 2**30:.0f} GiB free of "
        f"{du.total / 2**30:.0f}); /dev/shm: {_fs_type('/dev/shm')[0]}",
        f"1-minute load average at start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f} "
        "(the machine is shared and noisy: compare systems within this run only)",
    ]


def render_size(r: SizeResult, repeats: int) -> list[str]:
    gib = r.nbytes / 2**30
    out = [f"#### {gib:.2f} GiB state (requested {r.size_gib:g} GiB)", ""]
    if r.error and not r.times:
        return [*out, f"FAILED: {r.error}", ""]
    out += [
        "| system | time | throughput | CPU s (writer process) | minor page faults (writer "
        "process) | peak memory added (writer process, RssAnon) | on disk |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in SYSTEMS:
        if s not in r.times:
            continue
        t = r.times[s]
        gbs = [r.nbytes / x / 1e9 for x in t]
        cpu = [c for c in r.cpu.get(s, []) if c == c]
        mem = [x / MiB for x in r.mem.get(s, [])]
        out.append(
            f"| {s} | {_mm(t, '.2f')} s | {_mm(gbs, '.3f')} GB/s | "
            f"{_mm(cpu, '.2f') if cpu else '-'} | "
            f"{_mm([x / 1000 for x in r.faults.get(s, [])], '.0f')} k | {_mm(mem, '.0f')} MiB | "
            f"{r.disk_bytes.get(s, 0) / MiB:.0f} MiB |"
        )
    out += ["", "Per repeat (each row in the order run; ratio = dcp.save time / ftmem time):", ""]
    out += [
        "| repeat | order | dcp.save | export_dcp | export/dcp throughput | FLUSH (request to "
        "reply; SMP's own figure) | FLUSH/dcp throughput |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(r.per_repeat):
        d, e, f = row.get(DCP), row.get(EXPORT), row.get(FLUSH)
        order = " > ".join(x.split()[0] if x != FLUSH else "FLUSH" for x in r.orders[i])
        smp_s = row.get("flush_smp_s", 0.0)
        out.append(
            f"| {i} | {order} | {f'{d:.2f} s' if d else '-'} | {f'{e:.2f} s' if e else '-'} | "
            f"{f'{d / e:.2f}x' if d and e else '-'} | "
            f"{f'{f:.2f} s; {smp_s:.2f} s' if f else '-'} | "
            f"{f'{d / f:.2f}x' if d and f else '-'} |"
        )
    if r.phases:
        out += ["", "Where export_dcp's time goes (timing wrappers around its calls):", ""]
        out += ["| phase | time | share of export_dcp |", "|---|---|---|"]
        total = _med(r.times[EXPORT])
        for name in PHASES:
            v = r.phases.get(name, [])
            out.append(f"| {name} | {_mm(v, '.3f')} s | {_med(v) / total:.0%} |")
        out += [
            "",
            f"export_dcp's own `dcp.save` call used {_mm(r.inner_cpu, '.2f')} CPU s and "
            f"{_mm([x / 1000 for x in r.inner_faults], '.0f')} k minor page faults; `dcp.save` "
            f"of the live tensors {_mm(r.cpu.get(DCP, []), '.2f')} CPU s and "
            f"{_mm([x / 1000 for x in r.faults.get(DCP, [])], '.0f')} k (a 4 KiB page "
            f"each: the state is {r.nbytes / 4096 / 1000:.0f} k pages).",
        ]
    out.append("")
    notes = list(r.notes)
    if r.error:
        notes.append(f"FAILED part way: {r.error}")
    out += [f"- {n}" for n in notes]
    return [*out, ""]


def ratios(r: SizeResult, system: str) -> list[float]:
    """dcp.save's time over ``system``'s (a throughput ratio), one per repeat with both."""
    return [row[DCP] / row[system] for row in r.per_repeat if row.get(DCP) and row.get(system)]


def render_train(results: list[RunResult], args: argparse.Namespace) -> tuple[list[str], dict]:
    ok = [r for r in results if r.ok]
    by = {c: [r for r in ok if r.config == c] for c in CONFIGS}
    plain = {r.repeat: r for r in by[CONFIGS[0]]}
    pairs = [(plain[r.repeat], r) for r in by[CONFIGS[1]] if r.repeat in plain]
    step_ratios = [b.step_s / a.step_s for a, b in pairs]
    fl = by[CONFIGS[1]]
    out = [
        "| config | step time (median over runs, min-max) | vs no flush (per pair) | "
        "flushes during training | flushes in all (SMP log) | seconds per flush | "
        "flushing's share of training time | snapshots skipped (all ranks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in CONFIGS:
        rs = by[c]
        steps = [r.step_s for r in rs]
        if c == CONFIGS[0]:
            out.append(
                f"| {c} | {_mm(steps, '.4f')} s | 1 | - | - | - | - | "
                f"{_mm([float(sum(r.skipped.values())) for r in rs], '.0f')} |"
            )
            continue
        during = [float(len(r.during())) for r in rs]
        total = [float(len(r.flushes)) for r in rs]
        secs = [s for r in rs for _, _, s in r.flushes]
        share = [
            sum(s for _, _, s in r.during()) / (r.train_end - r.train_start)
            for r in rs
            if r.train_end > r.train_start
        ]
        out.append(
            f"| {c} | {_mm(steps, '.4f')} s | {_mm(step_ratios, '.3f')} | {_mm(during, '.0f')} | "
            f"{_mm(total, '.0f')} | {_mm(secs, '.2f')} s | {_mm([x * 100 for x in share], '.0f')}"
            f"% | {_mm([float(sum(r.skipped.values())) for r in rs], '.0f')} |"
        )
    out += [
        "",
        "Every run, in the order run:",
        "",
        "| repeat | config | load avg at start | median step time (ranks) | mean step time "
        "(ranks) | flushed steps (SMP log; * = after the last step) | STATUS flushes / "
        "skipped (last poll) | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ok:
            out.append(
                f"| {r.repeat} | {r.config} | {r.load_start:.2f} | FAILED: {r.error} | | | | |"
            )
            continue
        med = ", ".join(f"{r.rank_median[k]:.4f}" for k in sorted(r.rank_median))
        mean = ", ".join(f"{r.rank_mean[k]:.4f}" for k in sorted(r.rank_mean))
        steps = " ".join(f"{s}{'*' if t > r.train_end else ''}" for t, s, _ in r.flushes) or "-"
        stat = (
            f"{r.status_flushes if r.status_flushes is not None else '-'} / "
            f"{sum(r.skipped.values())}"
        )
        out.append(
            f"| {r.repeat} | {r.config} | {r.load_start:.2f} | {med} s | {mean} s | {steps} | "
            f"{stat} | {r.wall_s:.0f} s |"
        )
    notes = [n for r in results for n in r.notes if "tail" not in n]
    for r in results:
        if r.failed:
            notes.append(f"repeat {r.repeat} {r.config}: failed flushes: {r.failed}")
        if r.final_flush:
            notes.append(f"repeat {r.repeat} {r.config}: final flush at SIGTERM of {r.final_flush}")
    slots = sorted({s for r in ok for s in r.slots.values()})
    notes.append(f"snapshot slots per rank seen in STATUS: {slots or '-'}")
    out += ["", *[f"- {n}" for n in notes]]
    summary = {
        "ratios": step_ratios,
        "plain": [r.step_s for r in by[CONFIGS[0]]],
        "flush": [r.step_s for r in fl],
        "during": [float(len(r.during())) for r in fl],
        "secs": [s for r in fl for _, _, s in r.flushes],
        "first": [r.flushes[0][2] for r in fl if r.flushes],
        "later": [s for r in fl for _, _, s in r.flushes[1:]],
        "skipped": [float(sum(r.skipped.values())) for r in fl],
        "share": [
            sum(s for _, _, s in r.during()) / (r.train_end - r.train_start)
            for r in fl
            if r.train_end > r.train_start
        ],
    }
    return out, summary


def _step_verdict(train: dict) -> tuple[str, str]:
    """(table verdict, sentence) for the flush/no-flush step-time ratios of adjacent runs."""
    rat, plain = train["ratios"], train["plain"]
    spread = (max(plain) - min(plain)) / _med(plain) if len(plain) > 1 else float("nan")
    spread_txt = f"{spread:.0%}" if spread == spread else "n/a (one run)"
    rng = f"median {_med(rat):.3f}, range {min(rat):.3f}-{max(rat):.3f} over {len(rat)} pair(s)"
    if len(rat) < 2:
        return (
            "one pair: not separable from noise",
            f"one pair of runs only (flush/no-flush {rat[0]:.3f}): on this machine that is "
            f"not separable from noise",
        )
    if min(rat) <= 1.0 <= max(rat):
        return (
            "no change beyond this run's noise",
            f"the flush/no-flush ratio of adjacent runs ({rng}) straddles 1, and the no-flush "
            f"runs alone spread by {spread_txt}: no step-time change beyond this machine's noise",
        )
    return (
        f"{(_med(rat) - 1) * 100:+.1f}% per step",
        f"flushing changed the median step by {(_med(rat) - 1) * 100:+.1f}% ({rng}, every "
        f"pair on the same side of 1; the no-flush runs alone spread by {spread_txt})",
    )


def reading(sizes: list[SizeResult], train: dict | None, args: argparse.Namespace) -> list[str]:
    out = ["### Reading against the goals", ""]
    out += ["| goal | measured | verdict |", "|---|---|---|"]
    for r in sizes:
        if not r.per_repeat:
            continue
        gib = r.nbytes / 2**30
        for system in (EXPORT, FLUSH):
            rat = ratios(r, system)
            if rat:
                verdict = "met" if _med(rat) >= GOAL_RATIO else "missed"
                out.append(
                    f"| flush throughput >= {GOAL_RATIO}x dcp.save fsync'd ({gib:.2f} GiB, "
                    f"{system}) | {_mm(rat, '.2f')}x | {verdict} |"
                )
    if train and train["ratios"]:
        rat = train["ratios"]
        verdict = _step_verdict(train)[0]
        out.append(
            f"| step-time change while flushing (no target number in the issue) | flush/no-flush "
            f"{_mm(rat, '.3f')} | {verdict} |"
        )
    out.append("")
    text = []
    big = max((r for r in sizes if r.per_repeat), key=lambda r: r.nbytes, default=None)
    if big is not None and big.phases:
        tot = _med(big.times[EXPORT])
        ph = {k: _med(v) for k, v in big.phases.items()}
        inner = ph[PHASES[2]]
        extra = tot - inner
        dcp = _med(big.times.get(DCP, []))
        rat = ratios(big, EXPORT)
        mem_e = _med([float(x) for x in big.mem.get(EXPORT, [])]) / MiB
        mem_d = _med([float(x) for x in big.mem.get(DCP, [])]) / MiB
        met = bool(rat) and _med(rat) >= GOAL_RATIO
        text.append(
            f"Throughput: the goal is {'met' if met else 'missed'}. The flush path is "
            f"`dcp.save` plus work around it, so it cannot beat `dcp.save` of the same bytes "
            f"unless its inner write is faster: on the {big.nbytes / 2**30:.2f} GiB state, "
            f"`export_dcp` took {tot:.2f} s (median), of which {inner:.2f} s is its own "
            f"`dcp.save` call (vs {dcp:.2f} s for `dcp.save` of the live tensors) and "
            f"{extra:.2f} s ({extra / tot:.0%}) the rest: xxh3 of the slot before "
            f"({ph[PHASES[1]]:.2f} s) and after ({ph[PHASES[3]]:.2f} s) the write, xxh3 of "
            f"every written file for the manifest ({ph[PHASES[4]]:.2f} s, read back from the "
            f"page cache), and the layout/skeleton decoding, directory fsyncs and rename "
            f"({ph[PHASES[5]]:.2f} s). The inner `dcp.save` does more work than the "
            f"baseline's: every tensor `export_dcp` hands DCP is a view into the whole mapped "
            f"slot, and DCP's `_SerialCpuLoader` clones any tensor whose storage is larger than "
            f"itself before writing it (torch/distributed/checkpoint/filesystem.py, `if "
            f"tensor.untyped_storage().size() != tensor.nbytes: tensor = tensor.clone()`) and "
            f"keeps every written tensor referenced until the file is closed. Measured here: "
            f"the inner call used {_med(big.inner_cpu):.2f} CPU s and "
            f"{_med([float(x) for x in big.inner_faults]) / 1000:.0f} k minor page faults "
            f"(about one per 4 KiB page of the state: every clone lands in fresh memory) against "
            f"{_med(big.cpu.get(DCP, [])):.2f} CPU s and "
            f"{_med([float(x) for x in big.faults.get(DCP, [])]) / 1000:.0f} k for `dcp.save` of "
            f"the live tensors, and the writer's anonymous memory grew by {mem_e:.0f} MiB "
            f"against {mem_d:.0f} MiB: the flush holds a second copy of the whole state in the "
            f"worker's heap while it writes. Reaching 1.5x would take a writer that does less "
            f"than DCP's, not more: no clone (hand DCP tensors with their own storage, or write "
            f"the slot's extents directly), hashing while writing instead of reading the files "
            f"back, several writer threads."
        )
    if FLUSH in (big.times if big else {}) and EXPORT in big.times:
        fl, ex = _med(big.times[FLUSH]), _med(big.times[EXPORT])
        text.append(
            f"The FLUSH row is what `ftmem flush` and the scheduled flushes get: the same export "
            f"in the SMP's worker process (nice 10, one torch thread). It took {fl:.2f} s "
            f"against {ex:.2f} s for `export_dcp` in this process ({big.nbytes / 2**30:.2f} "
            f"GiB): the request, the slot pinning and the worker add little when nothing else "
            f"wants the CPU."
        )
    if train and train["ratios"]:
        share = _med(train["share"]) if train["share"] else float("nan")
        how = _step_verdict(train)[1]
        text.append(
            f"Step time: {how}. With `--ftmem-flush-every {args.flush_every}` the worker was "
            f"busy for about {share:.0%} of the training time ({_med(train['during']):.0f} "
            f"flushes during {args.steps} steps, {_med(train['secs']):.2f} s each; the first "
            f"flush of a run took {_mm(train['first'], '.2f')} s against "
            f"{_mm(train['later'], '.2f')} s for the later ones, partly because the worker "
            f"imports DCP only at its first flush; a flush "
            f"that comes due while one runs is not queued: the next one takes the newest step, "
            f"hence the uneven flushed steps). The ranks skipped "
            f"{_med(train['skipped']):.0f} snapshots (median, all ranks) while flushed steps "
            f"stayed pinned. Here two ranks, the SMP and the flush worker share "
            f"{os.cpu_count()} cores, so the worker's copying, hashing and writing competes "
            f"with training for CPU and memory bandwidth directly; its nice 10 lowers its "
            f"priority but cannot keep it off the ranks' cores. On a node whose host cores are "
            f"not all busy with training the cost should be smaller (not measured here); "
            f"either way it scales with how often `--ftmem-flush-every` flushes."
        )
    for t in text:
        out += [t, ""]
    return out


def render(
    sizes: list[SizeResult],
    train_results: list[RunResult] | None,
    args: argparse.Namespace,
    cmd: str,
    facts: list[str],
    run_s: float,
) -> str:
    out = [START_MARK, "## Flush to disk: ftmem vs dcp.save, and step time while flushing", ""]
    out += _report.generated_by("flush.py", cmd)
    out += [f"- {f}" for f in facts]
    out += [
        f"- the whole run took {run_s / 60:.1f} min",
        f"- throughput: {args.repeats} repeats per size, systems in an order rotated each "
        "repeat; figures are medians (min-max); GB/s = state bytes (params + AdamW exp_avg + "
        "exp_avg_sq, fp32) / wall time, 1 GB = 1e9 B; every write is fsync'd and removed "
        "(then `os.sync()`) before the next; the page cache is not dropped (needs root's "
        "`drop_caches`, not writable here), which matters little: every source is in memory "
        "(live tensors, or the slot in /dev/shm) and every write goes to the page cache and "
        "is fsync'd to this VM's disk",
        "- systems: **ftmem export_dcp** = `export_dcp(find_sources([run_dir]), out)` in this "
        "process (nice 0, one torch thread), what the flush worker runs; **ftmem FLUSH** = a "
        "FLUSH request to the SMP (what `ftmem flush` sends), request to durable reply, done "
        "by the SMP's worker process (nice 10, one torch thread; its CPU and memory are the "
        "worker's, memory counted from the idle worker before its first flush); "
        "**dcp.save** = `dcp.save(state_dicts, storage_writer=FileSystemWriter(dir, "
        "sync_files=True), no_dist=True)` from the live tensors; **torch.save** = one file + "
        "fsync. The snapshot got into the SMP with `ftmem.save(state, step=1)` + `wait()` "
        "(one rank, no process group)",
        "",
        "### Throughput",
        "",
    ]
    for r in sizes:
        out += render_size(r, args.repeats)
    train = None
    if train_results:
        out += [
            "### Step time while flushing",
            "",
            f"`python -m launcher --nnodes 1 --nproc-per-node {args.nproc} --rdzv-backend c10d "
            "--rdzv-endpoint 127.0.0.1:PORT --rdzv-id RID --monitor-interval 0.1 --ftmem-node "
            "n0 --ftmem-run-dir DIR --ftmem-slots 3 [--ftmem-flush-dir D --ftmem-flush-every "
            f"{args.flush_every}] " + " ".join(script_args(args)) + "` with OMP_NUM_THREADS=1: "
            f"a snapshot after every step; {args.train_repeats} repeat(s), each running "
            f"{' then '.join(repr(c) for c in CONFIGS)}. A run's step time is the median over "
            "its ranks of each rank's median step time (all steps; DDP keeps the ranks in lock "
            "step); 'during training' = flushes whose log line came before the last step's; "
            "the share of training time = their summed durations / (last step's log time - the "
            "model-built log time).",
            "",
        ]
        lines, train = render_train(train_results, args)
        out += [*lines, ""]
    out += reading(sizes, train, args)
    out.append(END_MARK)
    return "\n".join(out) + "\n"


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # so that the SMP and the agents are stopped


@dataclass(kw_only=True, slots=True)
class FlushData:
    """What the suite reads from a flush run."""

    sizes: list[SizeResult]
    train: list[RunResult]


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
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
    _report.add_output_args(p)
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, measure throughput and step time, render the section (not written).

    ``command`` replaces the command line shown in the section (the suite passes its own).
    """
    p = get_args_parser()
    args = p.parse_args(argv)
    sizes = [0.25] if args.quick else [float(s) for s in (args.sizes or "0.5,2").split(",") if s]
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.train_repeats = (
        args.train_repeats if args.train_repeats is not None else (1 if args.quick else 5)
    )
    args.steps = args.steps or 60
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not set(systems) <= set(SYSTEMS) or not systems:
        p.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    disk_root = Path(args.disk_dir or tempfile.gettempdir()).absolute()
    fstype, mp = _fs_type(str(disk_root))
    if fstype in ("tmpfs", "ramfs"):
        p.error(f"{disk_root} is on {fstype} ({mp}): give --disk-dir on a real disk")
    torch.set_num_threads(1)  # as the flush worker

    def log(msg: str) -> None:
        print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)

    cmd = command or _report.shown_command("flush.py", argv)
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    results: list[SizeResult] = []
    for size in sizes:
        log(f"throughput, {size:g} GiB")
        results.append(
            bench_size(size, repeats=args.repeats, disk_root=disk_root, systems=systems, log=log)
        )
        gc.collect()
    train: list[RunResult] = []
    if args.train_repeats > 0:
        root = Path(tempfile.mkdtemp(prefix="ftmem-bench-flush-train-", dir=disk_root))
        try:
            for rep in range(args.train_repeats):
                for c in CONFIGS:
                    r = run_once(c, rep, args, root)
                    train.append(r)
                    log(
                        f"train repeat {rep} {c}: "
                        + (f"step {r.step_s:.4f} s" if r.ok else f"FAILED {r.error}")
                        + f", flushes {len(r.flushes)} ({len(r.during())} during training), "
                        f"skipped {sum(r.skipped.values())}, wall {r.wall_s:.0f} s"
                    )
                    if not r.ok:
                        for n in r.notes:
                            print(n, file=sys.stderr)
        finally:
            if not args.keep_logs:
                shutil.rmtree(root, ignore_errors=True)
    imp = dcp_import_seconds()
    facts = machine_facts(disk_root, load_start)
    facts.append(
        f"`import torch.distributed.checkpoint` (FileSystemWriter, save) after `import torch` "
        f"in a fresh process: {imp:.2f} s (the flush worker imports torch when the SMP starts, "
        "DCP only inside its first `export_dcp`)"
    )
    section = render(
        results,
        train,
        args,
        cmd,
        facts,
        time.monotonic() - t0,
    )
    failed = any(r.error for r in results) or any(not r.ok for r in train)
    return _report.Outcome(
        name=SECTION,
        section=section,
        args=args,
        data=FlushData(sizes=results, train=train),
        ok=not failed,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the section and write it into ``--out``."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    return _report.finish(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
