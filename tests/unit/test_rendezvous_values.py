"""Values the agents read from the rendezvous round's store (a real TCPStore): well-formed
ones agree the slots; a malformed one (whoever reaches the store's port can write it) stops
the agent with a ProtocolError naming the key, never a KeyError or TypeError."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ftmem.errors import ProtocolError
from ftmem.launch.rendezvous import agree_slot


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))


def test_two_nodes_keep_their_slots(store: TCPStore) -> None:
    store.set("ftmem/slot/1", json.dumps({"slot": 0, "size": 2, "generation": 4, "nodes": 2}))
    assert agree_slot(store, 0, 2, 1, 2, generation=4) == 1


def test_a_node_back_from_a_partition_loses_its_slot_to_the_spare_that_took_it(
    store: TCPStore,
) -> None:
    # group rank 1 held slot 0 until generation 7 (it took it over); this node (group rank
    # 0) held slot 0 until generation 2, then was cut off: it is fenced to the free slot.
    store.set("ftmem/slot/1", json.dumps({"slot": 0, "size": 1, "generation": 7, "nodes": 2}))
    assert agree_slot(store, 0, 2, 0, 1, generation=2) == 1


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (b"\xff not json", "'ftmem/slot/1' is not JSON"),
        (json.dumps({"slot": "0", "size": 2}), "'ftmem/slot/1' is not a slot offer"),
        (json.dumps({"size": 2}), "is not a slot offer"),
        (json.dumps({"slot": 0, "size": 2}), "is not a slot offer"),
        (json.dumps({"slot": 0, "size": 2, "generation": "1"}), "is not a slot offer"),
        (json.dumps({"slot": 0, "size": 2, "generation": 1}), "is not a slot offer"),
        (json.dumps({"slot": 0, "size": 2, "generation": 1, "nodes": 0}), "is not a slot offer"),
        (json.dumps([0, 2]), "is not a slot offer"),
    ],
)
def test_a_malformed_slot_offer_is_a_clear_error(store: TCPStore, other: object, why: str) -> None:
    store.set("ftmem/slot/1", other)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=why):
        agree_slot(store, 0, 2, 1, 2)


@pytest.mark.parametrize("assigned", ["[0]", '["0", 1]', '{"0": 1}', "nope"])
def test_a_malformed_assignment_is_a_clear_error(store: TCPStore, assigned: str) -> None:
    store.set("ftmem/slots", assigned)
    with pytest.raises(ProtocolError, match="'ftmem/slots'"):
        agree_slot(store, 1, 2, None, 2)
