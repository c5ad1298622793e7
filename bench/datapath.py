"""Data path benchmark: every CPU cycle a snapshot costs, its stall, time to safe and restore.

    python bench/datapath.py --smoke --out /tmp/dp.md  # 8 MiB state, K=3: does it run (< 1 min)
    python bench/datapath.py --quick                   # 0.25 and 1 GiB, K=8 (a few minutes)
    python bench/datapath.py                           # 0.5, 2 and 4 GiB (4 if memory allows)
    python bench/datapath.py --sizes 1 --saves 12 --compute-ms 100 --no-write

Per state size, in ONE run, on ONE state (square ``nn.Linear`` layers + AdamW's moments, fp32,
built as ``bench/_baselines.build_state`` does) and in one process tree:

* this process starts an SMP (``python -m ftmem.smp``, READY handshake; ``--hash-threads N``
  when that SMP lists the flag) and a rank in a child process (one process, no process group);
* the rank times one memcpy of the state's bytes (``dst.copy_(src)`` into memory touched
  before, one thread: wall and CPU seconds), then ``Checkpointer().save(state, step)`` +
  ``handle.wait()`` once (the first save: it sizes the slots) and K more times; after the
  last one it waits until the SMP reports the step verified (STATUS ``newest_verified``; an
  SMP without that key verifies nothing, the rank hashed what it copied);
* CPU-seconds of those K saves: the rank process (``time.process_time``: every thread, the
  copy thread and ZeroMQ's included; read around the K save/wait calls, the loop does nothing
  else) and the SMP process with its children (psutil ``cpu_times``, until verified), per
  snapshotted GiB, beside the memcpy's;
* restore: ``Checkpointer().load(state)`` in place, from a fresh Checkpointer;
* skips: K every-step saves without waiting on the handle, back to back and with a compute
  stand-in of T ms between them;
* ``dcp.async_save`` with one reused ``DefaultStager`` (async staging) on the same state:
  blocking time per save, and the process's CPU-seconds per GiB over K saves (each waited for).

Before the sizes it measures the hash functions a checksum could use (python-xxhash xxh3_64,
xxh3_128, xxh64, zlib.crc32, hashlib.blake2b) on a 256 MiB buffer, one thread, beside a memcpy.
:func:`run` returns a :class:`DatapathResult` (the rank's raw figures per size, as JSON);
``bench/_goals.py`` derives the per-GiB figures. Section ``bench:datapath``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
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

from bench import _launch, _results
from bench._datapath_node import node_smp, smp_extra_args, smp_help

logger = logging.getLogger("bench.datapath")

PART = "datapath"
GiB = 1 << 30
MiB = 1 << 20

HASH_CHUNK = 2 * MiB
"""Piece size of the hash table's updates (the client's copy moves 2 MiB pieces)."""

_KEYS = ("sizes", "saves", "repeats", "compute_ms", "hash_mib", "idle_s")
PROFILES: dict[str, dict[str, Any]] = {
    "smoke": dict(zip(_KEYS, ("0.0078125", 3, 1, 20.0, 16, 0.2), strict=True)),
    "quick": dict(zip(_KEYS, ("0.25,1", 8, 3, 100.0, 256, 1.0), strict=True)),
    "full": dict(zip(_KEYS, ("0.5,2,4", 8, 3, 100.0, 256, 2.0), strict=True)),
}


def bench_hashes(mib: int, repeats: int) -> list[dict[str, Any]]:
    """CPU and wall seconds of each hash function over ``mib`` MiB, beside a memcpy of it.

    One thread (this one), ``HASH_CHUNK`` updates; median over ``repeats``. Rows:
    {name, wall, cpu, bytes} (lists of seconds).
    """
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
        rows: list[dict[str, Any]] = []
        for name, fn in cases:
            row: dict[str, Any] = {"name": name, "wall": [], "cpu": [], "bytes": n}
            fn()  # warm-up (caches, lazy initialisation)
            for _ in range(repeats):
                c0, w0 = time.process_time(), time.perf_counter()
                fn()
                row["cpu"].append(time.process_time() - c0)
                row["wall"].append(time.perf_counter() - w0)
            rows.append(row)
        return rows
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the rank (child)


@dataclass(kw_only=True)
class SizeResult:
    """What the rank and this process measured for one state size."""

    size_gib: float
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    skipped: str = ""
    """Why the size was not run (not enough memory), else ""."""


def measure_size(size_gib: float, args: argparse.Namespace, smp_args: list[str]) -> SizeResult:
    """Start an SMP and a rank process for one size; collect what the rank measured."""
    result = SizeResult(size_gib=size_gib)
    # The state, its slots, and one more copy: the memcpy's buffer, later DCP's staging.
    need = (2.0 + 1.15 * args.slots) * size_gib + 0.5
    avail = psutil.virtual_memory().available / GiB
    if avail < need:
        result.skipped = (
            f"needs ~{need:.1f} GiB of free memory (state, {args.slots} slots, staging), "
            f"{avail:.1f} GiB available"
        )
        logger.warning("[%g GiB] skipped: %s", size_gib, result.skipped)
        return result
    tmp = Path(tempfile.mkdtemp(prefix="ftmem-bench-dp-"))
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    res_path = tmp / "result.json"
    timeout = args.timeout + 120.0 * size_gib
    wait_timeout = 60.0 + 60.0 * size_gib
    try:
        t0 = time.perf_counter()
        smp_log = tmp / "smp.log"
        with node_smp(run_dir, slots=args.slots, extra_args=smp_args, log_path=smp_log) as smp_id:
            smp, run_id = smp_id
            result.notes.append(f"SMP pid {smp.pid} ready in {time.perf_counter() - t0:.2f} s")
            cmd = [
                sys.executable,
                str(Path(__file__).resolve().parent / "_datapath_node.py"),
                *("--size-gib", repr(size_gib), "--run-dir", str(run_dir)),
                *("--smp-pid", str(smp.pid), "--result", str(res_path)),
                *("--saves", str(args.saves), "--repeats", str(args.repeats)),
                *("--compute-ms", str(args.compute_ms), "--dcp-saves", str(args.dcp_saves)),
                *("--idle-s", str(args.idle_s), "--loose-frac", str(args.loose_frac)),
                *("--wait-timeout", str(wait_timeout)),
                *(("--disk-dir", str(args.disk_dir)) if args.disk_dir else ()),
                *(("--skip-dcp",) if args.skip_dcp else ()),
            ]
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
        for err in result.data.get("errors", []):
            result.notes.append(f"FAILED phase {err}")
    except Exception as exc:  # the SMP did not start, or the result is unreadable
        logger.exception("[%g GiB] failed", size_gib)
        result.error = result.error or f"{type(exc).__name__}: {exc}"
        log = tmp / "smp.log"
        if log.exists():
            result.notes.append(f"SMP log tail: `{log.read_text(errors='replace')[-1000:]!r}`")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


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
    smp_note: str
    """How the SMP's hashing was set up (``--hash-threads``)."""
    hashes: list[dict[str, Any]] = field(default_factory=list)
    """The hash functions on one buffer: name, bytes, wall and CPU seconds per repeat."""
    sizes: list[SizeResult] = field(default_factory=list)


# --------------------------------------------------------------------------- CLI


def get_args_parser() -> argparse.ArgumentParser:
    """The benchmark's command line."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--quick", action="store_true", help="0.25 and 1 GiB, K=8")
    prof.add_argument("--smoke", action="store_true", help="8 MiB, K=3: does it run")
    p.add_argument("--sizes", default=None, help="state sizes in GiB (default: the profile's)")
    p.add_argument("--saves", type=int, default=None, help="K: saves per measurement")
    p.add_argument("--repeats", type=int, default=None, help="memcpy/restore/hash repeats")
    p.add_argument("--compute-ms", type=float, default=None, help="compute between saves (ms)")
    p.add_argument("--dcp-saves", type=int, default=None, help="dcp.async_save saves (K)")
    p.add_argument("--slots", type=int, default=2, help="SMP slots per rank")
    hash_threads = "the SMP's --hash-threads, if it has that flag (default 1; 0: leave its default)"
    p.add_argument("--hash-threads", type=int, default=1, help=hash_threads)
    p.add_argument("--hash-mib", type=int, default=None, help="buffer of the hash table (MiB)")
    p.add_argument("--idle-s", type=float, default=None, help="SMP idle CPU measured this long")
    loose = "fraction of the state in loose tensors (no optimizer: copied inside save())"
    p.add_argument("--loose-frac", type=float, default=0.0, help=loose)
    p.add_argument("--disk-dir", default=None, help="dcp.async_save's directory ($TMPDIR)")
    p.add_argument("--timeout", type=float, default=600.0, help="one size's rank (+120 s/GiB)")
    p.add_argument("--skip-dcp", action="store_true", help="leave out dcp.async_save")
    p.add_argument("--skip-hashes", action="store_true", help="leave out the hash table")
    _results.add_output_args(p)
    return p


def run(argv: list[str]) -> DatapathResult:
    """Parse ``argv``; the hash table, then every size."""
    args = get_args_parser().parse_args(argv)
    args.profile = "smoke" if args.smoke else "quick" if args.quick else "full"
    prof = PROFILES[args.profile]
    for key in _KEYS:
        if getattr(args, key) is None:
            setattr(args, key, prof[key])
    if args.dcp_saves is None:
        args.dcp_saves = args.saves
    sizes = [float(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or args.saves < 1 or args.repeats < 1 or not 0 <= args.loose_frac < 0.9:
        raise ValueError("need a size, --saves >= 1, --repeats >= 1, 0 <= --loose-frac < 0.9")
    machine = _results.machine(args.disk_dir or tempfile.gettempdir())
    hashes: list[dict[str, Any]] = []
    if not args.skip_hashes:
        logger.info("hash table on %d MiB", args.hash_mib)
        hashes = bench_hashes(args.hash_mib, args.repeats)
        gc.collect()
    threads = args.hash_threads if args.hash_threads > 0 else None
    smp_args, smp_note = smp_extra_args(threads, smp_help())
    res = DatapathResult(
        argv=argv,
        machine=machine,
        smp_note=smp_note,
        hashes=hashes,
        **{
            k: getattr(args, k)
            for k in "profile saves repeats compute_ms dcp_saves slots loose_frac".split()
        },
    )
    for size in sizes:
        logger.info("[%g GiB] starting", size)
        res.sizes.append(measure_size(size, args, smp_args))
        gc.collect()
    for r in res.sizes:
        res.errors += [
            f"{r.size_gib:g} GiB: {e}" for e in [r.error, *r.data.get("errors", [])] if e
        ]
    _results.finish(res.machine)
    return res


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_results.script_main(PART, run))
