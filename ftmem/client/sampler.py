"""ElasticSampler: a distributed sampler whose position survives a change of world size.

``DistributedSampler`` deals rank ``r`` of ``W`` the indices ``r, r+W, ...`` of the epoch's
order, so a per-rank count of them means nothing at another ``W``. This sampler counts the
samples of the *whole job*: after ``k`` batches of ``B`` on ``W`` ranks, ``consumed = k * B * W``
on every rank, and at any world size ``W'`` rank ``r`` goes on with indices ``consumed + r,
consumed + r + W', ...`` of the same order: no sample is skipped or seen twice when ftmem
reshards a step, and the state is the same on every rank.

The ranks must draw the same number of samples per step, and the count is taken when the
loader asks for indices: use ``num_workers=0``, or count what the loop consumed
(:meth:`ElasticSampler.advance`) rather than what workers prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class ElasticSampler(Sampler[int]):
    """Indices of a dataset of ``size`` samples for this rank, epoch by epoch (see the module
    docstring). ``shuffle``: a new order each epoch from ``seed`` and the epoch (the same on
    every rank); the last ``consumed % world`` samples of an epoch that do not fill a round of
    the world are dropped, like ``DistributedSampler(drop_last=True)``.

    ``rank`` and ``world_size`` default to the process group's, read when iteration starts, so
    an iterator made after a restore at another world size deals the new world.
    """

    def __init__(
        self,
        size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self._rank = rank
        self._world = world_size
        self.epoch = 0
        self.consumed = 0
        """Samples of the epoch the whole job has drawn (every rank's)."""

    def _place(self) -> tuple[int, int]:
        initialised = dist.is_available() and dist.is_initialized()
        rank = self._rank if self._rank is not None else dist.get_rank() if initialised else 0
        world = (
            self._world if self._world is not None else dist.get_world_size() if initialised else 1
        )
        return rank, world

    def order(self) -> list[int]:
        """The epoch's order of the dataset's indices (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return [int(i) for i in torch.randperm(self.size, generator=g)]

    def __iter__(self) -> Iterator[int]:
        rank, world = self._place()
        order = self.order()
        while self.consumed + world <= self.size:
            index = order[self.consumed + rank]
            self.consumed += world
            yield index

    def __len__(self) -> int:
        _, world = self._place()
        return max(0, (self.size - self.consumed) // world)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its own order) from its first sample."""
        self.epoch = epoch
        self.consumed = 0

    def advance(self, samples_per_rank: int) -> None:
        """Count ``samples_per_rank`` drawn by every rank without iterating (a loader whose
        workers prefetch: count what the loop consumed, and iterate a fresh sampler)."""
        self.consumed += samples_per_rank * self._place()[1]

    def state_dict(self) -> dict[str, Any]:
        """The job's position: epoch, samples consumed, and what defines the order."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "size": self.size,
            "seed": self.seed,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s position (at any world size).

        Raises:
            ValueError: the state is of another dataset size or seed.
        """
        if int(state_dict["size"]) != self.size or int(state_dict["seed"]) != self.seed:
            raise ValueError(
                f"the sampler's state is of a dataset of {state_dict['size']} samples with seed "
                f"{state_dict['seed']}, this sampler has {self.size} and {self.seed}"
            )
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])
