"""Erasure-coding benchmark: StripeCodec encode and rebuild throughput (ISA-L via pyeclib).

    python bench/ec.py              # 256 MiB of data per pass, 5 repeats (about a minute)
    python bench/ec.py --quick      # 64 MiB, 3 repeats (a smoke test, ~15 s)

How it measures: docs/benchmarks.md, "How the parts measure".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec.py

from bench import _render, _results
from bench._figures import Fig, rows
from bench._stats import MiB
from ftmem.exchange.codec import EC_TYPE, EncodedStripe, StripeCodec, tune_malloc
from ftmem.exchange.placement import chunk_bytes_for

CASES = [(3, 1), (4, 2)]
STRIPES_MIB = [1, 4, 16]


def _passes(repeats: int, run: Callable[[], Any]) -> list[tuple[float, float]]:
    """(wall s, CPU s of this thread) of each of ``repeats`` passes of ``run``, after one
    untimed warm-up pass; what a pass returns is freed after its timing."""
    run()
    out = []
    for _ in range(repeats):
        t, cpu = time.perf_counter(), time.thread_time()
        held = run()
        out.append((time.perf_counter() - t, time.thread_time() - cpu))
        del held
    return out


def _median_s(repeats: int, run: Callable[[], Any]) -> float:
    """The median wall seconds of :func:`_passes`."""
    return statistics.median(wall for wall, _ in _passes(repeats, run))


def _stripes(data: np.ndarray[Any, Any], k: int, stripe_bytes: int) -> tuple[int, list[Any]]:
    """The chunk size for ``k`` data columns, and ``data`` cut into whole stripes (numpy views)."""
    chunk = chunk_bytes_for(k, stripe_bytes)
    stripe = k * chunk
    return chunk, [data[i * stripe : (i + 1) * stripe] for i in range(data.nbytes // stripe)]


def _each(fn: Callable[[Any], Any], items: list[Any]) -> Callable[[], None]:
    """A pass: ``fn`` on every item in turn, nothing kept."""

    def run() -> None:
        for x in items:
            fn(x)

    return run


def measure(
    n: int, m: int, stripe_mib: int, data: np.ndarray[Any, Any], repeats: int, tune: bool
) -> dict[str, Any]:
    """One (n, m, stripe size) configuration on ``data``: a row of :class:`EcResult`."""
    k = n - m
    chunk, arrays = _stripes(data, k, stripe_mib * MiB)
    nbytes = len(arrays) * k * chunk
    codec = StripeCodec(k, m, tune=tune)
    views = [memoryview(a) for a in arrays]
    lengths = [chunk] * k

    def rebuild(x: tuple[memoryview, EncodedStripe]) -> None:
        v, enc = x
        frags: dict[int, Any] = {c: v[c * chunk : (c + 1) * chunk] for c in range(m, k)}
        frags.update({k + t: p for t, p in enumerate(enc.parity)})
        codec.reconstruct(
            frags, list(range(m)), chunk_bytes=chunk, lengths=lengths, checksums=enc.checksums
        )

    ways = {  # measured in this order (glibc's state depends on what ran before)
        # The codec's ECDriver alone; pyeclib's C code takes any buffer without a release hook.
        "pyeclib": _each(codec._driver.encode, arrays),
        "encode_stripe": _each(lambda v: codec.encode_stripe(v, lengths), views),
        "encode": _each(
            lambda v: codec.encode([v[c * chunk : (c + 1) * chunk] for c in range(k)], chunk), views
        ),
    }
    secs = {name: _median_s(repeats, run) for name, run in ways.items()}
    encoded = [codec.encode_stripe(v, lengths) for v in views]
    secs["rebuild"] = _median_s(repeats, _each(rebuild, list(zip(views, encoded, strict=True))))
    out: dict[str, Any] = {"n": n, "m": m, "stripe_mib": stripe_mib, "tuned": tune}
    out |= {name: nbytes / s / 1e9 for name, s in secs.items()}
    out["ms_per_stripe"] = secs["encode_stripe"] / len(views) * 1e3
    return out


def encode_alone(k: int, m: int, stripe: int, nbytes: int, repeats: int) -> tuple[float, float]:
    """``encode_stripe`` alone on ``nbytes`` of random data, one thread, each pass holding its
    parity (as a protector does, page faults included): the best (GB/s wall, GB/s per
    CPU-second) of ``repeats`` passes. Run in a fresh process (``bench/ec_protect.py``)."""
    tune_malloc()
    chunk, stripes = _stripes(np.random.PCG64(7).random_raw(nbytes // 8).view(np.uint8), k, stripe)
    codec, lengths = StripeCodec(k, m), [chunk] * k
    views = [memoryview(s) for s in stripes]
    done = len(views) * k * chunk / 1e9
    passes = _passes(repeats, lambda: [codec.encode_stripe(v, lengths).parity for v in views])
    return max((done / wall, done / max(cpu, 1e-9)) for wall, cpu in passes)


def worker(args: argparse.Namespace) -> None:
    """Measure one configuration in this (fresh) process and print it as one JSON line."""
    tuned = args.malloc == "tuned"
    if tuned and not tune_malloc():
        raise SystemExit("mallopt is not available: cannot measure the tuned setting")
    # os.urandom makes one block above glibc's 32 MiB cap, so no free of a smaller large
    # block raises glibc's dynamic mmap threshold before the "default" measurement.
    data = np.frombuffer(os.urandom(args.data_mib * MiB), dtype=np.uint8)
    print(json.dumps(measure(args.n, args.m, args.stripe_mib, data, args.repeats, tuned)))


def run_worker(malloc: str, n: int, m: int, stripe_mib: int, args: argparse.Namespace) -> Any:
    """The row :func:`worker` prints, run in a fresh interpreter with no ``MALLOC_*`` variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--malloc", malloc]
    cmd += ["--n", str(n), "--m", str(m), "--stripe-mib", str(stripe_mib)]
    cmd += ["--data-mib", str(args.data_mib), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"worker {cmd[2:]} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass(kw_only=True)
class EcResult(_results.PartResult):
    """The codec benchmark's results: one row per (n, m, stripe, malloc setting)."""

    ec_type: str
    data_mib: int
    repeats: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    """n, m, stripe_mib, tuned, and GB/s of pyeclib, encode_stripe, encode, rebuild;
    ms_per_stripe."""


def get_args_parser() -> argparse.ArgumentParser:
    """The command line (the worker's flags are hidden)."""
    p = _results.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats")
    p.add_argument("--data-mib", type=int, default=None, help="data per pass (default 256)")
    p.add_argument("--repeats", type=int, default=None, help="timed passes (default 5)")
    hidden = argparse.SUPPRESS
    p.add_argument("--worker", action="store_true", help=hidden)
    p.add_argument("--malloc", choices=["tuned", "default"], default="tuned", help=hidden)
    for flag, default in (("--n", 3), ("--m", 1), ("--stripe-mib", 1)):
        p.add_argument(flag, type=int, default=default, help=hidden)
    return p


def run(argv: list[str]) -> EcResult:
    """Run both malloc settings of every case in fresh interpreters."""
    args = get_args_parser().parse_args(argv)
    args.data_mib = args.data_mib or (64 if args.quick else 256)
    args.repeats = args.repeats or (3 if args.quick else 5)
    sizes = {"data_mib": args.data_mib, "repeats": args.repeats}
    res = EcResult(argv=argv, machine=_results.machine(), ec_type=EC_TYPE, **sizes)
    res.rows = [
        run_worker(malloc, n, m, stripe_mib, args)
        for n, m in CASES
        for stripe_mib in STRIPES_MIB
        for malloc in ("tuned", "default")
    ]
    _results.finish(res.machine)
    return res


# ------------------------------------------------------------------------------ the section

COLUMNS = [
    Fig("n", get="n"),
    Fig("m", get="m"),
    Fig("stripe", get=lambda x: f"{x['stripe_mib']} MiB"),
    Fig("malloc", get=lambda x: "tuned" if x["tuned"] else "default"),
    Fig("pyeclib encode", ".1f", get="pyeclib"),
    Fig("encode_stripe (+xxh3)", ".1f", get="encode_stripe"),
    Fig("encode (gather k chunks)", ".1f", get="encode"),
    Fig("rebuild m lost", ".1f", get="rebuild"),
    Fig("ms/stripe (GIL held)", ".2f", get="ms_per_stripe"),
]


def sections(r: dict[str, Any]) -> dict[str, list[str]]:
    """Section ``ec``: the codec's throughput (GB/s of data) per case and malloc setting."""
    out = [
        f"- `{r['ec_type']}`, one thread, {r['data_mib']} MiB of data per pass, median of {r['repeats']}; "
        "each case and malloc setting in a fresh interpreter",
        "",
    ]
    order = sorted(r["rows"], key=lambda x: (x["n"], x["stripe_mib"], not x["tuned"]))
    return {"ec": out + rows(COLUMNS, order)}


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(get_args_parser().parse_args())
        sys.exit(0)
    sys.exit(_render.script_main("ec", run))
