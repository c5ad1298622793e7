"""GPU data path: ftmem snapshots of a CUDA state (>= 4 GiB): stall, D2H GB/s, restore H2D.

Usage (from the repository root, on a machine with a CUDA GPU; ftmem importable):

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

try:
    from bench import _report
    from bench import datapath as dp
except ImportError:  # run as a script: bench/ is sys.path[0]
    import _report  # type: ignore[no-redef]
    import datapath as dp  # type: ignore[no-redef]

logger = logging.getLogger("bench.gpu_datapath")

SECTION = "gpu"
START_MARK, END_MARK = _report.markers(SECTION)
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

    @property
    def gib(self) -> float:
        return self.nbytes / GiB

    def gbps(self, seconds: float | None) -> float | None:
        """The state's bytes over ``seconds``, in GB/s."""
        return self.nbytes / seconds / 1e9 if seconds else None


@dataclass(kw_only=True)
class GpuRun:
    """The part's data: None-free when CUDA was there."""

    device: str
    results: list[GpuSizeResult]


def build_cuda_state(size_gib: float, *, seed: int = 0) -> tuple[torch.nn.Module, Any, str]:
    """Square ``nn.Linear`` layers on the GPU whose weights are at least ``size_gib / 3`` GiB,
    AdamW with its moments (one step taken, gradients dropped); (model, optimizer, shape)."""
    param_bytes = size_gib * GiB / 3
    width = next((w for w in (8192, 4096, 2048, 1024) if 2 * w * w * 4 <= param_bytes), 512)
    n_layers = max(1, math.ceil(param_bytes / (width * width * 4)))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layer = torch.nn.Linear(width, width, device="cuda")
        with torch.no_grad():
            layer.weight.normal_(0.0, 0.02, generator=gen)
            layer.bias.zero_()
        layers.append(layer)
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
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
        with dp.node_smp(
            run_dir, slots=args.slots, extra_args=smp_args, log_path=tmp / "smp.log"
        ) as (smp, _run_id):
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


# --------------------------------------------------------------------------- report


def _med(values: list[float]) -> float | None:
    return _report.median(values) if _report.finite(values) else None


def _gbps_stat(r: GpuSizeResult, seconds: list[float], nbytes: int | None = None) -> str:
    n = nbytes or r.nbytes
    return _report.stat([n / s / 1e9 for s in seconds if s > 0], ".1f", " GB/s")


def render_rows(r: GpuSizeResult) -> list[str]:
    """The table of one size."""
    limit = dp.STALL_GOAL_BASE_S + dp.STALL_GOAL_S_PER_GIB * r.gib
    stalls = [x for x in [r.first.get("save_s"), *r.save_s] if x is not None]
    worst = max(stalls) if stalls else None
    verdict = "-" if worst is None else ("met" if worst <= limit else "missed")
    first = r.first
    out = [
        "| figure | value |",
        "|---|---|",
        f"| pinned D2H of the same tensors (`torch.empty(pin_memory=True)`, side stream): the "
        f"link's limit | {_gbps_stat(r, r.pinned_d2h, r.cuda_bytes)} |",
        f"| pinned H2D back | {_gbps_stat(r, r.pinned_h2d, r.cuda_bytes)} |",
        f"| **stall**: first `save()` | "
        f"{first.get('save_s', float('nan')) * 1e3:.1f} ms"
        + (f" (skipped: {first.get('reason')})" if first.get("skipped") else "")
        + " |",
        f"| `save()` over the {len(r.save_s)} saves, median (min-max) | "
        f"{_report.stat([x * 1e3 for x in r.save_s], '.1f', ' ms')} |",
        f"| stall goal 1 ms + 0.005 s/GiB = {limit * 1e3:.1f} ms, first included | {verdict} |",
        f"| first save to commit | {first.get('safe_s', float('nan')):.3f} s |",
        f"| **D2H by ftmem**: bytes / (`save()` call to commit), median (min-max) | "
        f"{_gbps_stat(r, r.safe_s)} |",
        f"| save to commit, median | {_report.stat(r.safe_s, '.3f', ' s')} |",
    ]
    d2h, pin = _med(r.safe_s), _med(r.pinned_d2h)
    if d2h and pin and r.cuda_bytes:
        ratio = (r.nbytes / d2h) / (r.cuda_bytes / pin)
        out.append(f"| ftmem's D2H rate / the pinned copy's | {ratio:.2f}x |")
    if r.verified is not None:
        out.append(f"| SMP verified the last step, after its commit | {r.verify_wait_s:.3f} s |")
    if r.proc_cpu is not None and r.safe_s:
        snap = len(r.safe_s) * r.gib
        out.append(
            f"| CPU per snapshotted GiB: this process / SMP | {r.proc_cpu / snap:.3f} / "
            f"{(r.smp_cpu or 0) / snap:.3f} CPU-s/GiB |"
        )
    rest = _med(r.restore_s)
    if rest:
        out += [
            f"| **restore** (`load` in place, H2D), median | {rest:.3f} s = "
            f"{rest / r.gib:.3f} s/GiB ({_gbps_stat(r, r.restore_s)}) |",
            f"| restore check (clobber a weight, load, compare) | {r.restore_check} |",
        ]
    return [*out, ""]


def render(run: GpuRun | None, *, command: str, facts: list[str], args: argparse.Namespace) -> str:
    """The section (markers included)."""
    out = [START_MARK, "## GPU data path: snapshot of a CUDA state", ""]
    if run is None:
        out += [
            "Generated by `bench/gpu_datapath.py` (alone or within `bench/run.py`), which "
            "measured nothing in this run:",
            "",
            "```",
            command,
            "```",
            "",
            f"**skipped: no CUDA** (`torch.cuda.is_available()` is False; torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}). Run "
            "`python bench/gpu_datapath.py --quick` on a machine with a GPU (the quick profile "
            "snapshots a state of at least 4 GiB).",
            "",
            *[f"- {x}" for x in facts],
            "",
            END_MARK,
        ]
        return "\n".join(out) + "\n"
    out += _report.generated_by("gpu_datapath.py", command)
    out += [f"- {x}" for x in facts]
    out += [
        f"- GPU: {run.device}; torch {torch.__version__}, CUDA {torch.version.cuda}",
        f"- SMP: {args.slots} slots per rank, {args.smp_note}; the rank is this process (no "
        f"process group); K = {args.saves} saves, {args.repeats} repeats of the pinned copies "
        "and the restore",
        "- D2H by ftmem counts from the `save()` call to the commit (`handle.wait()`; a skipped "
        "save: `Checkpointer.wait()`, which saves it again when the client keeps the skipped "
        "step): the client's side-stream copy into the page-locked slot and whatever follows "
        "before the SMP acknowledges the commit",
        "",
    ]
    for r in run.results:
        title = f"{r.gib:.2f} GiB state" if r.nbytes else f"{r.size_gib:g} GiB (requested)"
        out += [f"### {title}", ""]
        if r.not_run:
            out += [f"not run: {r.not_run}", ""]
            continue
        if r.nbytes:
            out += render_rows(r)
        notes = [*r.notes]
        if r.skipped:
            notes.append(f"{r.skipped} of the {len(r.save_s)} saves skipped in save()")
        if r.error:
            notes.append(f"FAILED: {r.error}")
        if notes:
            out += [*[f"- {n}" for n in notes], ""]
    out.append(END_MARK)
    return "\n".join(out) + "\n"


def summary_lines(run: GpuRun | None) -> list[str]:
    """One line per measured size for the suite's summary (none without CUDA)."""
    out: list[str] = []
    if run is None:
        return out
    for r in run.results:
        d2h, pin, rest = _med(r.safe_s), _med(r.pinned_d2h), _med(r.restore_s)
        if not r.nbytes or d2h is None:
            continue
        stall = max([x for x in [r.first.get("save_s"), *r.save_s] if x is not None])
        text = (
            f"- GPU ({run.device}), {r.gib:.2f} GiB on the device: `save()` up to "
            f"{stall * 1e3:.1f} ms (first included), D2H to commit "
            f"{r.nbytes / d2h / 1e9:.1f} GB/s"
        )
        if pin:
            text += f" vs a pinned copy's {r.cuda_bytes / pin / 1e9:.1f} GB/s"
        if rest:
            text += f", restore {rest / r.gib:.3f} s/GiB"
        out.append(text)
    return out


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
    p.add_argument(
        "--hash-threads", type=int, default=1, help="the SMP's --hash-threads, if it has it"
    )
    _report.add_output_args(p)
    return p


def run(argv: list[str], *, command: str | None = None) -> _report.Outcome:
    """Parse ``argv``, measure every size (nothing without CUDA), render the section.

    The outcome's data is a :class:`GpuRun`, or None without CUDA.
    """
    args = get_args_parser().parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    sizes = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or args.saves < 1 or args.repeats < 1:
        raise ValueError("need a size, --saves >= 1 and --repeats >= 1")
    command = command or _report.shown_command("gpu_datapath.py", argv)
    load0 = os.getloadavg()
    facts = _report.machine_facts()
    if not torch.cuda.is_available():
        section = render(None, command=command, facts=facts, args=args)
        return _report.Outcome(name=SECTION, section=section, args=args, data=None)
    threads = args.hash_threads if args.hash_threads > 0 else None
    smp_args, args.smp_note = dp.smp_extra_args(threads, dp.smp_help())
    device = f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / GiB:.0f} GiB)"
    t0 = time.monotonic()
    results = []
    for size in sizes:
        try:
            results.append(measure_size(size, args, smp_args))
        except Exception as exc:  # e.g. out of memory building the state: report, go on
            logger.exception("[%g GiB] failed", size)
            results.append(GpuSizeResult(size_gib=size, error=f"{type(exc).__name__}: {exc}"))
        gc.collect()
        torch.cuda.empty_cache()
    load1 = os.getloadavg()
    facts.append(
        f"load average (1, 5, 15 min) at start: {', '.join(f'{x:.2f}' for x in load0)}; at "
        f"end: {', '.join(f'{x:.2f}' for x in load1)}; the part took "
        f"{(time.monotonic() - t0) / 60:.1f} min"
    )
    data = GpuRun(device=device, results=results)
    section = render(data, command=command, facts=facts, args=args)
    ok = not any(r.error for r in results)
    return _report.Outcome(name=SECTION, section=section, args=args, data=data, ok=ok)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the section and write it into ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _report.finish(run(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
