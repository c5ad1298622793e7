"""The test workload: tests, the chaos runner, the benchmarks and ``examples/demo.sh`` train it
from the checkout.

:data:`SCRIPT` is the file to hand to ``ftmem-launch``; its flags and the lines it prints are
described in its docstring, and read back with :data:`STEP_RE`, :data:`RESUMED_RE` and
:func:`digests`. :data:`TINY_ARGS` makes its model tens of milliseconds a step on one core.
It lives in a directory of its own because Python puts a script's directory first on
``sys.path``; it imports nothing from the checkout (only torch and ftmem), so a rank needs no
more than an installed ftmem.
"""

from __future__ import annotations

import re
from pathlib import Path

SCRIPT = Path(__file__).resolve().with_name("train.py")
"""The workload's training script."""

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

STEP_RE = re.compile(r"\[rank (\d+)\] [\w.]+ INFO: step (\d+) loss")
"""A training step logged by the workload (with ``--log-every 1``)."""
RESUMED_RE = re.compile(r"\[rank (\d+)\] resumed from step (\d+)")
"""What every rank prints after ``ftmem.load``."""
DIGEST_RE = re.compile(r"\[rank (\d+)\] digest ([0-9a-f]+)")
"""The final digest of a rank."""


def digests(text: str) -> dict[int, str]:
    """``{rank: digest}`` from the ``[rank R] digest HEX`` lines of a log."""
    return {int(r): d for r, d in DIGEST_RE.findall(text)}


__all__ = ["DIGEST_RE", "RESUMED_RE", "SCRIPT", "STEP_RE", "TINY_ARGS", "digests"]
