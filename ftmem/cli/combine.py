"""``ftmem combine``: a new DCP checkpoint from a linear combination of flushed ones.

    ftmem combine T/step_0000000100 T/step_0000000200 --coeffs 0.5,0.5 --out /ckpt/mean
    ftmem combine T/step_* --ema 0.9 --out /ckpt/ema
    ftmem combine T/step_* --search evalmod:score --budget 32 --out /ckpt/best

What is combined and how: :mod:`ftmem.tiers.combine`; the search:
:mod:`ftmem.tiers.combine_search`; when it is worth it: docs/api.md, "Combining checkpoints".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Add the ``combine`` subcommand to the ``ftmem`` parser's subparsers."""
    c = sub.add_parser(
        "combine",
        help="write a DCP checkpoint that is a linear combination of flushed ones (LCSC, EMA)",
        description="Combine flushed checkpoints (each verified first) tensor by tensor into a "
        "new stock DCP checkpoint: floating-point tensors are combined, everything else comes "
        "from the base checkpoint.",
    )
    c.add_argument("checkpoints", type=Path, nargs="+", help="checkpoint directories")
    c.add_argument("--out", type=Path, required=True, help="new checkpoint directory to create")
    how = c.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--coeffs",
        default=None,
        help="comma-separated coefficients, one per checkpoint in the order given",
    )
    how.add_argument(
        "--ema",
        type=float,
        default=None,
        metavar="DECAY",
        help="exponential moving average over the checkpoints, oldest step first",
    )
    how.add_argument(
        "--search",
        default=None,
        metavar="MODULE:FUNCTION",
        help="find the coefficients by evolutionary search: FUNCTION(state_dict) returns a "
        "score, higher is better; MODULE is imported as installed (never from the current "
        "directory), or give the file: FILE.py:FUNCTION",
    )
    c.add_argument(
        "--base",
        type=Path,
        default=None,
        help="the checkpoint that non-float tensors, non-tensor state and the step come from "
        "(default: the newest step)",
    )
    c.add_argument(
        "--keys",
        default="",
        help="comma-separated fqn prefixes (e.g. 'model'): only these tensors are combined",
    )
    c.add_argument(
        "--accumulate",
        choices=("float64", "float32"),
        default="float64",
        help="the dtype sums are computed in (default: %(default)s)",
    )
    c.add_argument("--budget", type=int, default=32, help="--search: evaluations in all")
    c.add_argument("--population", type=int, default=8, help="--search: first generation size")
    c.add_argument("--seed", type=int, default=0, help="--search: random seed")
    c.add_argument("--minimize", action="store_true", help="--search: lower scores are better")


def run(args: argparse.Namespace) -> int:
    """Run ``ftmem combine``; 0 on success, 1 on a refused input or a failed write."""
    from ftmem.errors import FtmemError
    from ftmem.tiers.combine import ACCUMULATE, Combination, Ema, InputSet, Linear, write_combined

    acc = ACCUMULATE[args.accumulate]
    keys = [k for k in args.keys.split(",") if k]
    try:
        how: Combination
        if args.coeffs is not None:
            how = Linear(tuple(float(x) for x in args.coeffs.split(",")))
        elif args.ema is not None:
            if not 0.0 <= args.ema <= 1.0:
                raise ValueError(f"--ema {args.ema}: the decay must be in [0, 1]")
            how = Ema(args.ema)
        inputs = InputSet(args.checkpoints, args.base, keys, by_step=args.ema is not None)
        if args.search is not None:
            from ftmem.tiers.combine_search import load_evaluator, search

            found = search(
                inputs,
                load_evaluator(args.search),
                budget=args.budget,
                population=args.population,
                seed=args.seed,
                minimize=args.minimize,
                accumulate=acc,
            )
            how = Linear(found.best.coeffs)
            coeffs = ",".join(f"{c:.6g}" for c in found.best.coeffs)
            print(
                f"search: best score {found.best.score:g} with coefficients {coeffs} (the "
                f"newest checkpoint alone: {found.baseline.score:g}; {len(found.trials)} "
                "evaluations)"
            )
        result = write_combined(inputs, how, args.out, acc)
    except (FtmemError, OSError, ValueError) as exc:
        print(f"ftmem combine: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {result.path}: step {result.step}, {result.combined} tensors combined, "
        f"{result.nbytes / 2**20:.1f} MiB"
    )
    return 0
