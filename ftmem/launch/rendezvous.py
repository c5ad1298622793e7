"""What the agents agree on through each rendezvous round's store: the nodes' rank slots,
where MASTER_ADDR/PORT point, and the generation.

:mod:`ftmem.launch.ranks` decides (pure); this module moves its inputs and outputs through
the round's store. Every key lives under the round's own prefix, so it is never stale.
Every value read back is checked (:class:`~ftmem.errors.ProtocolError` names the key): the
store is reachable by whoever reaches its port, and a malformed value must stop the agent
with a clear message, not a ``KeyError`` in the middle of a restart. The slot offers and the
assignment, on which a node is fenced, are more: MACed with the job's key, bound to the
round and the writer's group rank, an offer's generation before the round and the assignment
a permutation (:class:`SlotClaims`); one that fails is read again for a while (a store
writer may have planted it before its agent wrote), then an offer claims nothing and a
missing assignment stops the agent.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.utils.distributed import get_free_port

from ftmem.errors import FtmemError, ProtocolError
from ftmem.exchange import keys
from ftmem.launch.peers import PeerSettings, _entry_mac, job_keys
from ftmem.launch.ranks import assign_slots, next_generation, slot_ranks
from ftmem.typed_json import MAX_INT, Range, build

log = logging.getLogger(__name__)
T = TypeVar("T")

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


_Nodes = Annotated[int, Range(1, MAX_INT)]


@dataclass(frozen=True, slots=True)
class _OfferDoc:
    """A slot offer as :func:`agree_slots` writes it to the store (every field required)."""

    kind: str
    round: int | None
    rank: int
    slot: int | None
    size: int
    generation: int
    nodes: _Nodes | None
    mac: Any


@dataclass(frozen=True, slots=True)
class _AssignmentDoc:
    """The slots group rank 0 assigned, as :func:`agree_slots` writes them (every field
    required): the offers it honoured as ``[slot, size, generation, nodes]`` rows."""

    kind: str
    round: int | None
    slots: list[int] | None
    offers: list[tuple[int | None, int, int, _Nodes | None]]
    mac: Any


VERIFY_WAIT_S = 10.0
"""How long a slot offer that fails its checks is read again (a store writer may have put it
there before its agent wrote the real one); the assignment is waited for up to twice as long
and more."""


def _signed(job: Any, fields: dict[str, Any]) -> str:
    """``fields`` as JSON with their MAC under the job's key (no MAC without one)."""
    return json.dumps({**fields, "mac": _entry_mac(job, fields) if job is not None else None})


def _verified(job: Any, raw: bytes, cls: type[T], fields: dict[str, Any]) -> T:
    """The ``cls`` in ``raw`` (exactly its fields, ``mac`` the MAC of the others) if it
    agrees with ``fields`` and its MAC verifies (any MAC without a job key: it would prove
    nothing).

    Raises:
        ProtocolError: it does not.
    """
    doc = _value("", raw)
    try:
        got: T = build(cls, doc)
    except ProtocolError as exc:
        raise ProtocolError(f"malformed: {exc}") from None
    body = {k: v for k, v in doc.items() if k != "mac"}
    if any(body[k] != v for k, v in fields.items()):
        raise ProtocolError(f"of another round or node: {body!r:.200}")
    mac = doc["mac"]
    if job is not None and not (
        type(mac) is str and hmac.compare_digest(mac, _entry_mac(job, body))
    ):
        raise ProtocolError("not written with this job's key")
    return got


def _before(offer: SlotOffer, round_: int | None) -> SlotOffer:
    """``offer``, whose generation must be before round ``round_``."""
    if round_ is not None and round_ >= 0 and offer.generation >= round_:
        raise ProtocolError(f"generation {offer.generation} is not before this round ({round_})")
    return offer


def _read_until_verified(store: Any, key: str, check: Callable[[bytes], T], wait_s: float) -> T:
    """``check`` of the value of ``key``, read again until it passes or ``wait_s`` is over
    (a value that fails is logged once); the last ProtocolError after that."""
    deadline = time.monotonic() + wait_s
    failed: ProtocolError | None = None
    while True:
        try:
            return check(store.get(key))
        except ProtocolError as exc:
            if failed is None:
                log.warning(
                    "rendezvous store: %r was not written by this job's agent of this round "
                    "(%s): ignored; reading it again",
                    key,
                    exc,
                )
            failed = exc
        if time.monotonic() >= deadline:
            raise ProtocolError(f"rendezvous store: {key!r}: {failed}") from failed
        time.sleep(0.05)


def slot_offers(
    store: Any,
    group_world_size: int,
    round_: int | None = None,
    job: Any = None,
    wait_s: float = VERIFY_WAIT_S,
    known: dict[int, SlotOffer] | None = None,
) -> list[SlotOffer | None]:
    """Every agent's offer of round ``round_`` (by group rank; waits until all are in),
    each checked: written by that agent with the job's key (``job``, a
    :class:`~ftmem.exchange.keys.CurveKeyPair`; None: not authenticated), of this round and
    rank, a generation before the round. One that still fails after ``wait_s`` (for all of
    them) is None. ``known``: offers not read (this node's own)."""
    known = known or {}
    keys = [f"{_SLOT_KEY}/{i}" for i in range(group_world_size)]
    store.multi_get(keys)  # every agent published one
    deadline = time.monotonic() + wait_s
    out: list[SlotOffer | None] = []
    for i, key in enumerate(keys):
        fields = {"kind": "slot-offer", "round": round_, "rank": i}

        def check(raw: bytes, fields: dict[str, Any] = fields) -> SlotOffer:
            doc = _verified(job, raw, _OfferDoc, fields)
            return _before(SlotOffer(doc.slot, doc.size, doc.generation, doc.nodes), round_)

        if i in known:
            out.append(known[i])
            continue
        try:
            left = max(0.0, deadline - time.monotonic())
            out.append(_read_until_verified(store, key, check, left))
        except ProtocolError as exc:
            log.warning("%s: treated as a node that claims no slot", exc)
            out.append(None)
    return out


@dataclass(frozen=True, slots=True)
class SlotAgreement:
    """What group rank 0 assigned in a round: each node's slot (None: the nodes differ in
    size) and the offers it honoured, by group rank (a refused one claims no slot)."""

    slots: list[int] | None
    offers: list[SlotOffer]


def _assignment(raw: bytes, job: Any, round_: int | None, n: int) -> SlotAgreement:
    doc = _verified(job, raw, _AssignmentDoc, {"kind": "slots", "round": round_})
    if doc.slots is not None and sorted(doc.slots) != list(range(n)):
        raise ProtocolError(f"not a permutation of 0..{n - 1}: {doc.slots!r:.200}")
    if len(doc.offers) != n:
        raise ProtocolError(f"not {n} offers")
    return SlotAgreement(doc.slots, [_before(SlotOffer(*row), round_) for row in doc.offers])


def agree_slots(
    store: Any,
    group_rank: int,
    group_world_size: int,
    offer: SlotOffer,
    round_: int | None = None,
    job: Any = None,
    wait_s: float = VERIFY_WAIT_S,
) -> SlotAgreement:
    """Agree the slots of round ``round_``: publish this node's ``offer``; group rank 0
    reads every offer (:func:`slot_offers`), assigns slots with
    :func:`~ftmem.launch.ranks.assign_slots` (the most recent holder of a slot keeps it; a
    refused offer claims nothing) and publishes them with the offers it honoured; the
    others read that back, checked: with the job's key (``job``; None in
    ``--ftmem-insecure-mesh``, where the key itself travels through the store and a MAC
    would prove nothing), of this round, a permutation of ``0..n-1``.

    Raises:
        ProtocolError: no assignment that passes its checks appeared in time.
    """
    n = group_world_size
    mine = {"slot": offer.slot, "size": offer.size, "generation": offer.generation}
    fields = {"kind": "slot-offer", "round": round_, "rank": group_rank, **mine}
    store.set(f"{_SLOT_KEY}/{group_rank}", _signed(job, {**fields, "nodes": offer.nodes}))
    if group_rank != 0:
        return _read_until_verified(
            store, _ASSIGNED_KEY, lambda raw: _assignment(raw, job, round_, n), 3 * wait_s
        )
    read = slot_offers(store, n, round_, job, wait_s, known={0: offer})
    # A refused offer claims nothing (as a new node's), of this node's size.
    offers = [o if o is not None else SlotOffer(None, offer.size, -1) for o in read]
    slots = None
    if len({o.size for o in offers}) == 1:
        slots = assign_slots([o.slot for o in offers], [o.generation for o in offers])
    rows = [[o.slot, o.size, o.generation, o.nodes] for o in offers]
    doc = {"kind": "slots", "round": round_, "slots": slots, "offers": rows}
    store.set(_ASSIGNED_KEY, _signed(job, doc))
    return SlotAgreement(slots, offers)


def agree_slot(
    store: Any,
    group_rank: int,
    group_world_size: int,
    slot: int | None,
    local_world_size: int,
    generation: int = -1,
    nodes: int | None = None,
    round_: int | None = None,
    job: Any = None,
    wait_s: float = VERIFY_WAIT_S,
) -> int | None:
    """This node's slot in the new round (None: the nodes differ in size): :func:`agree_slots`
    with the slot this node held in the previous round (``slot``; None for a new node), the
    ``generation`` it held it in and that round's node count (``nodes``)."""
    offer = SlotOffer(slot, local_world_size, generation, nodes)
    agreed = agree_slots(store, group_rank, group_world_size, offer, round_, job, wait_s)
    return None if agreed.slots is None else agreed.slots[group_rank]


def _value(key: str, raw: bytes) -> Any:
    """A JSON value of the store, or ProtocolError naming ``key``."""
    try:
        return json.loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProtocolError(f"rendezvous store: {key!r} is not JSON: {exc}") from exc


class SlotClaims:
    """One agent's side of the slot agreement of every round (:func:`agree_slots`), with a
    key derived from the job's (the peers' store entries' MAC,
    :func:`~ftmem.launch.peers.read_peer_entry`): the key file's, or the host's private key
    of a mesh on this host. Without either (``--ftmem-insecure-mesh``, or a job across
    hosts without a key file) the claims are not authenticated (logged once): the round, the
    generation bound and the permutation are still checked."""

    def __init__(self, settings: PeerSettings, node: str) -> None:
        self._settings = settings
        self._node = node
        self._warned = False
        self.agreed: SlotAgreement | None = None
        """The last round's agreement (this node's view)."""

    def job(self, store: Any, group_rank: int) -> Any:
        """The job's key pair for this round's claims (None: none to be had)."""
        from ftmem.launch.config import is_loopback

        ps, job = self._settings, None
        if ps.key_file is not None or (ps.host_key is not None and is_loopback(ps.host)):
            try:
                job = keys.CurveKeyPair.from_json(job_keys(ps, store, group_rank, warn=False))
            except FtmemError as exc:
                log.warning("[%s] no job key for the slot claims: %s", self._node, exc)
        if job is None and not self._warned:
            self._warned = True
            log.warning(
                "[%s] slot claims in the rendezvous store are not authenticated (no key "
                "file; with --ftmem-insecure-mesh the job's key travels through the store, "
                "so a MAC would prove nothing): a store writer can claim a slot",
                self._node,
            )
        return job

    def agree(
        self, store: Any, group_rank: int, n: int, offer: SlotOffer, round_: int | None
    ) -> int | None:
        """This node's slot in round ``round_`` (None: the nodes differ in size)."""
        job = self.job(store, group_rank)
        self.agreed = agree_slots(store, group_rank, n, offer, round_, job)
        slots = self.agreed.slots
        return None if slots is None else slots[group_rank]

    def offers(self) -> list[SlotOffer]:
        """The offers honoured in the last agreement, by group rank (a refused one as a new
        node's): the same on every node."""
        return [] if self.agreed is None else self.agreed.offers

    def fenced_by(self, claimed: int, group_rank: int) -> bool:
        """Another node holds ``claimed`` (this node's slot of the last round) by a verified
        claim of it: this node is fenced. A slot given away because this node's own offer
        was refused is logged, not fenced."""
        agreed = self.agreed
        slots = None if agreed is None else agreed.slots
        if agreed is None or slots is None or claimed not in slots or slots[group_rank] == claimed:
            return False  # kept, or beyond a smaller job's slots
        if agreed.offers[slots.index(claimed)].slot == claimed:
            return True
        log.warning(
            "[%s] slot %d went to a node that did not claim it (this node's offer was refused): "
            "not fenced",
            self._node,
            claimed,
        )
        return False


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
