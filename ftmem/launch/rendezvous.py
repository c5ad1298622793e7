"""What the agents agree on through each rendezvous round's store: the nodes' rank slots,
the generation, and where MASTER_ADDR/PORT point (:mod:`ftmem.launch.ranks` decides, pure).

The agreement is fresh even where a round's number comes back (a store writer erased the
state and a node's stale view was written back): each offer carries a nonce, the assignment
lists the nonces of the offers it read, a node takes only an assignment with its own offer's
nonce and then blanks its offer, and the master address lives under the agreement's nonce.

Every value read back is checked (:class:`~ftmem.errors.ProtocolError` names the key): whoever
reaches the store's port can write it, and a malformed value must stop the agent with a clear
message, not a ``KeyError`` mid-restart. The slot offers and the assignment, on which a node
is fenced, are also MACed with the job's key and bound to the round and the writer's group
rank (:class:`SlotClaims`); one that fails is read again for a while (a store writer may have
planted it before its agent wrote), then an offer claims nothing, and a node whose assignment
never passes leaves the round for the next one (:func:`join_until_held`): a late offer
costs a round, never the node.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup, WorkerSpec
from torch.distributed.elastic.utils.distributed import get_free_port

from ftmem.errors import FtmemError, ProtocolError, RoundAbandoned
from ftmem.exchange import keys
from ftmem.launch.job_key import job_keys
from ftmem.launch.peers import PeerSettings, read_until_valid, signed_entry, verified_entry
from ftmem.launch.ranks import assign_slots, next_generation, slot_ranks
from ftmem.typed_json import MAX_INT, Range, loads, read

log = logging.getLogger(__name__)
T = TypeVar("T")

# Keys in the rendezvous round's store (under the round's own prefix).
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
_HostPort = tuple[str, Annotated[int, Range(1, 65535)]]


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
    nonce: str
    mac: Any


@dataclass(frozen=True, slots=True)
class _AssignmentDoc:
    """The slots group rank 0 assigned, as :func:`agree_slots` writes them (every field
    required): the offers it honoured as ``[slot, size, generation, nodes]`` rows, the
    nonces of the offers it read (None: refused unread), and the round's generation."""

    kind: str
    round: int | None
    slots: list[int] | None
    offers: list[tuple[int | None, int, int, _Nodes | None]]
    nonces: list[str | None]
    generation: int
    mac: Any


class AssignmentRefused(ProtocolError):
    """No slot assignment of this round with this node's offer in it passed this node's
    checks in time (group rank 0 assigned without this node's offer, or a store writer
    planted one): this node leaves the round for the next."""


LEFT_ROUNDS = 3
"""How many rounds in a row a node leaves (:func:`join_until_held`) before it stops with the
error."""

VERIFY_WAIT_S = 10.0
"""How long a slot offer that fails its checks is read again (a store writer may have put it
there before its agent wrote the real one); the assignment is waited for three times as long."""


def _before(offer: SlotOffer, generation: int | None) -> SlotOffer:
    """``offer``, whose generation must be before ``generation`` (None: any)."""
    if generation is not None and offer.generation >= generation:
        raise ProtocolError(
            f"generation {offer.generation} is not before this round's ({generation})"
        )
    return offer


def _read_until_verified(
    store: Any, key: str, check: Callable[[bytes], T], deadline: float, raw: bytes | None = None
) -> T:
    """``check`` of the value of ``key`` (``raw``: already read), read again until it passes
    or ``deadline`` (:func:`~ftmem.launch.peers.read_until_valid`; a blank value is not
    written yet in this agreement); then ProtocolError naming ``key``."""

    def checked(value: bytes) -> T:
        if not value:
            raise ProtocolError("blank: not written yet in this agreement")
        return check(value)

    try:
        value = store.get(key) if raw is None else raw
        return read_until_valid(store, key, bytes(value), checked, deadline, True)
    except ProtocolError as exc:
        raise ProtocolError(f"rendezvous store: {key!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Read:
    """An offer as group rank 0 read it: honoured (None: refused) and its nonce (None: it
    did not verify, so its nonce proves nothing)."""

    offer: SlotOffer | None
    nonce: str | None


def _read_offers(
    store: Any, n: int, round_: int | None, job: Any, wait_s: float, bound: int | None
) -> list[_Read]:
    """Every other agent's offer of round ``round_`` (group ranks 1..n-1; waits until all
    are in), each checked: MACed with ``job``'s key (None: not authenticated), of this round
    and rank, a generation before ``bound``. One that still fails after ``wait_s`` (for all
    of them) is refused."""
    keys = [f"{_SLOT_KEY}/{i}" for i in range(1, n)]
    values = store.multi_get(keys)  # every agent published one
    deadline = time.monotonic() + wait_s
    out: list[_Read] = []
    for i, (key, raw) in enumerate(zip(keys, values, strict=True), start=1):
        fields = {"kind": "slot-offer", "round": round_, "rank": i}

        def check(raw: bytes, fields: dict[str, Any] = fields) -> _OfferDoc:
            return verified_entry(job, raw, _OfferDoc, fields)

        try:
            doc = _read_until_verified(store, key, check, deadline, raw)
        except ProtocolError as exc:
            log.warning("%s: treated as a node that claims no slot", exc)
            out.append(_Read(None, None))
            continue
        try:
            offer = _before(SlotOffer(doc.slot, doc.size, doc.generation, doc.nodes), bound)
        except ProtocolError as exc:
            log.warning("rendezvous store: %r: %s: treated as a node that claims no slot", key, exc)
            offer = None
        out.append(_Read(offer, doc.nonce))
    return out


@dataclass(frozen=True, slots=True)
class SlotAgreement:
    """What group rank 0 assigned in a round: each node's slot (None: the nodes differ in
    size), the offers it honoured, by group rank (a refused one claims no slot), the
    round's generation, and the agreement's nonce (which names its later keys)."""

    slots: list[int] | None
    offers: list[SlotOffer]
    generation: int
    nonce: str


def _assignment(
    raw: bytes, job: Any, round_: int | None, n: int, group_rank: int, mine: dict[str, Any]
) -> SlotAgreement:
    doc = verified_entry(job, raw, _AssignmentDoc, {"kind": "slots", "round": round_})
    if doc.slots is not None and sorted(doc.slots) != list(range(n)):
        raise ProtocolError(f"not a permutation of 0..{n - 1}: {doc.slots!r:.200}")
    if len(doc.offers) != n or len(doc.nonces) != n or doc.nonces[0] is None:
        raise ProtocolError(f"not {n} offers")
    if doc.nonces[group_rank] != mine["nonce"]:
        raise ProtocolError("made before this node's offer (an earlier agreement's)")
    if doc.generation <= mine["generation"] or (round_ is not None and doc.generation < round_):
        raise ProtocolError(f"generation {doc.generation} is not after this node's")
    bound = doc.generation if round_ is not None else None
    offers = [_before(SlotOffer(*row), bound) for row in doc.offers]
    return SlotAgreement(doc.slots, offers, doc.generation, doc.nonces[0])


def agree_slots(
    store: Any,
    group_rank: int,
    group_world_size: int,
    offer: SlotOffer,
    round_: int | None = None,
    job: Any = None,
    wait_s: float = VERIFY_WAIT_S,
) -> SlotAgreement:
    """Agree the slots and the generation of round ``round_``: publish this node's
    ``offer`` with a fresh nonce; group rank 0 reads every offer (:func:`_read_offers`),
    assigns slots with :func:`~ftmem.launch.ranks.assign_slots`, takes the generation from
    :func:`~ftmem.launch.ranks.next_generation` (after every honoured offer's) and publishes
    them with the offers it honoured and the nonces it read; the others read that back,
    checked (MACed with ``job``'s key unless None, of this round, a permutation of
    ``0..n-1``, with this node's nonce, a generation after this node's), then blank their
    offer, agreed or not, so that a round of the same number waits for a fresh one.

    Raises:
        AssignmentRefused: no assignment that passes its checks appeared in time.
    """
    n, nonce = group_world_size, secrets.token_hex(16)
    mine: dict[str, Any] = {"slot": offer.slot, "size": offer.size}
    mine |= {"generation": offer.generation, "nonce": nonce}
    fields = {"kind": "slot-offer", "round": round_, "rank": group_rank, **mine}
    key = f"{_SLOT_KEY}/{group_rank}"
    store.set(key, signed_entry(job, {**fields, "nodes": offer.nodes}))
    if group_rank != 0:
        try:
            return _read_until_verified(
                store,
                _ASSIGNED_KEY,
                lambda raw: _assignment(raw, job, round_, n, group_rank, mine),
                time.monotonic() + 3 * wait_s,
            )
        except ProtocolError as exc:
            raise AssignmentRefused(str(exc)) from exc
        finally:
            store.set(key, b"")
    generation = next_generation(round_, offer.generation)
    bound = generation if round_ is not None else None
    read = [_Read(offer, nonce), *_read_offers(store, n, round_, job, wait_s, bound)]
    # A refused offer claims nothing (as a new node's), of this node's size.
    offers = [r.offer if r.offer is not None else SlotOffer(None, offer.size, -1) for r in read]
    generation = max([generation] + [o.generation + 1 for o in offers])
    slots = None
    if len({o.size for o in offers}) == 1:
        slots = assign_slots([o.slot for o in offers], [o.generation for o in offers])
    rows = [[o.slot, o.size, o.generation, o.nodes] for o in offers]
    doc: dict[str, Any] = {"kind": "slots", "round": round_, "slots": slots, "offers": rows}
    doc |= {"nonces": [r.nonce for r in read], "generation": generation}
    store.set(_ASSIGNED_KEY, signed_entry(job, doc))
    return SlotAgreement(slots, offers, generation, nonce)


def join_until_held(join: Callable[[], None], node: str, rounds: int = LEFT_ROUNDS) -> int:
    """``join()`` (one rendezvous round and the start of this node's ranks) until a round
    holds: a round this node leaves, because it refused its slot assignment
    (:class:`AssignmentRefused`) or another node left it before the ranks started
    (:class:`~ftmem.errors.RoundAbandoned`), is followed by the next one, which this node
    joins as a late node does (the nodes still in the round see it waiting and restart into
    the next round too). Return how many rounds were left.

    Raises:
        AssignmentRefused, RoundAbandoned: ``rounds`` rounds in a row were left, and then
            one more.
    """
    left = 0
    while True:
        try:
            join()
            return left
        except (AssignmentRefused, RoundAbandoned) as exc:
            left += 1
            if left > rounds:
                raise
            log.warning(
                "[%s] %s: this node leaves the round and joins the next (%d of %d)",
                node,
                exc,
                left,
                rounds,
            )


class SlotClaims:
    """One agent's side of the slot agreement of every round (:func:`agree_slots`), MACed
    with the job's key from the key file or the host's private key file. Without either
    (``--ftmem-insecure-mesh``, or across hosts without a key file) the claims are not
    authenticated (logged once): the round, the generation bound and the permutation are
    still checked."""

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
                job = keys.CurveKeyPair.from_json(
                    job_keys(ps.key_file, ps.host_key, store, group_rank, warn=False)
                )
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


def share_master(worker_group: WorkerGroup, store: Any, slot: int | None, agreement: str) -> None:
    """Point MASTER_ADDR/PORT at the node that holds global rank 0 (``slot`` 0), through a
    key of the round's ``store`` named by the slot agreement's nonce (``agreement``).

    The ranks' rank 0 serves their TCPStore, so it must run where MASTER_ADDR points;
    elastic points it at group rank 0, which may now hold another slot.
    """
    if slot is None or store is None:
        return
    key = f"{_MASTER_KEY}/{agreement}"
    if worker_group.spec.rdzv_handler.use_agent_store:
        return  # the ranks use group rank 0's agent store, wherever rank 0 runs
    if slot == 0:
        if worker_group.group_rank == 0:
            addr, port = worker_group.master_addr, worker_group.master_port
        else:
            spec = worker_group.spec
            addr, port = spec.local_addr or socket.getfqdn(), get_free_port()  # type: ignore[no-untyped-call]
        store.set(key, json.dumps([addr, port]))
    master = loads(store.get(key), f"rendezvous store: {key!r}")
    try:
        worker_group.master_addr, worker_group.master_port = read(_HostPort, master, key)
    except ProtocolError:
        raise ProtocolError(
            f"rendezvous store: {key!r} is not [host, port]: {master!r:.200}"
        ) from None


def exchange_generation(
    worker_group: WorkerGroup,
    store: Any,
    rendezvous_round: Callable[[], int | None],
    previous: int,
) -> int:
    """Agree on the generation where no slot agreement carries it (stable ranks do not
    apply): group rank 0 publishes :func:`~ftmem.launch.ranks.next_generation` of the
    rendezvous round (read through ``rendezvous_round``) and ``previous`` in the round's
    ``store``."""
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
