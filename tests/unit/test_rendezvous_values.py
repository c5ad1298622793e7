"""Values the agents read from the rendezvous round's store (a real TCPStore): offers and the
assignment MACed with the job's key and bound to the round agree the slots and the
generation; what a store writer plants (no MAC, another round or rank, a generation beyond
the round, an assignment that is no permutation, an earlier agreement's) is refused: an offer
then claims nothing, a missing assignment is a ProtocolError naming the key, never a KeyError
or TypeError. A round whose number comes back agrees afresh, on a later generation. A node
that refuses a round's assignment joins the next round (a few times), it does not stop."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore

from ftmem.errors import ProtocolError
from ftmem.exchange import keys
from ftmem.launch.peers import _entry_mac
from ftmem.launch.rendezvous import AssignmentRefused, SlotOffer, agree_slots, join_until_held

JOB = keys.generate()
WAIT = 0.3  # how long a refused value is read again (VERIFY_WAIT_S in an agent)


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))


def offer(rank: int, slot: int | None, gen: int, round_: int = 9, job: Any = JOB, **kw: Any) -> str:
    fields = {"kind": "slot-offer", "round": round_, "rank": rank, "slot": slot, "size": 1}
    fields |= {"generation": gen, "nodes": 2 if slot is not None else None, "nonce": "n1", **kw}
    return json.dumps({**fields, "mac": _entry_mac(job, fields)})


def both(store: TCPStore, offers: list[SlotOffer], round_: int, wait_s: float = 10) -> list[Any]:
    """Group ranks 0 and 1 agree, each on its own thread with its own client (as two
    agents: a client's blocking read holds it)."""
    clients = [TCPStore("127.0.0.1", store.port, is_master=False) for _ in offers]
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(agree_slots, clients[rank], rank, 2, o, round_, JOB, wait_s)
            for rank, o in enumerate(offers)
        ]
        return [f.result(timeout=30) for f in futures]


def test_two_nodes_keep_their_slots(store: TCPStore) -> None:
    a, b = both(store, [SlotOffer(1, 1, 4, 2), SlotOffer(0, 1, 4, 2)], 9)
    assert a == b  # slots, offers, generation and nonce: the same on both nodes
    assert a.slots == [1, 0] and a.offers[1] == SlotOffer(0, 1, 4, 2) and a.generation == 9
    assert store.get("ftmem/slot/1") == b""  # taken: blanked
    store.set("ftmem/slot/1", offer(1, 0, 4))
    assert agree_slots(store, 0, 2, SlotOffer(1, 1, 4), 9, JOB, WAIT).slots == [1, 0]


def test_a_round_whose_number_comes_back_agrees_afresh_on_a_later_generation(
    store: TCPStore,
) -> None:
    # Round 9 agreed; a store writer erased the rendezvous state, and round 9 formed again.
    first = both(store, [SlotOffer(0, 1, 4, 2), SlotOffer(1, 1, 4, 2)], 9)[0]
    # Group rank 0 alone does not take group rank 1's first offer (blanked)...
    alone = agree_slots(store, 0, 2, SlotOffer(0, 1, 9, 2), 9, JOB, WAIT)
    assert alone.offers[1] == SlotOffer(None, 1, -1)
    # ... and group rank 1 alone takes no assignment made before its offer.
    with pytest.raises(ProtocolError, match="before this node's offer"):
        agree_slots(store, 1, 2, SlotOffer(1, 1, 9, 2), 9, JOB, WAIT)
    # Together: the same slots, a generation after the one both held (9), a new nonce.
    a, b = both(store, [SlotOffer(0, 1, 9, 2), SlotOffer(1, 1, 9, 2)], 9)
    assert a == b and a.slots == [0, 1] and a.generation == 10 and a.nonce != first.nonce


def test_a_node_late_for_a_round_joins_the_next_one_instead_of_stopping(store: TCPStore) -> None:
    both(store, [SlotOffer(0, 1, 4, 2), SlotOffer(1, 1, 4, 2)], 9)
    # Round 10: group rank 1's agent is late (a loaded node): group rank 0 assigns without it.
    alone = agree_slots(store, 0, 2, SlotOffer(0, 1, 9, 2), 10, JOB, WAIT)
    assert alone.offers[1] == SlotOffer(None, 1, -1) and alone.slots == [0, 1]
    late = TCPStore("127.0.0.1", store.port, is_master=False)
    rounds, agreed = iter([10, 11]), []

    def join() -> None:  # one rendezvous round of group rank 1's agent
        round_ = next(rounds)
        if round_ == 10:  # its offer comes after group rank 0 assigned
            agreed.append(agree_slots(late, 1, 2, SlotOffer(1, 1, 9, 2), round_, JOB, WAIT))
        with ThreadPoolExecutor(1) as pool:
            # Round 11: group rank 0 saw group rank 1 waiting and joined the next round too.
            first = SlotOffer(0, 1, alone.generation, 2)
            zero = pool.submit(agree_slots, store, 0, 2, first, round_, JOB, WAIT)
            agreed.append(agree_slots(late, 1, 2, SlotOffer(1, 1, 9, 2), round_, JOB, WAIT))
            agreed.append(zero.result(timeout=30))

    assert join_until_held(join, "n1") == 1  # round 10 refused, round 11 agreed
    mine, zeros = agreed
    assert mine == zeros and mine.slots == [0, 1] and mine.generation == 11


def test_a_node_that_refuses_every_round_stops_with_the_error(store: TCPStore) -> None:
    calls = []

    def join() -> None:  # an assignment planted by a store writer, never group rank 0's
        calls.append(len(calls))
        store.set("ftmem/slots", b"planted")
        agree_slots(store, 1, 2, SlotOffer(1, 1, 4, 2), 9, JOB, WAIT)

    with pytest.raises(AssignmentRefused, match="'ftmem/slots'"):
        join_until_held(join, "n1", rounds=1)
    assert calls == [0, 1]


def test_a_node_lost_before_its_offer_costs_the_others_a_round_not_the_store_timeout(
    store: TCPStore,
) -> None:
    """Three nodes formed round 9; node 2 was lost before it wrote its offer. Group rank 0
    (waiting for that offer) and group rank 1 (waiting for the assignment) read through a
    RoundStore: once the round is seen to be over they leave it (RoundAbandoned) and agree in
    the next round, without node 2, well before the store's timeout."""
    from ftmem.errors import RoundAbandoned
    from ftmem.launch.elastic_compat import RoundStore

    gone = threading.Event()  # the keep-alive of node 2 expired
    now = {0: 9, 1: 9}  # each node's round

    def abandoned(rank: int) -> Any:  # what elastic's state says of that node's round
        return lambda: "1 node(s) left the round" if gone.is_set() and now[rank] == 9 else None

    clients = [
        RoundStore(TCPStore("127.0.0.1", store.port, is_master=False), abandoned(r)) for r in (0, 1)
    ]
    rounds = {0: iter([(9, 3), (10, 2)]), 1: iter([(9, 3), (10, 2)])}
    left: dict[int, int] = {}

    def node(rank: int) -> Any:
        agreed = []

        def join() -> None:
            round_, n = next(rounds[rank])
            now[rank] = round_
            offer = SlotOffer(rank, 1, 4, 3)
            agreed.append(agree_slots(clients[rank], rank, n, offer, round_, JOB, WAIT))

        left[rank] = join_until_held(join, f"n{rank}")
        return agreed[0]

    threading.Timer(0.5, gone.set).start()
    with ThreadPoolExecutor(2) as pool:
        a, b = [f.result(timeout=8) for f in [pool.submit(node, r) for r in (0, 1)]]
    assert left == {0: 1, 1: 1}  # round 9 left by both, round 10 agreed
    assert a == b and a.slots == [0, 1] and a.generation == 10
    now[0] = 9
    with pytest.raises(RoundAbandoned):  # round 9 again: node 2's offer is still missing
        agree_slots(clients[0], 0, 3, SlotOffer(0, 1, 4, 3), 9, JOB, WAIT)


def test_a_node_back_from_a_partition_loses_its_slot_to_the_spare_that_took_it(
    store: TCPStore,
) -> None:
    # group rank 1 held slot 0 until generation 7 (it took it over); this node (group rank
    # 0) held slot 0 until generation 2, then was cut off: it is fenced to the free slot.
    store.set("ftmem/slot/1", offer(1, 0, 7))
    assert agree_slots(store, 0, 2, SlotOffer(0, 1, 2), 9, JOB, WAIT).slots == [1, 0]


@pytest.mark.parametrize(
    "planted",
    [
        offer(1, 0, 2**62),  # a generation beyond the round
        offer(1, 0, 8, job=keys.generate()),  # another key
        offer(1, 0, 8, round_=8),  # another round's (replayed)
        offer(0, 0, 8),  # another rank's
        json.dumps({"kind": "slot-offer", "round": 9, "rank": 1, "slot": 0, "size": 1,
                    "generation": 8, "nodes": 2, "mac": None}),  # no MAC
        b"\xff not json",
        json.dumps({"slot": "0", "size": 2}),
        json.dumps([0, 2]),
    ],
    # (ids, not the values: the MACs differ in each pytest-xdist worker's collection)
    ids=["generation", "key", "round", "rank", "no-mac", "not-json", "fields", "list"],
)  # fmt: skip
def test_a_rogue_offer_claims_nothing(store: TCPStore, planted: Any) -> None:
    # group rank 1's key holds what a store writer planted: slot 0 is not taken from this
    # node (group rank 0, slot 0 since generation 5)
    store.set("ftmem/slot/1", planted)
    got = agree_slots(store, 0, 2, SlotOffer(0, 1, 5, 2), 9, JOB, WAIT)
    assert got.slots == [0, 1] and got.offers[1] == SlotOffer(None, 1, -1)


def test_the_real_offer_written_after_a_planted_one_is_honoured(store: TCPStore) -> None:
    store.set("ftmem/slot/1", offer(1, 0, 2**62, job=keys.generate()))
    late = threading.Timer(0.1, lambda: store.set("ftmem/slot/1", offer(1, 1, 5)))
    late.start()
    try:
        got = agree_slots(store, 0, 2, SlotOffer(0, 1, 5, 2), 9, JOB, wait_s=10)
    finally:
        late.join()
    assert got.slots == [0, 1] and got.offers[1] == SlotOffer(1, 1, 5, 2)


NONCE = "ab" * 16  # group rank 1's nonce where a test fixes it


def assignment(
    slots: Any, round_: int = 9, job: Any = JOB, nonce: str = NONCE, gen: int = 9
) -> str:
    fields = {"kind": "slots", "round": round_, "slots": slots, "offers": [[0, 1, 5, 2]] * 2}
    fields |= {"nonces": ["cd" * 16, nonce], "generation": gen}
    return json.dumps({**fields, "mac": _entry_mac(job, fields) if job else None})


@pytest.mark.parametrize(
    "planted",
    [
        assignment([0, 0]),  # two nodes in slot 0, even with the job's MAC
        assignment([0, 1], job=keys.generate()),
        assignment([1, 0], round_=8),
        assignment([1, 0], nonce="ef" * 16),  # an earlier agreement's
        assignment([1, 0], gen=5),  # a generation not after this node's
        "[0, 0]",
        "nope",
    ],
    ids=["two-in-one-slot", "key", "round", "nonce", "generation", "list", "not-json"],
)
def test_a_planted_assignment_is_refused(
    store: TCPStore, planted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("ftmem.launch.rendezvous.secrets.token_hex", lambda n: NONCE)
    store.set("ftmem/slots", planted)
    with pytest.raises(ProtocolError, match="'ftmem/slots'"):
        agree_slots(store, 1, 2, SlotOffer(1, 1, 5, 2), 9, JOB, WAIT)
    store.set("ftmem/slots", assignment([1, 0]))  # the one group rank 0 would write
    assert agree_slots(store, 1, 2, SlotOffer(1, 1, 5, 2), 9, JOB, WAIT).slots == [1, 0]


def test_without_a_key_the_round_bound_and_the_permutation_still_hold(
    store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.set("ftmem/slot/1", offer(1, 0, 2**62, job=JOB))
    got = agree_slots(store, 0, 2, SlotOffer(0, 1, 5, 2), 9, None, WAIT)
    assert got.slots == [0, 1]
    store.set("ftmem/slots", assignment([0, 0], job=None))
    monkeypatch.setattr("ftmem.launch.rendezvous.secrets.token_hex", lambda n: NONCE)
    with pytest.raises(ProtocolError, match="not a permutation"):
        agree_slots(store, 1, 2, SlotOffer(1, 1, 5, 2), 9, None, WAIT)
