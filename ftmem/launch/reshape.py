"""When a rendezvous round has fewer or more nodes than the last: the job shrinks or grows.

torchrun's ``--nnodes MIN:MAX`` lets the rendezvous form with fewer nodes than before: a
machine was lost and no spare or replacement joined within the rendezvous' ``last_call_timeout``
(``--rdzv-conf last_call_timeout=S``, 30 s by default). The survivors' ranks cannot restore
their own snapshots then (rank ``r`` of 3 is not rank ``r`` of 4), and the lost machine's
snapshots exist only as parity. So, before the ranks start, every agent:

1. reads every agent's offer of the round (:func:`~ftmem.launch.rendezvous.slot_offers`):
   the slots the survivors held and the node count of the last round; :func:`plan_reshape`
   (pure) says which old slots were lost and which survivor hosts each one;
2. (shrink, erasure coding on, at most ``m`` slots lost) starts a *guest SMP* for each lost
   slot it hosts, and all of them form the old round's peer mesh once more (its node
   indices, the guests in the lost slots' places, epoch ``2g``): the generation sync finds
   the guests without the group's protected step and they rebuild it from the survivors'
   data and parity, exactly as a replacement machine would;
3. drops from its own SMP the steps of its old ranks newer than the kept one
   (:func:`drop_newer`): committed at the old size but never protected, they cannot be
   resharded (the lost machine's part is gone), and the new mesh must not protect them as
   if they were the new job's; then forms the new round's mesh (its slots, epoch ``2g+1``):
   nothing is protected in it until the ranks' first steps at the new size are;
4. starts the ranks with ``$FTMEM_RESHARD`` (:class:`~ftmem.client.reshard.ReshardRequest`):
   the old world size, the step the old mesh kept, and the guests' run directories. Their
   ``ftmem.load`` reshards that step through DCP from the SMPs' memory
   (:mod:`ftmem.client.reshard`).

A guest is stopped once the new mesh protected a newer step (the resharded step is not
needed any more), or with the agent. More slots lost than ``m`` (or erasure coding off):
no guest; the ranks' load falls back to the newest flushed checkpoint of the old size
(``--ftmem-flush-dir``), resharded by ``dcp.load``, or stops with a clear error.

A round with more nodes (a machine came back, or was added) needs no rebuild: the new nodes
take free slots, and every rank loads the newest step of the old size resharded.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ftmem.config import GUEST_DIR_PREFIX
from ftmem.launch.rendezvous import SlotOffer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Reshape:
    """How the job's size changed in this round (see :func:`plan_reshape`)."""

    old_nodes: int
    new_nodes: int
    local_world_size: int
    old_slots: tuple[int | None, ...]
    """Each member's slot in the last round, by group rank (None: it was in none)."""
    lost: tuple[int, ...] = ()
    """Old slots no member held: the lost machines'."""
    guests: dict[int, int] = field(default_factory=dict)
    """Lost slot -> group rank of the survivor that hosts its guest SMP."""

    @property
    def survivors(self) -> list[int]:
        """The group ranks of the members that held a slot of the last round."""
        return [
            g for g, s in enumerate(self.old_slots) if s is not None and 0 <= s < self.old_nodes
        ]

    @property
    def old_world(self) -> int:
        """The world size the newest snapshots were saved at."""
        return self.old_nodes * self.local_world_size

    def old_ranks(self, slot: int) -> list[int]:
        """The global ranks old slot ``slot`` held."""
        base = slot * self.local_world_size
        return list(range(base, base + self.local_world_size))


def plan_reshape(offers: list[SlotOffer]) -> Reshape | None:
    """The change of the job's size that this round's offers show, or None (the same size,
    a first round, or nodes of different sizes).

    The last round's node count is the one the survivors report (they agree: it is one
    round's); a node new to the job reports none. Lost slots are hosted round-robin by the
    survivors, in group rank order.
    """
    counts = {o.nodes for o in offers if o.nodes is not None and o.slot is not None}
    sizes = {o.size for o in offers}
    if len(counts) != 1 or len(sizes) != 1:
        return None
    old_nodes, new_nodes = counts.pop(), len(offers)
    if old_nodes == new_nodes:
        return None
    old_slots = tuple(o.slot if o.nodes is not None else None for o in offers)
    held = {s for s in old_slots if s is not None and 0 <= s < old_nodes}
    lost = tuple(sorted(set(range(old_nodes)) - held))
    survivors = [g for g, s in enumerate(old_slots) if s is not None and s in held]
    guests = (
        {slot: survivors[i % len(survivors)] for i, slot in enumerate(lost)} if survivors else {}
    )
    return Reshape(old_nodes, new_nodes, sizes.pop(), old_slots, lost, guests)


def run_all(jobs: dict[str, Any]) -> dict[str, Any]:
    """Run each callable of ``jobs`` on a thread of its own (the meshes' joins wait for each
    other) and return each one's result; the first exception is raised after all ended."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, job: Any) -> None:
        try:
            results[name] = job()
        except BaseException as exc:  # handed to the caller below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(n, j), name=f"ftmem-mesh-{n}", daemon=True)
        for n, j in jobs.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def survivors_barrier(store: Any, rs: Reshape, group_rank: int, generation: int) -> None:
    """Wait until every survivor of ``rs`` is done with the old mesh (its guests rebuilt):
    none may leave it for the new one before, as the guests fetch from all of them.

    Raises:
        torch's store error: a survivor did not arrive within the store's timeout.
    """
    key = f"ftmem/reshaped/{generation}"
    store.set(f"{key}/{group_rank}", "1")
    store.wait([f"{key}/{g}" for g in rs.survivors])


def drop_newer(run_dir: Path, ranks: list[int], step: int) -> None:
    """Drop the snapshots of ``ranks`` newer than ``step`` from the SMP of ``run_dir``.

    Raises:
        SmpUnavailableError, SmpRequestError: the SMP did not do it.
    """
    from ftmem.protocol import messages as m
    from ftmem.protocol.smp_client import SmpClient

    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as smp:
        for rank in ranks:
            smp.request(m.DiscardNewer(rank=rank, step=step))


def guest_run_dir(run_dir: Path, slot: int) -> Path:
    """The run directory of the guest SMP of lost slot ``slot`` on this node."""
    return run_dir / f"{GUEST_DIR_PREFIX}{slot}"
