"""When a rendezvous round has fewer or more nodes than the last: the job shrinks or grows.

With ``--nnodes MIN:MAX`` a round may form without a lost machine's replacement; its ranks
cannot restore their own snapshots (rank ``r`` of 3 is not rank ``r`` of 4) and its
snapshots exist only as parity (docs/launcher.md, "No spare"). Before the ranks start,
every agent:

1. plans the change from the round's offers (:func:`plan_reshape`, pure): the lost old
   slots, and which survivor hosts each one;
2. (a shrink with at most ``m`` slots lost) starts a *guest SMP* per lost slot it hosts, and
   all of them join the old round's mesh once more (epoch ``2g``), where the guests rebuild
   the protected step from the survivors' data and parity;
3. drops its old ranks' steps newer than the kept one (:func:`drop_newer`: never protected,
   they cannot be resharded), then forms the new round's mesh (epoch ``2g+1``);
4. starts the ranks with ``$FTMEM_RESHARD`` (:class:`~ftmem.protocol.rejoin.ReshardRequest`),
   whose ``ftmem.load`` reshards that step from the SMPs' memory (:mod:`ftmem.client.reshard`).

A guest stops once the new mesh protects a newer step, or with the agent. More slots lost
than ``m``: no guest; the ranks reshard the newest flushed checkpoint of the old size, or
stop. A growing round needs no rebuild: the new nodes take free slots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ftmem.config import GUEST_DIR_PREFIX
from ftmem.errors import FtmemError, RoundAbandoned
from ftmem.events import EventLog
from ftmem.exchange.keys import KeyFileError
from ftmem.launch.peers import MeshSync, PeerMesh, mesh_epoch
from ftmem.launch.rendezvous import SlotOffer
from ftmem.launch.smp_runner import SmpRunner
from ftmem.protocol.rejoin import ReshardRequest

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


def run_all(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each callable of ``jobs`` on a thread of its own (the meshes' joins wait for each
    other) and return each one's result; an exception of one is raised after all ended."""
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="ftmem-mesh") as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


def survivors_barrier(store: Any, rs: Reshape, group_rank: int, generation: int) -> None:
    """Wait until every survivor of ``rs`` is done with the old mesh (its guests rebuilt):
    none may leave it for the new one before, as the guests fetch from all of them.

    Raises:
        torch's store error: a survivor did not arrive within the store's timeout.
        RoundAbandoned: a node left the round (``store`` a
            :class:`~ftmem.launch.elastic_compat.RoundStore`).
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


class Reshaper:
    """This node's part in a round of another size (steps 2-4 of the module docstring): the
    guest SMPs it hosts, the old mesh joined once more, the survivors' barrier and the step
    the ranks reshard.

    Resource handling: the guests run until the new mesh protected a newer step
    (:meth:`protected`) or :meth:`stop`, which the agent calls at shutdown.
    """

    def __init__(self, smp: SmpRunner, mesh: PeerMesh, events: EventLog) -> None:
        self._smp = smp
        self._node = smp.node
        self._mesh = mesh
        self._events = events
        self.request: ReshardRequest | None = None
        """This generation's step to reshard (the job's size changed), else None."""
        self._step: int | None = None
        self.guests: list[SmpRunner] = []
        """Guest SMPs holding lost slots' rebuilt step until the new mesh protects a newer one."""

    def prepare(
        self,
        store: Any,
        offers: list[SlotOffer],
        *,
        group_rank: int,
        claimed: int | None,
        generation: int,
    ) -> bool:
        """Plan this round from its ``offers`` (:func:`plan_reshape`); when the job's size
        changed, rebuild the lost slots' step (this node held old slot ``claimed``) and set
        :attr:`request`. True: the round reshapes (its new mesh takes the second epoch).

        Raises:
            RoundAbandoned: a node left the round (``store`` a
                :class:`~ftmem.launch.elastic_compat.RoundStore`); the guest SMPs are stopped."""
        self.request = None
        rs = plan_reshape(offers)
        if rs is None:
            return False
        log.warning(
            "[%s] RESHAPE: the job %s from %d to %d nodes%s; the ranks reshard its step from "
            "memory",
            self._node,
            "grows" if rs.new_nodes > rs.old_nodes else "shrinks",
            rs.old_nodes,
            rs.new_nodes,
            f" (lost slots {list(rs.lost)})" if rs.lost else "",
        )
        self._events.write(
            "reshape",
            generation=generation,
            old_nodes=rs.old_nodes,
            new_nodes=rs.new_nodes,
            lost=list(rs.lost),
        )
        step: int | None = None
        dirs: list[Path] = []
        parity = self._mesh.parity(rs.old_nodes)
        if claimed is not None and 0 < len(rs.lost) <= parity:
            step, dirs = self._rebuild_lost(store, rs, group_rank, claimed, generation)
            try:  # every survivor, whatever its own join did
                survivors_barrier(store, rs, group_rank, generation)
            except RuntimeError as exc:  # torch's DistStoreError: a survivor never arrived
                log.error("[%s] the survivors did not all finish the rebuild: %s", self._node, exc)
        elif rs.lost:
            log.error(
                "[%s] %d slots lost, erasure coding covers %d: the ranks reshard from the "
                "newest flushed checkpoint of the %d-node job (--ftmem-flush-dir)",
                self._node,
                len(rs.lost),
                parity,
                rs.old_nodes,
            )
        self.request = ReshardRequest(rs.old_world, step, tuple(dirs))
        self._step = step
        return True

    def _rebuild_lost(
        self, store: Any, rs: Reshape, group_rank: int, claimed: int, generation: int
    ) -> tuple[int | None, list[Path]]:
        """Rebuild the lost slots' protected step in guest SMPs (those this node hosts) and
        drop this node's newer steps of the old job; return the step the old mesh kept and
        the guests' run directories (None and none if the rebuild failed, logged)."""
        t0 = time.monotonic()
        hosted = [s for s, g in rs.guests.items() if g == group_rank]
        dirs: list[Path] = []
        try:
            join = self._old_mesh_join
            jobs = {"self": join(store, rs, generation, claimed, self._smp, group_rank)}
            for slot in hosted:
                guest = self._start_guest(slot)
                dirs.append(guest.run_dir)
                jobs[f"guest{slot}"] = join(store.clone(), rs, generation, slot, guest, -1)
            results = run_all(jobs)
        except RoundAbandoned:
            self.stop()
            raise
        except (FtmemError, KeyFileError, OSError) as exc:
            log.error(
                "[%s] rebuilding the lost slots %s failed: %s; the ranks reshard from "
                "what memory holds, else from the newest flushed checkpoint",
                self._node,
                list(rs.lost),
                exc,
            )
            self._events.write("reshape_failed", generation=generation, reason=str(exc))
            self.stop()
            return None, []
        mine: MeshSync | None = results.get("self")
        step = mine.reply.step if mine is not None else None
        if step is not None:
            try:
                drop_newer(self._smp.run_dir, rs.old_ranks(claimed), step)
            except FtmemError as exc:  # the ranks' load drops them as well, later
                log.warning(
                    "[%s] could not drop the old job's steps newer than %d: %s",
                    self._node,
                    step,
                    exc,
                )
        seconds = time.monotonic() - t0
        self._events.write(
            "rebuilt_lost",
            generation=generation,
            step=step,
            slots=hosted,
            seconds=round(seconds, 3),
        )
        log.info(
            "[%s] the old mesh kept step %s; lost slots %s rebuilt here: %s (%.2f s)",
            self._node,
            step,
            list(rs.lost),
            hosted,
            seconds,
        )
        return step, dirs

    def _old_mesh_join(
        self, store: Any, rs: Reshape, generation: int, slot: int, smp: SmpRunner, group_rank: int
    ) -> Callable[[], MeshSync | None]:
        """Join the last round's mesh once more as old slot ``slot`` with SMP ``smp`` (a
        guest's: group rank -1), through ``store`` (a store client serves one blocking call
        at a time: each concurrent join has its own)."""
        return lambda: self._mesh.join(
            store=store,
            group_rank=group_rank,
            nodes=rs.old_nodes,
            me=slot,
            generation=generation,
            run_dir=smp.run_dir,
            ranks=rs.old_ranks(slot),
            node_name=smp.node,
            epoch=mesh_epoch(generation),
            tag="/rebuild",
        )

    def _start_guest(self, slot: int) -> SmpRunner:
        """Start (and keep) the guest SMP of lost slot ``slot`` on this node."""
        main = self._smp
        guest = SmpRunner(
            run_dir=main.run_dir / f"{GUEST_DIR_PREFIX}{slot}",
            run_id=main.run_id,
            node=f"{self._node}-guest{slot}",
            slots=main.slots,
            start_timeout=main.start_timeout,
            stop_timeout=main.stop_timeout,
            log_level=main.log_level,
            extra_env=main.extra_env,
        )
        self.guests.append(guest)
        guest.start()
        return guest

    def protected(self, step: int | None) -> None:
        """The new mesh protects ``step``: the guests go once it is newer than the resharded
        step (it is not needed any more)."""
        if self.guests and step is not None and step > (self._step or 0):
            log.info(
                "[%s] step %s is protected at the new size: stopping the guest SMPs",
                self._node,
                step,
            )
            self.stop()

    def stop(self) -> None:
        """Stop the guest SMPs."""
        guests, self.guests = self.guests, []
        for guest in guests:
            guest.stop()
