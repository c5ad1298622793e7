"""GPU data path: ftmem snapshots of a CUDA state (>= 4 GiB): stall, D2H GB/s, restore H2D.

    python bench/gpu_datapath.py --quick             # a state of >= 4 GiB, K=5
    python bench/gpu_datapath.py                     # 4 and 8 GiB, K=8
    python bench/gpu_datapath.py --smoke --out /tmp/gpu.md   # 0.25 GiB, K=3
    python bench/gpu_datapath.py --sizes 16 --saves 4 --no-write

Without CUDA (``torch.cuda.is_available()`` is False) it measures nothing and writes a
section that says "skipped: no CUDA".

Per state size (square ``nn.Linear`` layers on the GPU + AdamW's moments, fp32, one AdamW
step taken), in this process (the rank; no process group) with an SMP it starts (as
``bench/datapath.py`` does):

* the link's limit: every state tensor copied with ``non_blocking=True`` on a side stream
  into one ``torch.empty(..., pin_memory=True)`` buffer (touched before), and back (H2D);
* ftmem: ``Checkpointer().save(state, step)`` then waiting for the commit, once (the first
  save: slots created, mapped and page-locked) and K more times: the time in ``save()`` (the
  stall), and the D2H rate = the state's bytes / (``save()`` call to committed), the client
  copying CUDA tensors with non-blocking D2H copies on a side stream into the page-locked
  slot; the CPU-seconds of this process and of the SMP (and its children) per GiB;
* restore: ``Checkpointer().load(state)`` in place from a fresh Checkpointer (H2D), checked
  by clobbering a weight first.

The section goes between ``<!-- bench:gpu:start -->`` and ``<!-- bench:gpu:end -->``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/gpu_datapath.py

from bench import _baselines as baselines
from bench import _datapath_node as dp
from bench import _results

logger = logging.getLogger("bench.gpu_datapath")

PART = "gpu"
GiB = 1 << 30
MiB = 1 << 20

PROFILES: dict[str, dict[str, Any]] = {
    "smoke": {"sizes": "0.25", "saves": 3, "repeats": 1},
    "quick": {"sizes": "4", "saves": 5, "repeats": 3},
    "full": {"sizes": "4,8", "saves": 8, "repeats": 3},
}


@dataclass(kw_only=True)
class GpuSizeResult:
    """What was measured for one state size (seconds unless named otherwise)."""

    size_gib: float
    nbytes: int = 0
    cuda_bytes: int = 0
    """The part of :attr:`nbytes` on the GPU (what the pinned copies move)."""
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


def build_cuda_state(size_gib: float, *, seed: int = 0) -> tuple[torch.nn.Module, Any, str]:
    """Square ``nn.Linear`` layers on the GPU whose weights are at least ``size_gib / 3`` GiB,
    AdamW with its moments (one step taken, gradients dropped); (model, optimizer, shape)."""
    param_bytes = size_gib * GiB / 3
    width = next((w for w in (8192, 4096, 2048, 1024) if 2 * w * w * 4 <= param_bytes), 512)
    n_layers = max(1, math.ceil(param_bytes / (width * width * 4)))
    model, optimizer = baselines.linear_state(width, n_layers, seed=seed, device="cuda")
    torch.cuda.synchronize()
    return model, optimizer, f"{n_layers} x Linear({width}, {width})"


def _pinned_copies(
    tensors: list[torch.Tensor], nbytes: int, repeats: int
) -> tuple[list[float], list[float]]:
    """D2H of every tensor into one page-locked buffer and H2D back, on a side stream."""
    hold = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)]
    hold[0].fill_(0)  # touched
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    d2h: list[float] = []
    h2d: list[float] = []

    def one(to_host: bool) -> float:
        pinned = hold[0]
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            off = 0
            for t in tensors:
                n = t.nbytes
                flat = t.detach().reshape(-1).view(torch.uint8)
                if to_host:
                    pinned[off : off + n].copy_(flat, non_blocking=True)
                else:  # the same bytes back into the same tensors
                    flat.copy_(pinned[off : off + n], non_blocking=True)
                off += n
        stream.synchronize()
        return time.perf_counter() - t0

    try:
        one(True)  # warm-up
        for _ in range(repeats):
            d2h.append(one(True))
        for _ in range(repeats):
            h2d.append(one(False))
        torch.cuda.synchronize()
    finally:
        hold.clear()
        gc.collect()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()  # give the pinned buffer back to the OS, the slots need the memory
    return d2h, h2d


def measure_size(size_gib: float, args: argparse.Namespace, smp_args: list[str]) -> GpuSizeResult:
    """Build a CUDA state of ``size_gib``, measure the pinned copies, ftmem and the restore."""
    from ftmem.client import Checkpointer
    from ftmem.config import ClientConfig
    from ftmem.protocol.smp_client import SmpClient

    r = GpuSizeResult(size_gib=size_gib)
    free_dev, _total = torch.cuda.mem_get_info()
    host_need = (1.0 + 1.15 * args.slots) * size_gib + 1.0
    host_avail = psutil.virtual_memory().available / GiB
    if free_dev / GiB < 1.3 * size_gib + 0.5 or host_avail < host_need:
        r.not_run = (
            f"needs ~{1.3 * size_gib + 0.5:.1f} GiB of free GPU memory ({free_dev / GiB:.1f} "
            f"free) and ~{host_need:.1f} GiB of host memory ({host_avail:.1f} available)"
        )
        return r
    model, optimizer, shape = build_cuda_state(size_gib)
    st = {"model": model, "optim": optimizer}
    sd = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    tensors = [t for t in dp.state_tensors(sd) if t.is_cuda]
    r.nbytes = sum(t.nbytes for t in dp.state_tensors(sd))
    r.tensors, r.layers = len(dp.state_tensors(sd)), shape
    cuda_bytes = r.cuda_bytes = sum(t.nbytes for t in tensors)
    r.notes.append(
        f"state: {shape} + AdamW on {torch.cuda.get_device_name()}, {r.nbytes / GiB:.2f} GiB "
        f"({cuda_bytes / GiB:.2f} GiB of it on the GPU, {r.tensors} tensors)"
    )
    logger.info("[%g GiB] pinned copies", size_gib)
    r.pinned_d2h, r.pinned_h2d = _pinned_copies(tensors, cuda_bytes, args.repeats)
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-gpu-"))
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    timeout = 120.0 + 30.0 * size_gib
    try:
        smp_log = tmp / "smp.log"
        with dp.node_smp(
            run_dir, slots=args.slots, extra_args=smp_args, log_path=smp_log
        ) as smp_id:
            smp = smp_id[0]
            cfg = ClientConfig(run_dir=run_dir)
            ckpt = Checkpointer(cfg)
            client = SmpClient(run_dir)
            try:
                rank = ckpt.rank
                logger.info("[%g GiB] first save", size_gib)
                torch.cuda.synchronize()
                r.first = dp.save_and_wait(ckpt, st, 1, timeout)
                if r.first["committed"]:
                    v, w, _, _ = dp.wait_verified(client, rank, 1, timeout)
                    r.first.update(verified=v, verify_wait_s=w)
                logger.info("[%g GiB] %d saves", size_gib, args.saves)
                step = 1
                committed: list[int] = []
                s0, c0 = dp.cpu_seconds(smp.pid), time.process_time()
                for _ in range(args.saves):
                    step += 1
                    torch.cuda.synchronize()
                    one = dp.save_and_wait(ckpt, st, step, timeout)
                    r.save_s.append(one["save_s"])
                    r.skipped += int(one["skipped"])
                    if one["error"]:
                        r.notes.append(f"save of step {step}: {one['error']}")
                    if one["committed"]:
                        r.safe_s.append(one["safe_s"])
                        committed.append(step)
                r.proc_cpu = time.process_time() - c0
                if committed:
                    r.verified, r.verify_wait_s, _, _ = dp.wait_verified(
                        client, rank, committed[-1], timeout
                    )
                r.smp_cpu = dp.cpu_seconds(smp.pid) - s0
                r.proc_cpu = r.proc_cpu if committed else None
            finally:
                client.close()
                ckpt.close()
            logger.info("[%g GiB] restore", size_gib)
            ckpt = Checkpointer(cfg)
            try:
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
                ok = torch.equal(next(iter(model.parameters())), want)
                r.restore_check = "ok" if ok else "MISMATCH"
                del want
            finally:
                ckpt.close()
    except Exception as exc:  # report it, keep what was measured
        logger.exception("[%g GiB] failed", size_gib)
        r.error = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        del st, sd, tensors, model, optimizer
        gc.collect()
        torch.cuda.empty_cache()
    return r


@dataclass(kw_only=True)
class GpuResult(_results.PartResult):
    """The GPU part's results (no sizes without CUDA)."""

    profile: str
    device: str | None = None
    """The GPU's name and memory; None: no CUDA (nothing measured)."""
    cuda_build: str | None = None
    smp_note: str = ""
    sizes: list[GpuSizeResult] = field(default_factory=list)


# --------------------------------------------------------------------------- CLI


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="a 4 GiB state, K=5")
    prof.add_argument("--smoke", action="store_true", help="0.25 GiB, K=3")
    p.add_argument("--sizes", default=None, help="state sizes in GiB (default: the profile's)")
    p.add_argument("--saves", type=int, default=None, help="K: timed saves per size")
    p.add_argument("--repeats", type=int, default=None, help="pinned copies and restores")
    p.add_argument("--slots", type=int, default=2, help="SMP slots per rank")
    p.add_argument("--hash-threads", type=int, default=1, help="the SMP's --hash-threads")
    _results.add_output_args(p)
    return p


def run(argv: list[str]) -> GpuResult:
    """Parse ``argv`` and measure every size (nothing without CUDA)."""
    args = get_args_parser().parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sizes = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or args.saves < 1 or args.repeats < 1:
        raise ValueError("need a size, --saves >= 1 and --repeats >= 1")
    res = GpuResult(
        argv=argv, machine=_results.machine(), profile=args.profile, cuda_build=torch.version.cuda
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res.device = f"{torch.cuda.get_device_name()} ({props.total_memory / GiB:.0f} GiB)"
        threads = args.hash_threads if args.hash_threads > 0 else None
        smp_args, res.smp_note = dp.smp_extra_args(threads, dp.smp_help())
        for size in sizes:
            try:
                res.sizes.append(measure_size(size, args, smp_args))
            except Exception as exc:  # e.g. out of memory building the state: report, go on
                logger.exception("[%g GiB] failed", size)
                res.sizes.append(GpuSizeResult(size_gib=size, error=f"{type(exc).__name__}: {exc}"))
            gc.collect()
            torch.cuda.empty_cache()
    res.errors = [f"{r.size_gib:g} GiB: {r.error}" for r in res.sizes if r.error]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_results.script_main(PART, run))
