"""Which global ranks each node runs, and which generation a rendezvous round is (pure).

Elastic numbers the nodes of each rendezvous round by the order in which they joined, so a
node's global ranks can change at every restart, and a rank would then find another rank's
snapshots in its node's SMP. ftmem-launch keeps them stable instead: each node owns a *slot*,
a block of ``local_world_size`` consecutive global ranks, for as long as it lives; a
replacement node takes the slot of the node it replaces. Nothing here touches a process, a
socket or the rendezvous store: :mod:`ftmem.launch.rendezvous` moves the inputs and outputs
through the store.
"""

from __future__ import annotations

from dataclasses import dataclass


def assign_slots(previous: list[int | None], generations: list[int] | None = None) -> list[int]:
    """Give each node (by group rank) a slot: its block of global ranks.

    ``previous[i]``: the slot group rank ``i`` held in the previous round (None: a new node or
    a spare); ``generations[i]``: the generation it held it in (default: all equal). A slot
    claimed by several goes to its most recent holder, then the lowest group rank: a node cut
    off while a spare took its slot must not take it back (it is *fenced*). A losing claim, or
    a slot beyond the node count, takes a free slot in order.
    """
    n = len(previous)
    gens = generations if generations is not None else [0] * n
    slots: list[int | None] = [None] * n
    order = sorted(range(n), key=lambda i: (-gens[i], i))
    taken: set[int] = set()
    for i in order:
        prev = previous[i]
        if prev is not None and 0 <= prev < n and prev not in taken:
            slots[i] = prev
            taken.add(prev)
    free = iter(s for s in range(n) if s not in taken)
    return [s if s is not None else next(free) for s in slots]


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One local rank of a node: where it sits in the job."""

    local_rank: int
    global_rank: int
    world_size: int


def slot_ranks(slot: int, local_world_size: int, nodes: int) -> list[RankPlace]:
    """The ranks of the node that holds ``slot`` in a job of ``nodes`` equal nodes.

    Raises:
        ValueError: a slot outside ``[0, nodes)`` or a non-positive size.
    """
    if local_world_size <= 0 or nodes <= 0 or not 0 <= slot < nodes:
        raise ValueError(f"slot {slot} of {nodes} nodes x {local_world_size} ranks")
    base = slot * local_world_size
    world = local_world_size * nodes
    return [RankPlace(i, base + i, world) for i in range(local_world_size)]


def next_generation(rendezvous_round: int | None, previous: int) -> int:
    """The generation of a new round: the rendezvous round when known (the same number on
    every node, also for a node that joins late), else one more than ``previous``; never
    ``previous`` or before (a round whose number came back after a store writer erased the
    rendezvous state)."""
    if rendezvous_round is not None and rendezvous_round >= 0:
        return max(rendezvous_round, previous + 1)
    return previous + 1
