"""What a save of one state copies, and when: the cached plan of a :class:`Checkpointer` save.

A state's tensors fall into four groups by where they live and who changes them: CPU
tensors the optimizers own (copied lazily by the copy thread, fenced by the optimizer
pre-hook), other CPU tensors (copied inside ``save``), and the same two on a device (copied
by a side stream). The plan is pure: it reads the tensors' storages, never copies a byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ftmem.client.flatten import Flat, Placement, plan_layout, signature_of, storage_ptr


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """What a save of a state of one signature does (cached while the signature and the
    tensors' storages stay the same)."""

    key: tuple[Any, ...]
    layout: Placement
    eager: list[int]
    """CPU tensors copied inside ``save`` (buffers, RNG, anything the forward may change)."""
    lazy: list[int]
    """CPU tensors only the optimizers change: copied by the worker, largest first."""
    cuda: list[int]
    """Device tensors the optimizers do not own (buffers...): copied first by a side stream,
    which the current stream then waits for (on the device)."""
    cuda_lazy: list[int]
    """Device tensors only the optimizers change: copied next by the side stream, fenced by
    the optimizer pre-hook."""

    def fits(self, sig: Any, tensors: list[torch.Tensor]) -> bool:
        """True if this plan serves a state of signature ``sig`` whose lazily copied
        tensors are still the same storages."""
        return self.key[0] == sig and all(
            tensors[i].data_ptr() == p
            for i, p in zip(self.lazy + self.cuda_lazy, self.key[1], strict=True)
        )


def plan_save(
    flat: Flat, previous: CopyPlan | None, optimizers: list[torch.optim.Optimizer]
) -> CopyPlan:
    """The plan of a save of ``flat`` (``previous`` if it still fits).

    Reused while the state's signature is the same and the tensors it copies lazily are
    still the same storages (other tensors, e.g. a fresh RNG state each save, may be new
    objects every time: they are copied eagerly wherever they live). ``optimizers``: those
    in the state; their parameters and state tensors are copied lazily.
    """
    sig = signature_of(flat)
    tensors = flat.tensors
    if previous is not None and previous.fits(sig, tensors):
        return previous
    same = previous is not None and previous.key[0] == sig
    layout = previous.layout if previous is not None and same else plan_layout(flat)
    lazy_ptrs = optimizer_storage_ptrs(optimizers)
    eager: list[int] = []
    lazy: list[int] = []
    cuda: list[int] = []
    cuda_lazy: list[int] = []
    for i, t in enumerate(tensors):
        owned = bool(lazy_ptrs) and t.untyped_storage().data_ptr() in lazy_ptrs
        if t.device.type != "cpu":
            (cuda_lazy if owned else cuda).append(i)
        elif owned:
            lazy.append(i)
        else:  # buffers, RNG, anything the forward pass or the user may change
            eager.append(i)
    lazy.sort(key=lambda i: -tensors[i].nbytes)
    key = (sig, tuple(tensors[i].data_ptr() for i in lazy + cuda_lazy))
    return CopyPlan(key, layout, eager, lazy, cuda, cuda_lazy)


def optimizer_storage_ptrs(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages that only the optimizers mutate: their parameters and their state tensors."""
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(storage_ptr(p))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(storage_ptr(v))
    return ptrs
