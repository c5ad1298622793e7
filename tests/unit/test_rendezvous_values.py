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
    store.set("ftmem/slot/1", json.dumps({"slot": 0, "size": 2}))
    assert agree_slot(store, 0, 2, 1, 2) == 1


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (b"\xff not json", "'ftmem/slot/1' is not JSON"),
        (json.dumps({"slot": "0", "size": 2}), "'ftmem/slot/1' is not a slot offer"),
        (json.dumps({"size": 2}), "is not a slot offer"),
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
