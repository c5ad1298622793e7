"""What the agents agree on through each rendezvous round's store: the nodes' rank slots,
where MASTER_ADDR/PORT point, and the generation.

:mod:`ftmem.launch.ranks` decides (pure); this module moves its inputs and outputs through
the round's store. Every key lives under the round's own prefix, so it is never stale.
Every value read back is checked (:class:`~ftmem.errors.ProtocolError` names the key): the
store is reachable by whoever reaches its port, and a malformed value must stop the agent
with a clear message, not a ``KeyError`` in the middle of a restart.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.utils.distributed import get_free_port

from ftmem.errors import ProtocolError
from ftmem.launch.ranks import assign_slots, next_generation, slot_ranks

# Keys in the rendezvous round's store (a fresh prefix every round, so never stale).
_GENERATION_KEY = "ftmem/generation"
_SLOT_KEY = "ftmem/slot"
_ASSIGNED_KEY = "ftmem/slots"
_MASTER_KEY = "ftmem/master"


def stable_ranks_apply(rank_assignment: str, spec: WorkerSpec) -> bool:
    """True if this job keeps its nodes' global ranks (``--ftmem-rank-assignment stable``
    with a dynamic rendezvous and no fixed master address)."""
    return (
        rank_assignment == "stable"
        and spec.rdzv_handler.get_backend() != "static"
        and not spec.master_addr
    )


@dataclass(frozen=True, slots=True)
class SlotOffer:
    """What an agent published of its previous round: the slot it held there (None: a new
    node or a spare), the generation it held it in, its ranks per node, and how many nodes
    that round had (None: it was in none)."""

    slot: int | None
    size: int
    generation: int
    nodes: int | None = None


def agree_slot(
    store: Any,
    group_rank: int,
    group_world_size: int,
    slot: int | None,
    local_world_size: int,
    generation: int = -1,
    nodes: int | None = None,
) -> int | None:
    """This node's slot in the new round (None: the nodes differ in size).

    Each agent publishes the slot (block of ``local_world_size`` global ranks) it held in
    the previous round (``slot``; None for a new node), the ``generation`` it held it in and
    that round's node count (``nodes``); group rank 0 assigns slots with
    :func:`~ftmem.launch.ranks.assign_slots` (the most recent holder of a slot keeps it) and
    publishes them. :func:`slot_offers` reads every agent's offer back.
    """
    mine = {"slot": slot, "size": local_world_size, "generation": generation, "nodes": nodes}
    store.set(f"{_SLOT_KEY}/{group_rank}", json.dumps(mine))
    if group_rank == 0:
        infos = slot_offers(store, group_world_size)
        same_size = len({o.size for o in infos}) == 1
        slots = (
            assign_slots([o.slot for o in infos], [o.generation for o in infos])
            if same_size
            else None
        )
        store.set(_ASSIGNED_KEY, json.dumps(slots))
    assigned = _value(_ASSIGNED_KEY, store.get(_ASSIGNED_KEY))
    if assigned is None:
        return None
    if not _int_list(assigned, group_world_size):
        raise ProtocolError(f"rendezvous store: {_ASSIGNED_KEY!r} is not {group_world_size} slots")
    return int(assigned[group_rank])


def _value(key: str, raw: bytes) -> Any:
    """A JSON value of the store, or ProtocolError naming ``key``."""
    try:
        return json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"rendezvous store: {key!r} is not JSON: {exc}") from exc


def _int_list(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(type(v) is int for v in value)


def slot_offers(store: Any, group_world_size: int) -> list[SlotOffer]:
    """Every agent's offer of this round (by group rank), checked (waits until all are in)."""
    keys = [f"{_SLOT_KEY}/{i}" for i in range(group_world_size)]
    return [_slot_info(k, raw) for k, raw in zip(keys, store.multi_get(keys), strict=True)]


def _slot_info(key: str, raw: bytes) -> SlotOffer:
    """An agent's ``{"slot": int | null, "size": int, "generation": int, "nodes": int |
    null}``."""
    doc = _value(key, raw)
    if (
        not isinstance(doc, dict)
        or set(doc) != {"slot", "size", "generation", "nodes"}
        or not (doc["slot"] is None or type(doc["slot"]) is int)
        or type(doc["size"]) is not int
        or type(doc["generation"]) is not int
        or not (doc["nodes"] is None or (type(doc["nodes"]) is int and doc["nodes"] > 0))
    ):
        raise ProtocolError(f"rendezvous store: {key!r} is not a slot offer: {doc!r:.200}")
    return SlotOffer(doc["slot"], doc["size"], doc["generation"], doc["nodes"])


def slot_workers(slot: int, local_world_size: int, group_world_size: int) -> list[Worker]:
    """elastic's workers of the node that holds ``slot``."""
    return [
        Worker(
            local_rank=p.local_rank,
            global_rank=p.global_rank,
            role_rank=p.global_rank,
            world_size=p.world_size,
            role_world_size=p.world_size,
        )
        for p in slot_ranks(slot, local_world_size, group_world_size)
    ]


def share_master(worker_group: WorkerGroup, slot: int | None) -> None:
    """Point MASTER_ADDR/PORT at the node that holds global rank 0 (``slot`` 0).

    The ranks' rank 0 serves their TCPStore, so it must run where MASTER_ADDR points;
    elastic points it at group rank 0, which may now hold another slot.
    """
    store = worker_group.store
    if slot is None or store is None:
        return
    if worker_group.spec.rdzv_handler.use_agent_store:
        return  # the ranks use group rank 0's agent store, wherever rank 0 runs
    if slot == 0:
        if worker_group.group_rank == 0:
            addr, port = worker_group.master_addr, worker_group.master_port
        else:
            spec = worker_group.spec
            addr, port = spec.local_addr or socket.getfqdn(), get_free_port()
        store.set(_MASTER_KEY, json.dumps([addr, port]))
    master = _value(_MASTER_KEY, store.get(_MASTER_KEY))
    if (
        not isinstance(master, list)
        or len(master) != 2
        or type(master[0]) is not str
        or type(master[1]) is not int
        or not 0 < master[1] < 65536
    ):
        raise ProtocolError(
            f"rendezvous store: {_MASTER_KEY!r} is not [host, port]: {master!r:.200}"
        )
    worker_group.master_addr, worker_group.master_port = master[0], master[1]


def exchange_generation(
    worker_group: WorkerGroup, rendezvous_round: Callable[[], int | None], previous: int
) -> int:
    """Agree on the generation: group rank 0 publishes the rendezvous round (read through
    ``rendezvous_round``), else one more than ``previous``."""
    store = worker_group.store
    if store is None:
        return previous + 1
    if worker_group.group_rank == 0:
        gen = next_generation(rendezvous_round(), previous)
        store.set(_GENERATION_KEY, str(gen))
        return gen
    raw = store.get(_GENERATION_KEY)
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"rendezvous store: {_GENERATION_KEY!r} is not a number") from exc
