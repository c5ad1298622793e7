"""Where a GPU snapshot's time goes: the link and page-locking baselines, then ftmem's saves
and restore of the same CUDA state taken apart phase by phase (needs CUDA).

    python bench/gpu_phases.py [--gib 4] [--saves 10] [--json out.json]

Printed, one line a figure (and ``--json``):

- the link: D2H and H2D of the state's tensors into/out of ``pin_memory`` buffers, into a
  /dev/shm mapping page-locked with ``cudaHostRegister`` and into the same mapping not locked;
  what ``cudaHostRegister`` costs on a fresh file (its pages not yet allocated) and on one whose
  pages are resident; xxh3-64 over the mapping on 1 and 8 threads; a host memcpy;
- each save: ``save()`` (the stall), ``save()`` to the copy thread seeing the D2H done, the
  COMMIT's round trip, the next slot's mapping, to ``wait()`` returning; every mapping and
  page-locking of a slot with its duration;
- the restore: its wall time and the functions it spends it in (cProfile, top by own time).

It is a profile, not a benchmark with a section of its own: docs/benchmarks.md's GPU section
comes from ``bench/datapath.py --gpu``; what this finds goes into the code and that section.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import mmap
import os
import pstats
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _baselines as baselines
from bench._datapath_rank import connect, node_smp, save_and_wait
from bench.datapath import build_cuda_state

GiB = 1 << 30
RESULT: dict[str, Any] = {}
EVENTS: list[tuple[float, str, float, str]] = []  # (t, what, seconds, detail)
T0 = time.perf_counter()


def put(key: str, value: Any, text: str) -> None:
    RESULT[key] = value
    print(f"{key:38s} {text}", flush=True)


def section(name: str, fn: Callable[[], None]) -> None:
    """Run one part; a failure is printed and recorded, the next part still runs."""
    print(f"-- {name}", flush=True)
    try:
        fn()
    except Exception:  # a profile keeps what it measured
        tb = traceback.format_exc()
        print(tb, flush=True)
        RESULT.setdefault("errors", []).append(f"{name}: {tb.splitlines()[-1]}")


def timed(fn: Callable[[], Any], repeats: int = 3) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def shm_map(nbytes: int) -> tuple[mmap.mmap, torch.Tensor, str]:
    fd, path = tempfile.mkstemp(prefix="ftmem-phases-", dir="/dev/shm")
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8), path


def link(tensors: list[torch.Tensor], nbytes: int) -> None:
    cudart = torch.cuda.cudart()

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        out, at = [], 0
        for t in tensors:
            out.append(buf[at : at + t.nbytes].view(t.dtype).view(t.shape))
            at += t.nbytes
        return out

    def d2h(dst: list[torch.Tensor]) -> None:
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s, non_blocking=True)

    def h2d(src: list[torch.Tensor]) -> None:
        for d, s in zip(tensors, src, strict=True):
            d.copy_(s, non_blocking=True)

    def gbps(ts: list[float]) -> str:
        return f"{nbytes / min(ts) / 1e9:6.1f} GB/s best, {nbytes / max(ts) / 1e9:6.1f} worst"

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    hold: dict[str, Any] = {"pinned": views(pinned)}
    ts = timed(lambda: d2h(hold["pinned"]))
    put("d2h_pin_memory_gbps", nbytes / min(ts) / 1e9, gbps(ts))
    ts = timed(lambda: h2d(hold["pinned"]))
    put("h2d_pin_memory_gbps", nbytes / min(ts) / 1e9, gbps(ts))
    hold.clear()
    del pinned

    mm, buf, path = shm_map(nbytes)
    try:
        hold["shm"] = views(buf)
        ts = timed(lambda: d2h(hold["shm"]), 2)  # the first one allocates the file's pages
        put("d2h_shm_unlocked_first_s", ts[0], f"{ts[0]:.3f} s (pages allocated by the copy)")
        put("d2h_shm_unlocked_gbps", nbytes / ts[1] / 1e9, f"{nbytes / ts[1] / 1e9:6.1f} GB/s")
        ts = timed(lambda: h2d(hold["shm"]), 2)
        put("h2d_shm_unlocked_gbps", nbytes / min(ts) / 1e9, gbps(ts))
        ptr = buf.data_ptr()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        reg = time.perf_counter() - t0
        put("register_resident_s_per_gib", reg / (nbytes / GiB), f"{reg:.3f} s ({err})")
        ts = timed(lambda: d2h(hold["shm"]))
        put("d2h_shm_locked_gbps", nbytes / min(ts) / 1e9, gbps(ts))
        ts = timed(lambda: h2d(hold["shm"]))
        put("h2d_shm_locked_gbps", nbytes / min(ts) / 1e9, gbps(ts))
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(ptr)
        put("unregister_s", time.perf_counter() - t0, f"{time.perf_counter() - t0:.3f} s")

        import xxhash

        mv = hold["mv"] = memoryview(mm)
        one = min(nbytes, GiB)
        t0 = time.perf_counter()
        for i in range(0, one, 4 << 20):
            xxhash.xxh3_64_hexdigest(mv[i : i + (4 << 20)])
        h1 = time.perf_counter() - t0
        put("xxh3_1_thread_gbps", one / h1 / 1e9, f"{one / h1 / 1e9:6.1f} GB/s")
        with ThreadPoolExecutor(8) as pool:
            t0 = time.perf_counter()
            list(
                pool.map(
                    lambda i: xxhash.xxh3_64_hexdigest(hold["mv"][i : i + (4 << 20)]),
                    range(0, nbytes, 4 << 20),
                )
            )
            h8 = time.perf_counter() - t0
        put("xxh3_8_threads_gbps", nbytes / h8 / 1e9, f"{nbytes / h8 / 1e9:6.1f} GB/s")
        dst = torch.empty(one, dtype=torch.uint8)
        dst.copy_(buf[:one])
        t0 = time.perf_counter()
        dst.copy_(buf[:one])
        put(
            "host_memcpy_gbps",
            one / (time.perf_counter() - t0) / 1e9,
            f"{one / (time.perf_counter() - t0) / 1e9:6.1f} GB/s (torch, {torch.get_num_threads()} threads)",
        )
        hold.clear()
        del dst, mv, buf
    finally:
        mm.close()
        os.unlink(path)

    mm, buf, path = shm_map(nbytes)  # fresh: register allocates and locks every page
    try:
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0)
        reg = time.perf_counter() - t0
        put("register_fresh_s_per_gib", reg / (nbytes / GiB), f"{reg:.3f} s ({err})")
        cudart.cudaHostUnregister(buf.data_ptr())
        del buf
    finally:
        mm.close()
        os.unlink(path)


def instrument() -> None:
    """Record the copy thread's phases and every slot mapping and page-locking."""
    from ftmem.client import slot_maps, staging

    def note(what: str, t0: float, detail: str = "") -> None:
        EVENTS.append((t0 - T0, what, time.perf_counter() - t0, detail))

    reg = slot_maps.register_pinned

    def register(seg: Any) -> None:
        t0 = time.perf_counter()
        reg(seg)
        note("register_pinned", t0, f"{seg.nbytes / GiB:.2f} GiB {threading.current_thread().name}")

    slot_maps.register_pinned = register
    seg_fn = slot_maps.SlotMappings.segment

    def segment(self: Any, path: Any, capacity: int) -> Any:
        t0 = time.perf_counter()
        out = seg_fn(self, path, capacity)
        note("segment", t0, f"{capacity / GiB:.2f} GiB {threading.current_thread().name}")
        return out

    slot_maps.SlotMappings.segment = segment
    do = staging.CopyWorker._do

    def _do(self: Any, job: Any, client: Any) -> None:
        t0 = time.perf_counter()
        if job.cuda_event is not None:
            job.cuda_event.synchronize()
        note("d2h_wait", t0, f"step {job.step}")
        if job.premap is not None:
            pm = job.premap

            def premap(path: Any, cap: int) -> None:
                t1 = time.perf_counter()
                pm(path, cap)
                note("premap", t1, f"after step {job.step}")

            job.premap = premap
        t1 = time.perf_counter()
        do(self, job, client)
        note("commit_and_premap", t1, f"step {job.step}")

    staging.CopyWorker._do = _do
    commit = staging.CopyWorker._commit

    def _commit(self: Any, job: Any, client: Any) -> Any:
        t0 = time.perf_counter()
        out = commit(self, job, client)
        note("commit_rtt", t0, f"step {job.step}")
        return out

    staging.CopyWorker._commit = _commit


def saves_and_restore(
    st: dict[str, Any], n: int, smp_extra: list[str], variants: bool = False
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-phases-"))
    (run_dir := tmp / "run").mkdir(mode=0o700)
    rows = []
    with node_smp(run_dir, slots=2, extra_args=smp_extra, log_path=tmp / "smp.log") as _:
        with connect(run_dir) as (ckpt, _client):
            for s in range(1, n + 1):
                torch.cuda.synchronize()
                one = save_and_wait(ckpt, st, s, 300.0)
                one.update(step=s, t=time.perf_counter() - T0 - one["safe_s"])
                rows.append(one)
                print(
                    f"save {s:2d} at {one['t']:7.3f}: save() {one['save_s']:.4f} s, to commit "
                    f"{one['safe_s']:.3f} s {'skipped: ' + str(one['reason']) if one['skipped'] else ''}"
                    f"{one['error']}",
                    flush=True,
                )
            RESULT["saves"] = rows
            print("events (t since start, what, seconds, detail):")
            for t, what, d, detail in EVENTS:
                print(f"  {t:8.3f} {what:18s} {d:7.4f} {detail}")
            RESULT["events"] = EVENTS
        with connect(run_dir, client=False) as (ckpt, _):
            walls = timed(lambda: ckpt.load(st), 2)
            put("restore_s", walls, ", ".join(f"{w:.3f} s" for w in walls))
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            ckpt.load(st)
            torch.cuda.synchronize()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
            print(text.getvalue())
            RESULT["restore_profile"] = text.getvalue()
            if variants:
                restore_variants(ckpt, st)


def training_loop(st: dict[str, Any], steps: int, step_s: float) -> None:
    """A fresh SMP and a loop as training runs it: a save every step, ``step_s`` of other
    work between (a sleep: the GPU copies meanwhile), never a wait: every save()'s stall
    from the very first, the skips and why, the first step committed and when."""
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-phases-loop-"))
    (run_dir := tmp / "run").mkdir(mode=0o700)
    stalls, skipped = [], []
    with node_smp(run_dir, slots=2, extra_args=[], log_path=tmp / "smp.log") as _:
        with connect(run_dir) as (ckpt, _client):
            t0 = time.perf_counter()
            for s in range(1, steps + 1):
                time.sleep(step_s)
                t1 = time.perf_counter()
                h = ckpt.save(st, step=s)
                stalls.append(time.perf_counter() - t1)
                if h.skipped:
                    skipped.append((s, h.reason))
            ckpt.wait(timeout=300)
            wall = time.perf_counter() - t0
    put(
        "loop_max_stall_s",
        max(stalls),
        f"{max(stalls):.4f} s (step {stalls.index(max(stalls)) + 1})",
    )
    put("loop_stalls_s", stalls, " ".join(f"{x * 1000:.1f}" for x in stalls) + " ms")
    put("loop_skipped", skipped, f"{len(skipped)} of {steps}: {skipped}")
    put("loop_wall_s", wall, f"{wall:.2f} s for {steps} steps of {step_s} s")


def restore_variants(ckpt: Any, st: dict[str, Any]) -> None:
    """The restore with other thread counts and staging buffer sizes than the shipped ones
    (set on the module for this process only): the best of 3 loads each."""
    from ftmem.client import device_restore as restore

    shipped = (restore.device_threads, restore.STAGING_BYTES)
    rows = []
    try:
        for threads in (4, 8, 12, 16):
            for mib in (8, 16, 32):
                restore.device_threads = lambda t=threads: t  # type: ignore[misc]
                restore.STAGING_BYTES = mib << 20
                restore._staging.clear()
                best = min(timed(lambda: ckpt.load(st), 3))
                rows.append({"threads": threads, "staging_mib": mib, "restore_s": best})
                print(
                    f"restore, {threads:2d} threads, {mib:2d} MiB buffers: {best:.3f} s", flush=True
                )
    finally:
        restore.device_threads, restore.STAGING_BYTES = shipped  # type: ignore[misc]
        restore._staging.clear()
    RESULT["restore_variants"] = rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--json", type=Path)
    p.add_argument("--variants", action="store_true", help="restore with other threads/buffers")
    p.add_argument("--no-link", action="store_true", help="skip the link's own figures")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores")
    model, optimizer, layers = build_cuda_state(args.gib)
    st = {"model": model, "optim": optimizer}
    every = baselines.state_tensors({"model": model.state_dict(), "optim": optimizer.state_dict()})
    tensors = [t for t in every if t.is_cuda]
    nbytes = sum(t.nbytes for t in tensors)
    put(
        "state",
        [layers, nbytes, len(tensors)],
        f"{layers}, {nbytes / GiB:.2f} GiB, {len(tensors)} tensors",
    )
    if not args.no_link:
        section("link", lambda: link(tensors, nbytes))
    instrument()
    section("saves and restore", lambda: saves_and_restore(st, args.saves, [], args.variants))
    section("a training loop: a save every step", lambda: training_loop(st, 30, 0.1))
    if args.json:
        args.json.write_text(json.dumps(RESULT, indent=1, default=str))
    return 1 if RESULT.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
