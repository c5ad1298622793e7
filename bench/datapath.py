"""Data path: every CPU cycle of a snapshot, its stall, time to safe and restore; with
``--gpu``, the same measurement on a CUDA state (part ``gpu``; "skipped" without CUDA).

    python bench/datapath.py --smoke --out /tmp/dp.md  # 8 MiB state, K=3: does it run (< 1 min)
    python bench/datapath.py --quick                   # 0.25 and 1 GiB, K=8 (a few minutes)
    python bench/datapath.py                           # 0.5, 2 and 4 GiB (4 if memory allows)
    python bench/datapath.py --sizes 1 --saves 12 --compute-ms 100 --no-write
    python bench/datapath.py --gpu --quick             # a CUDA state of >= 4 GiB, K=5

Each size runs in a rank process of its own (this file with ``--_rank``) beside an SMP; the rank
writes its raw figures to ``--result`` as JSON. What each figure is: docs/benchmarks.md, "How the
parts measure". Sections ``bench:datapath`` and ``bench:gpu``, rendered by
``bench/datapath_tables.py``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/datapath.py

from bench import _baselines as baselines
from bench import _launch, _render, _results
from bench._datapath_rank import (
    connect,
    cpu_wall,
    measure_saves,
    node_smp,
    rank_main,
    save_and_wait,
    smp_args,
    wait_verified,
)
from bench._stats import GiB, MiB

logger = logging.getLogger("bench.datapath")

PART = "datapath"
HASH_CHUNK = 2 * MiB  # Piece size of the hash table's updates (the client's copy moves 2 MiB).

_KEYS = ("sizes", "saves", "repeats", "compute_ms", "hash_mib", "idle_s")
PROFILES: dict[str, dict[str, Any]] = {
    "smoke": dict(zip(_KEYS, ("0.0078125", 3, 1, 20.0, 16, 0.2), strict=True)),
    "quick": dict(zip(_KEYS, ("0.25,1", 8, 3, 100.0, 256, 1.0), strict=True)),
    "full": dict(zip(_KEYS, ("0.5,2,4", 8, 3, 100.0, 256, 2.0), strict=True)),
    "gpu smoke": {"sizes": "0.25", "saves": 3, "repeats": 1},
    "gpu quick": {"sizes": "4", "saves": 5, "repeats": 3},
    "gpu full": {"sizes": "4,8", "saves": 8, "repeats": 3},
}


def bench_hashes(mib: int, repeats: int) -> list[dict[str, Any]]:
    """Each hash function over ``mib`` MiB beside a memcpy of it, one thread, ``HASH_CHUNK``
    updates: rows {name, wall, cpu, bytes} (seconds per repeat, after a warm-up)."""
    import xxhash

    n = mib * MiB
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.empty(n, dtype=torch.uint8).random_(0, 256)
        dst = torch.zeros(n, dtype=torch.uint8)  # touched
        view = memoryview(src.numpy()).cast("B")  # type: ignore[arg-type]

        def streaming(new: Callable[[], Any]) -> Callable[[], Any]:
            def run() -> Any:
                h = new()
                for i in range(0, n, HASH_CHUNK):
                    h.update(view[i : i + HASH_CHUNK])
                return h.digest()

            return run

        def crc32() -> int:
            c = 0
            for i in range(0, n, HASH_CHUNK):
                c = zlib.crc32(view[i : i + HASH_CHUNK], c)
            return c

        cases: list[tuple[str, Callable[[], Any]]] = [
            ("memcpy (`dst.copy_(src)`, touched dst)", lambda: dst.copy_(src)),
            ("xxhash.xxh3_64", streaming(xxhash.xxh3_64)),
            ("xxhash.xxh3_128", streaming(xxhash.xxh3_128)),
            ("xxhash.xxh64", streaming(xxhash.xxh64)),
            ("zlib.crc32", crc32),
            ("hashlib.blake2b", streaming(hashlib.blake2b)),
        ]
        out = []
        for name, fn in cases:
            fn()  # warm-up (caches, lazy initialisation)
            times = cpu_wall(fn, repeats)
            out.append({"name": name, "wall": times["wall"], "cpu": times["cpu"], "bytes": n})
        return out
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the parent


@dataclass(kw_only=True)
class SizeResult:
    """What the rank and this process measured for one state size."""

    size_gib: float
    data: dict[str, Any] = field(default_factory=dict)  # The rank's raw figures.
    notes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""  # Why the size was not run (not enough memory), else "".


@dataclass(kw_only=True)
class DatapathResult(_results.PartResult):
    """The data path part's results."""

    profile: str
    saves: int
    repeats: int
    compute_ms: float
    dcp_saves: int
    slots: int
    loose_frac: float
    smp_note: str  # How the SMP's hashing was set up (`--hash-threads`).
    hashes: list[dict[str, Any]] = field(default_factory=list)
    """The hash functions on one buffer: name, bytes, wall and CPU seconds per repeat."""
    sizes: list[SizeResult] = field(default_factory=list)


def measure_size(size_gib: float, args: argparse.Namespace, smp_extra: list[str]) -> SizeResult:
    """Start an SMP and a rank process for one size; collect what the rank measured."""
    result = SizeResult(size_gib=size_gib)
    # The state, its slots, and one more copy: the memcpy's buffer, later DCP's staging.
    need = (2.0 + 1.15 * args.slots) * size_gib + 0.5
    if (avail := psutil.virtual_memory().available / GiB) < need:
        result.skipped = (
            f"needs ~{need:.1f} GiB of free memory (state, {args.slots} slots, staging), "
            f"{avail:.1f} GiB available"
        )
        logger.warning("[%g GiB] skipped: %s", size_gib, result.skipped)
        return result
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-dp-"))
    (run_dir := tmp / "run").mkdir(mode=0o700)
    res_path, log = tmp / "result.json", tmp / "smp.log"
    timeout = args.timeout + 120.0 * size_gib
    try:
        t0 = time.perf_counter()
        with node_smp(run_dir, slots=args.slots, extra_args=smp_extra, log_path=log) as smp_id:
            smp, run_id = smp_id
            result.notes.append(f"SMP pid {smp.pid} ready in {time.perf_counter() - t0:.2f} s")
            same = "saves repeats compute_ms dcp_saves idle_s loose_frac".split()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_rank"]
            cmd += _launch.flags(sizes=repr(size_gib), run_dir=run_dir, smp_pid=smp.pid)
            cmd += _launch.flags(result=res_path, wait_timeout=60.0 + 60.0 * size_gib)
            cmd += _launch.flags(**{k: getattr(args, k) for k in same})
            cmd += _launch.flags(disk_dir=args.disk_dir) if args.disk_dir else []
            cmd += ["--skip-dcp"] if args.skip_dcp else []
            env = _launch.job_env(FTMEM_RUN_DIR=str(run_dir), FTMEM_RUN_ID=run_id)
            with _launch.Job(cmd, tmp / "rank.log", env) as job:
                rc = job.wait(timeout)
                if rc is None:
                    result.error = f"the rank did not finish within {timeout:.0f} s"
                elif rc != 0:
                    result.error = f"the rank exited with {rc}"
                if result.error:
                    result.notes.append(f"rank log tail: `{job.text()[-1500:]!r}`")
            if smp.poll() is not None:
                result.notes.append(f"the SMP exited early ({smp.poll()})")
        if res_path.exists():
            result.data = json.loads(res_path.read_text())
        result.notes += [f"FAILED phase {err}" for err in result.data.get("errors", [])]
    except Exception as exc:  # the SMP did not start, or the result is unreadable
        logger.exception("[%g GiB] failed", size_gib)
        result.error = result.error or f"{type(exc).__name__}: {exc}"
        if log.exists():
            result.notes.append(f"SMP log tail: `{log.read_text(errors='replace')[-1000:]!r}`")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------- --gpu


@dataclass(kw_only=True)
class GpuSizeResult:
    """What was measured for one CUDA state size (seconds unless named otherwise)."""

    size_gib: float
    nbytes: int = 0
    cuda_bytes: int = 0  # the part of nbytes on the GPU (what the pinned copies move)
    tensors: int = 0
    layers: str = ""
    pinned_d2h: list[float] = field(default_factory=list)
    pinned_h2d: list[float] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict)
    save_s: list[float] = field(default_factory=list)
    safe_s: list[float] = field(default_factory=list)
    skipped: int = 0
    proc_cpu: float | None = None
    smp_cpu: float | None = None
    verified: bool | None = None
    verify_wait_s: float = 0.0
    restore_s: list[float] = field(default_factory=list)
    restore_check: str = ""
    notes: list[str] = field(default_factory=list)
    error: str = ""
    not_run: str = ""


@dataclass(kw_only=True)
class GpuResult(_results.PartResult):
    """The ``gpu`` part's results (no sizes without CUDA: ``device`` None)."""

    profile: str
    device: str | None = None
    cuda_build: str | None = None
    smp_note: str = ""
    sizes: list[GpuSizeResult] = field(default_factory=list)


def build_cuda_state(size_gib: float, *, seed: int = 0) -> tuple[torch.nn.Module, Any, str]:
    """Square ``nn.Linear`` layers on the GPU, weights >= ``size_gib / 3`` GiB, and AdamW with
    its moments (one step taken); (model, optimizer, shape)."""
    param_bytes = size_gib * GiB / 3
    width = next((w for w in (8192, 4096, 2048, 1024) if 2 * w * w * 4 <= param_bytes), 512)
    n_layers = max(1, math.ceil(param_bytes / (width * width * 4)))
    model, optimizer = baselines.linear_state(width, n_layers, seed=seed, device="cuda")
    torch.cuda.synchronize()
    return model, optimizer, f"{n_layers} x Linear({width}, {width})"


def pinned_copies(tensors: list[torch.Tensor], nbytes: int, repeats: int) -> tuple[list, list]:
    """Seconds of D2H of every tensor into one touched page-locked buffer, and of H2D back,
    on a side stream (one warm-up); (d2h, h2d)."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(0)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def one(to_host: bool) -> float:
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        t0, off = time.perf_counter(), 0
        with torch.cuda.stream(stream):
            for t in tensors:
                flat, n = t.detach().reshape(-1).view(torch.uint8), t.nbytes
                pin = pinned[off : off + n]
                (pin if to_host else flat).copy_(flat if to_host else pin, non_blocking=True)
                off += n
        stream.synchronize()
        return time.perf_counter() - t0

    try:
        one(True)
        return [one(True) for _ in range(repeats)], [one(False) for _ in range(repeats)]
    finally:
        torch.cuda.synchronize()
        pinned = torch.empty(0)  # the closure's buffer freed
        gc.collect()
        if (empty := getattr(torch._C, "_host_emptyCache", None)) is not None:
            empty()  # give the pinned buffer back to the OS: the slots need the memory


def measure_gpu_size(
    size_gib: float, args: argparse.Namespace, smp_extra: list[str]
) -> GpuSizeResult:
    """A CUDA state of ``size_gib`` in this process (the rank), an SMP of its own: the pinned
    copies, the first and K timed saves to commit, the CPU, the restore (H2D) and its check."""
    r = GpuSizeResult(size_gib=size_gib)
    free_dev = torch.cuda.mem_get_info()[0] / GiB
    host_need = (1.0 + 1.15 * args.slots) * size_gib + 1.0
    host_avail = psutil.virtual_memory().available / GiB
    if free_dev < 1.3 * size_gib + 0.5 or host_avail < host_need:
        r.not_run = (
            f"needs ~{1.3 * size_gib + 0.5:.1f} GiB of free GPU memory ({free_dev:.1f} free) "
            f"and ~{host_need:.1f} GiB of host memory ({host_avail:.1f} available)"
        )
        return r
    model, optimizer, r.layers = build_cuda_state(size_gib)
    st = {"model": model, "optim": optimizer}
    every = baselines.state_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()})
    tensors = [t for t in every if t.is_cuda]
    r.nbytes, r.tensors = sum(t.nbytes for t in every), len(every)
    r.cuda_bytes = sum(t.nbytes for t in tensors)
    r.notes.append(
        f"state: {r.layers} + AdamW on {torch.cuda.get_device_name()}, {r.nbytes / GiB:.2f} GiB "
        f"({r.cuda_bytes / GiB:.2f} GiB of it on the GPU, {r.tensors} tensors)"
    )
    logger.info("[%g GiB] pinned copies", size_gib)
    r.pinned_d2h, r.pinned_h2d = pinned_copies(tensors, r.cuda_bytes, args.repeats)
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-gpu-"))
    (run_dir := tmp / "run").mkdir(mode=0o700)
    timeout = 120.0 + 30.0 * size_gib
    try:
        log = tmp / "smp.log"
        with node_smp(run_dir, slots=args.slots, extra_args=smp_extra, log_path=log) as (smp, _):
            with connect(run_dir) as (ckpt, client):
                logger.info("[%g GiB] first save, then %d", size_gib, args.saves)
                torch.cuda.synchronize()
                r.first = save_and_wait(ckpt, st, 1, timeout)
                if r.first["committed"]:
                    v, w, _, _ = wait_verified(client, ckpt.rank, 1, timeout)
                    r.first.update(verified=v, verify_wait_s=w)
                saves, _ = measure_saves(
                    ckpt, client, st, 1, args.saves, timeout, smp.pid, torch.cuda.synchronize
                )
                r.save_s, r.safe_s, r.skipped = saves["save_s"], saves["safe_s"], saves["skipped"]
                r.proc_cpu = saves["rank_cpu"] if saves["committed"] else None
                r.smp_cpu, r.verified = saves["smp_cpu"], saves["verified"]
                r.verify_wait_s = saves["verify_wait_s"]
                r.notes += saves["errors"]
            logger.info("[%g GiB] restore", size_gib)
            with connect(run_dir, client=False) as (ckpt, _):
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ckpt.load(st)
                    torch.cuda.synchronize()
                    r.restore_s.append(time.perf_counter() - t0)
                weight = next(iter(model.parameters()))
                want = weight.detach().clone()
                with torch.no_grad():
                    weight.fill_(123.0)
                ckpt.load(st)
                r.restore_check = "ok" if torch.equal(weight, want) else "MISMATCH"
                del want
    except Exception as exc:  # report it, keep what was measured
        logger.exception("[%g GiB] failed", size_gib)
        r.error = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        del st, every, tensors, model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    return r


def run_gpu(args: argparse.Namespace, sizes: list[float]) -> GpuResult:
    """Every size on the GPU (nothing without CUDA)."""
    res = GpuResult(argv=args.argv, machine=_results.machine(), profile=args.profile)
    res.cuda_build = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res.device = f"{torch.cuda.get_device_name()} ({props.total_memory / GiB:.0f} GiB)"
        smp_extra, res.smp_note = smp_args(args.hash_threads or 0)
        for size in sizes:
            try:
                res.sizes.append(measure_gpu_size(size, args, smp_extra))
            except Exception as exc:  # e.g. out of memory building the state: report, go on
                logger.exception("[%g GiB] failed", size)
                res.sizes.append(GpuSizeResult(size_gib=size, error=f"{type(exc).__name__}: {exc}"))
            gc.collect()
            torch.cuda.empty_cache()
    res.errors = [f"{r.size_gib:g} GiB: {r.error}" for r in res.sizes if r.error]
    _results.finish(res.machine)
    return res


# ------------------------------------------------------------------------------------ CLI


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = _results.parser(__doc__)
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="0.25 and 1 GiB, K=8 (--gpu: 4, K=5)")
    prof.add_argument("--smoke", action="store_true", help="8 MiB, K=3 (--gpu: 0.25 GiB)")
    p.add_argument("--gpu", action="store_true", help="a CUDA state in this process (part gpu)")
    p.add_argument("--sizes", default=None, help="state sizes in GiB (default: the profile's)")
    p.add_argument("--saves", type=int, default=None, help="K: saves per measurement")
    p.add_argument("--repeats", type=int, default=None, help="memcpy/restore/hash repeats")
    p.add_argument("--compute-ms", type=float, default=None, help="compute between saves (ms)")
    p.add_argument("--dcp-saves", type=int, default=None, help="dcp.async_save saves (K)")
    p.add_argument("--slots", type=int, default=2, help="SMP slots per rank")
    hash_threads = (
        "the SMP's --hash-threads, if it has that flag (default 1, the CPU-only node's; with "
        "--gpu the SMP's own default, which uses a GPU host's idle cores; 0: its default)"
    )
    p.add_argument("--hash-threads", type=int, default=None, help=hash_threads)
    p.add_argument("--hash-mib", type=int, default=None, help="buffer of the hash table (MiB)")
    p.add_argument("--idle-s", type=float, default=None, help="SMP idle CPU measured this long")
    loose = "fraction of the state in loose tensors (no optimizer: copied inside save())"
    p.add_argument("--loose-frac", type=float, default=0.0, help=loose)
    p.add_argument("--disk-dir", default=None, help="dcp.async_save's directory ($TMPDIR)")
    p.add_argument("--timeout", type=float, default=600.0, help="one size's rank (+120 s/GiB)")
    p.add_argument("--skip-dcp", action="store_true", help="leave out dcp.async_save")
    p.add_argument("--skip-hashes", action="store_true", help="leave out the hash table")
    p.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)  # the rank process
    hidden = {"run-dir": Path, "smp-pid": int, "result": Path, "wait-timeout": float}
    for name, kind in hidden.items():
        p.add_argument(f"--{name}", type=kind, help=argparse.SUPPRESS)
    return p


def run(argv: list[str]) -> DatapathResult | GpuResult:
    """Parse ``argv``; the hash table, then every size (``--gpu``: :func:`run_gpu`)."""
    args = get_args_parser().parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    args.argv = argv
    for key, value in PROFILES[("gpu " if args.gpu else "") + args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dcp_saves is None:
        args.dcp_saves = args.saves
    sizes = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or args.saves < 1 or args.repeats < 1 or not 0 <= args.loose_frac < 0.9:
        raise ValueError("need a size, --saves >= 1, --repeats >= 1, 0 <= --loose-frac < 0.9")
    if args.gpu:
        return run_gpu(args, sizes)
    machine = _results.machine(args.disk_dir or tempfile.gettempdir())
    hashes: list[dict[str, Any]] = []
    if not args.skip_hashes:
        logger.info("hash table on %d MiB", args.hash_mib)
        hashes = bench_hashes(args.hash_mib, args.repeats)
        gc.collect()
    smp_extra, smp_note = smp_args(1 if args.hash_threads is None else args.hash_threads)
    keys = "profile saves repeats compute_ms dcp_saves slots loose_frac".split()
    same = {k: getattr(args, k) for k in keys}
    res = DatapathResult(argv=argv, machine=machine, smp_note=smp_note, hashes=hashes, **same)
    for size in sizes:
        logger.info("[%g GiB] starting", size)
        res.sizes.append(measure_size(size, args, smp_extra))
        gc.collect()
    for r in res.sizes:
        res.errors += [
            f"{r.size_gib:g} GiB: {e}" for e in [r.error, *r.data.get("errors", [])] if e
        ]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if "--_rank" in sys.argv:
        sys.exit(rank_main(get_args_parser().parse_args(sys.argv[1:])))
    sys.exit(_render.script_main("gpu" if "--gpu" in sys.argv else PART, run))
