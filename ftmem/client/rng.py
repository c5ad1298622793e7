"""RNGState: a Stateful holding this process's random number generators.

Add it to the state with one line, ``state["rng"] = ftmem.RNGState()``; every rank then
saves and restores its own Python, NumPy (if installed), torch CPU and CUDA generators.
Everything is stored as tensors and plain values (no pickled objects).
"""

from __future__ import annotations

import array
import random
from collections.abc import Sequence
from typing import Any

import torch


def _int64_tensor(values: tuple[int, ...]) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64)``, faster (through an array): every save of
    Python's 625-word generator state pays it."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


class RNGState:
    """Save and restore the per-rank RNG state (python, numpy, torch CPU, CUDA when present)."""

    def state_dict(self) -> dict[str, Any]:
        """Return the current generator states."""
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python": {
                "version": version,
                "state": _int64_tensor(internal),
                "gauss": gauss,
            },
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            sd["numpy"] = {
                "name": str(name),
                "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached": float(cached),
            }
        cuda_on = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        if cuda_on:
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_resharded_state(
        self, states: Sequence[dict[str, Any]], rank: int, world_size: int
    ) -> None:
        """After the job's size changed (``states``: every old rank's, by old rank): rank
        ``r`` takes old rank ``r mod len(states)``'s generators, so each rank still draws a
        stream of its own when the job shrinks (a grown job's new ranks repeat old streams)."""
        self.load_state_dict(states[rank % len(states)])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the generator states saved by :meth:`state_dict`."""
        py = sd["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(sd["torch"])
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            np.random.set_state(
                (
                    n["name"],
                    n["keys"].numpy().astype(np.uint32),
                    n["pos"],
                    n["has_gauss"],
                    n["cached"],
                )
            )
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(sd["cuda"])


class DeferredRNGState(RNGState):
    """RNG states whose restore waits for :meth:`apply`: for trainers that must draw from the
    fresh process's generators first (creating and skipping a data loader's iterator) and set
    the snapshot's states after that, as the run without the failure drew them."""

    def __init__(self) -> None:
        self.saved: dict[str, Any] | None = None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep the states for :meth:`apply` (nothing changes yet)."""
        self.saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}

    def apply(self) -> bool:
        """Set the kept states (once); True if there were any."""
        saved, self.saved = self.saved, None
        if saved is None:
            return False
        RNGState.load_state_dict(self, saved)
        return True
