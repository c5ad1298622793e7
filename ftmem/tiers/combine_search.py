"""The coefficients of a checkpoint combination, found by evolutionary search (as in LCSC).

The user's evaluation (``module:function``) gets each candidate's combined state, nested as
saved, and returns a score (higher is better; ``minimize``: lower). Each candidate is a
coefficient vector summing to 1 (negative coefficients extrapolate). The first generation
holds the newest checkpoint alone (the baseline), the uniform average, an EMA (decay 0.5) and
random points of the simplex; then, until ``budget`` trials, children of the best half (a blend
of two half of the time) moved by Gaussian noise shrinking from 0.3 to 0.03 and normalised.
Deterministic for a ``seed``; each state is streamed by
:func:`~ftmem.tiers.combine.combined_state`.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ftmem._logging import get_logger
from ftmem.tiers.combine import CombineError, InputSet, Linear, combined_state, ema_coefficients

log = get_logger(__name__)

Evaluate = Callable[[dict[str, Any]], float]


def load_evaluator(spec: str) -> Evaluate:
    """The function named by ``MODULE:FUNCTION`` (a module importable as installed: the current
    directory is never searched, so a file planted there is never imported) or by
    ``FILE.py:FUNCTION`` (that file, loaded by its path).

    Raises:
        CombineError: the spec is malformed, or the module or function cannot be found.
    """
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise CombineError(f"--search wants MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}")
    try:
        mod = _load_file(module) if module.endswith(".py") else _import_outside_cwd(module)
        fn = getattr(mod, name)
    except (ImportError, AttributeError, OSError) as exc:
        raise CombineError(f"cannot load the evaluation {spec!r}: {exc}") from exc
    if not callable(fn):
        raise CombineError(f"the evaluation {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def _import_outside_cwd(module: str) -> Any:
    """``importlib.import_module(module)`` with the current directory (which ``python -m``
    puts first on ``sys.path``) left out of the search."""
    cwd = os.getcwd()
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    try:
        return importlib.import_module(module)
    finally:
        sys.path[:] = saved


def _load_file(path: str) -> Any:
    """The module in file ``path`` (what the user named, wherever it is)."""
    file = os.path.abspath(path)
    if not os.path.isfile(file):
        raise ImportError(f"no file {file}")
    spec = importlib.util.spec_from_file_location(f"ftmem_search_{abs(hash(file))}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True, slots=True)
class Trial:
    """One evaluated candidate."""

    coeffs: tuple[float, ...]
    score: float


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The best candidate, the baseline's score (the newest checkpoint alone), every trial."""

    best: Trial
    baseline: Trial
    trials: list[Trial] = field(default_factory=list)


def _normalised(c: list[float]) -> tuple[float, ...] | None:
    total = sum(c)
    if not math.isfinite(total) or abs(total) < 1e-6:
        return None
    return tuple(x / total for x in c)


def _first_generation(
    n: int, newest: int, population: int, rng: random.Random
) -> list[tuple[float, ...]]:
    one_hot = [0.0] * n
    one_hot[newest] = 1.0
    firsts: list[tuple[float, ...]] = [tuple(one_hot)]
    if n > 1:
        firsts += [tuple([1.0 / n] * n), ema_coefficients(0.5, n)]
    while len(firsts) < max(population, 1):
        draw = [rng.expovariate(1.0) for _ in range(n)]  # a uniform point of the simplex
        firsts.append(_normalised(draw) or tuple(one_hot))
    return firsts[: max(population, 1)]


def search(
    inputs: InputSet,
    evaluate: Evaluate,
    budget: int = 32,
    population: int = 8,
    seed: int = 0,
    minimize: bool = False,
    accumulate: torch.dtype = torch.float64,
) -> SearchResult:
    """Search the coefficients (see the module docstring); the best of ``budget`` trials.

    A score that is not a finite number counts as the worst possible; an exception from the
    evaluation stops the search (it is the user's code: its error is theirs to see).
    """
    if budget < 1:
        raise CombineError("--budget must be at least 1")
    rng = random.Random(seed)
    n = len(inputs.ckpts)
    sign = -1.0 if minimize else 1.0
    trials: list[Trial] = []

    def run(coeffs: tuple[float, ...]) -> None:
        state = combined_state(inputs, Linear(coeffs), accumulate)
        raw = float(evaluate(state))
        trials.append(Trial(coeffs, raw))
        log.info("trial %d/%d: coefficients %s score %g", len(trials), budget, coeffs, raw)

    def key(t: Trial) -> float:
        return sign * t.score if math.isfinite(t.score) else -math.inf

    for coeffs in _first_generation(n, inputs.base, population, rng):
        if len(trials) < budget:
            run(coeffs)
    while len(trials) < budget:
        elite = sorted(trials, key=key, reverse=True)[: max(1, population // 2)]
        parent = list(rng.choice(elite).coeffs)
        if len(elite) > 1 and rng.random() < 0.5:
            other = rng.choice(elite).coeffs
            parent = [(a + b) / 2 for a, b in zip(parent, other, strict=True)]
        scale = 0.3 - 0.27 * len(trials) / budget
        child = _normalised([c + rng.gauss(0.0, scale) for c in parent])
        if child is not None:
            run(child)
    best = max(trials, key=key)
    return SearchResult(best=best, baseline=trials[0], trials=trials)
