"""The statistics every benchmark and the renderer share (pure; no torch, no I/O).

Each figure is a list of per-repeat values; a table shows ``median (min-max)`` of the finite
ones. Missing values (None, NaN) are left out, never counted as zero.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

GiB = 1 << 30
MiB = 1 << 20


def finite(values: Iterable[float | int | None]) -> list[float]:
    """The values that are numbers (not None, not NaN, not infinite)."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def median(values: Iterable[float | int | None]) -> float | None:
    """The median of the finite values, None if there are none."""
    vals = finite(values)
    return statistics.median(vals) if vals else None


def low(values: Iterable[float | int | None]) -> float | None:
    """The smallest finite value, None if there are none."""
    vals = finite(values)
    return min(vals) if vals else None


def high(values: Iterable[float | int | None]) -> float | None:
    """The largest finite value, None if there are none."""
    vals = finite(values)
    return max(vals) if vals else None


def percentile(values: Iterable[float | int | None], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear interpolation) of the finite values."""
    vals = sorted(finite(values))
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None if either is missing or ``b`` is zero."""
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


def ratios(a: Sequence[float | None], b: Sequence[float | None]) -> list[float]:
    """Pairwise ``a[i] / b[i]`` of figures taken side by side (pairs with a gap left out)."""
    return [r for x, y in zip(a, b, strict=False) if (r := ratio(x, y)) is not None]


def scale(values: Iterable[float | int | None], factor: float) -> list[float]:
    """Every finite value times ``factor`` (e.g. ``1 / GiB of the state`` for s/GiB)."""
    return [v * factor for v in finite(values)]


def per_gib(values: Iterable[float | int | None], nbytes: float) -> list[float]:
    """Seconds (or CPU seconds) per GiB of ``nbytes``."""
    return scale(values, GiB / nbytes) if nbytes else []


def gbps(nbytes: float, seconds: Iterable[float | int | None]) -> list[float]:
    """GB/s (1e9 B) of moving ``nbytes`` in each of ``seconds``."""
    return [nbytes / s / 1e9 for s in finite(seconds) if s > 0]


def fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    """One number, ``-`` when missing."""
    return "-" if x is None or not math.isfinite(x) else f"{format(x, spec)}{unit}"


def stat(values: Iterable[float | int | None], spec: str = ".2f", unit: str = "") -> str:
    """``median (min-max)`` of the finite values (the median alone when the range is one value)."""
    vals = finite(values)
    if not vals:
        return "-"
    med = format(statistics.median(vals), spec)
    lo, hi = format(min(vals), spec), format(max(vals), spec)
    return f"{med}{unit}" if lo == hi else f"{med}{unit} ({lo}-{hi})"


def pct(values: Iterable[float | int | None], spec: str = "+.1f") -> str:
    """``stat`` of ratios shown as a change in percent (1.05 -> +5.0%)."""
    return stat([(v - 1) * 100 for v in finite(values)], spec, "%")
