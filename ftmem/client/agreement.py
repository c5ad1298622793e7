"""Agreement at load: which step every rank restores, decided over the user's process group.

Only tensors travel (all_gather / all_reduce), never pickled objects. Without an
initialised default process group the "group" is this process alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

MAX_CANDIDATES = 8


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed() -> bool:
    """True if the default process group is initialised and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_candidates(steps: list[int]) -> list[list[int]]:
    """Return every rank's candidate steps (index = rank), newest first, at most MAX_CANDIDATES."""
    steps = sorted(set(steps), reverse=True)[:MAX_CANDIDATES]
    if not distributed():
        return [steps]
    mine = torch.full((MAX_CANDIDATES,), -1, dtype=torch.int64)
    mine[: len(steps)] = torch.tensor(steps, dtype=torch.int64)
    mine = mine.to(_device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [[int(s) for s in t.cpu().tolist() if s >= 0] for t in out]


def newest_common(all_steps: list[list[int]]) -> int | None:
    """The newest step present in every rank's list, or None."""
    common = set(all_steps[0])
    for s in all_steps[1:]:
        common &= set(s)
    return max(common) if common else None


def min_over_ranks(value: int) -> int:
    """The minimum of ``value`` over all ranks."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def current_world_size() -> int:
    """The job's world size (the process group's, else $WORLD_SIZE, else 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def current_rank() -> int:
    """This process's global rank (the process group's, else $RANK, else 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))
