"""Mistakes in a training loop that silently break an exact resume, caught at run time.

Each is logged once per process as a warning that names the fix (docs/api.md, "Pitfalls
caught at run time"): a DDP module with ``find_unused_parameters=False`` on 3 or more ranks
(:func:`check_ddp`), a ``DataLoader`` without its own generator (:func:`check_loaders`), a
state with no optimizer (:func:`check_optimizer`), and shared memory too small for the slots.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

_warned: set[str] = set()


def warn_once(key: str, message: str) -> bool:
    """Log ``message`` as a warning unless ``key`` was warned about already; True if logged."""
    if key in _warned:
        return False
    _warned.add(key)
    log.warning("PITFALL: %s", message)
    return True


def _values(state: Mapping[str, Any], depth: int = 2) -> Iterator[Any]:
    """The state's values, and those of nested mappings (``depth`` levels)."""
    for value in state.values():
        yield value
        if depth > 1 and isinstance(value, Mapping):
            yield from _values(value, depth - 1)


def ddp_wrapper(module: torch.nn.Module) -> Any:
    """The ``DistributedDataParallel`` that wraps ``module`` (or is it), else None."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(module, DDP):
        return module
    # DDP keeps it in its ``_modules`` dict, which its instance holds directly or, once
    # something materialised the instance's ``__dict__``, through that dict.
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, DDP) and owner.module is module:
                return owner
            if isinstance(owner, dict) and owner.get("_modules") is holder:
                for ddp in gc.get_referrers(owner):
                    if isinstance(ddp, DDP) and ddp.module is module:
                        return ddp
    return None


def check_ddp(state: Mapping[str, Any], world_size: int) -> None:
    """Warn (once) about a DDP built with ``find_unused_parameters=False`` on >= 3 ranks."""
    if world_size < 3 or "ddp" in _warned:
        return
    for value in _values(state):
        if isinstance(value, torch.nn.Module):
            ddp = ddp_wrapper(value)
            if ddp is not None and not getattr(ddp, "find_unused_parameters", True):
                warn_once(
                    "ddp",
                    f"DistributedDataParallel with find_unused_parameters=False on {world_size} "
                    "ranks: DDP rebuilds its gradient buckets after a process's first "
                    "iteration, so the first step after a restart sums the gradients in "
                    "another order than the run without the failure (bitwise divergence). "
                    "Build it with find_unused_parameters=True, which keeps the initial "
                    "bucket layout for good.",
                )
                return


def check_loaders(state: Mapping[str, Any]) -> None:
    """Warn (once) about a DataLoader in the state that has no generator of its own."""
    from torch.utils.data import DataLoader

    for value in _values(state):
        if isinstance(value, DataLoader) and value.generator is None:
            warn_once(
                "loader",
                f"the {type(value).__name__} in the state has no generator of its own: "
                "iter() on it draws a seed from the global RNG that ftmem.RNGState has just "
                "restored, so every later random draw (dropout, augmentation) shifts against "
                "the run without the failure. Give it one, "
                "DataLoader(..., generator=torch.Generator().manual_seed(seed)), and keep its "
                "position in the state (a Stateful loader such as torchdata's "
                "StatefulDataLoader).",
            )
            return


def check_optimizer(has_optimizer: bool) -> None:
    """Warn (once) when the saved state holds no optimizer (no fence for the copy)."""
    if not has_optimizer:
        warn_once(
            "no-optimizer",
            "the state saved holds no torch.optim.Optimizer: nothing fences the background "
            "copy, so code that changes the parameters before it finishes can tear the "
            "snapshot. Put the optimizer in the state, or call ftmem.wait() before changing "
            "the saved tensors.",
        )
