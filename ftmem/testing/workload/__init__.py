"""The test workload, shipped inside the package so that ``python -m ftmem.testing.chaos`` runs
from an installed wheel (no repository checkout): tests, the chaos runner and the benchmarks
train it.

:data:`SCRIPT` is the file to hand to ``ftmem-launch`` (or ``-m ftmem.testing.workload.train``);
its flags and the lines it prints are described in its docstring. :data:`TINY_ARGS` makes its
model tens of milliseconds a step on one core. It lives in a directory of its own because
Python puts a script's directory first on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("train.py")
"""The workload's training script (a file inside the installed ``ftmem`` package)."""

TINY_ARGS = [
    "--d-model=32",
    "--n-layers=1",
    "--n-heads=2",
    "--vocab=64",
    "--seq-len=16",
    "--batch-size=2",
    "--log-every=1",
]
"""Model arguments of :data:`SCRIPT` for a model of a few milliseconds a step, a loss line
logged every step (what the chaos runner reads)."""

__all__ = ["SCRIPT", "TINY_ARGS"]
