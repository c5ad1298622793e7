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
from typing import Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/ec.py

from bench import _results
from bench._figures import Fig, rows
from bench._stats import MiB
from ftmem.exchange.codec import EC_TYPE, EncodedStripe, StripeCodec, tune_malloc
from ftmem.exchange.placement import chunk_bytes_for

CASES = [(3, 1), (4, 2)]
STRIPES_MIB = [1, 4, 16]


def _median_gbps(nbytes: int, repeats: int, run: Callable[[], None]) -> tuple[float, float]:
    """Run ``run`` once to warm up, then ``repeats`` times; (median GB/s, median seconds)."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return nbytes / med / 1e9, med


def measure(
    n: int, m: int, stripe_mib: int, data: np.ndarray[Any, Any], repeats: int, tune: bool
) -> dict[str, Any]:
    """Measure one (n, m, stripe size) configuration on ``data``."""
    k = n - m
    chunk = chunk_bytes_for(k, stripe_mib * MiB)
    stripe = k * chunk
    count = data.nbytes // stripe
    nbytes = count * stripe
    codec = StripeCodec(k, m, tune=tune)
    driver = codec._driver  # the same ECDriver, to time pyeclib alone
    # pyeclib's stub says bytes; its C code takes any buffer without a release hook (numpy).
    arrays = [cast(bytes, data[i * stripe : (i + 1) * stripe]) for i in range(count)]
    views = [memoryview(a) for a in arrays]
    lengths = [chunk] * k

    def raw() -> None:
        for a in arrays:
            driver.encode(a)

    def in_place() -> None:
        for v in views:
            codec.encode_stripe(v, lengths)

    def gathered() -> None:
        for v in views:
            codec.encode([v[c * chunk : (c + 1) * chunk] for c in range(k)], chunk)

    lost = list(range(m))
    encoded: list[EncodedStripe] = []

    def rebuild() -> None:
        for v, enc in zip(views, encoded, strict=True):
            frags: dict[int, Any] = {c: v[c * chunk : (c + 1) * chunk] for c in range(m, k)}
            frags.update({k + t: p for t, p in enumerate(enc.parity)})
            codec.reconstruct(
                frags, lost, chunk_bytes=chunk, lengths=lengths, checksums=enc.checksums
            )

    out: dict[str, Any] = {"n": n, "m": m, "stripe_mib": stripe_mib, "tuned": tune}
    out["pyeclib"], _ = _median_gbps(nbytes, repeats, raw)
    out["encode_stripe"], secs = _median_gbps(nbytes, repeats, in_place)
    out["ms_per_stripe"] = secs / count * 1e3
    out["encode"], _ = _median_gbps(nbytes, repeats, gathered)
    encoded.extend(codec.encode_stripe(v, lengths) for v in views)
    out["rebuild"], _ = _median_gbps(nbytes, repeats, rebuild)
    return out


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
    """Run :func:`worker` in a fresh interpreter with no ``MALLOC_*`` variables."""
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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    hidden = argparse.SUPPRESS
    p.add_argument("--malloc", choices=["tuned", "default"], default="tuned", help=hidden)
    p.add_argument("--n", type=int, default=3, help=hidden)
    p.add_argument("--m", type=int, default=1, help=hidden)
    p.add_argument("--stripe-mib", type=int, default=1, help=hidden)
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

Doc = dict[str, Any]


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


def sections(r: Doc) -> dict[str, list[str]]:
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
    sys.exit(_results.script_main("ec", run))
