"""Every reader of JSON that another process or a file supplies turns nesting too deep for
Python's parser (RecursionError, not a ValueError) into that reader's one "malformed" error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ftmem.errors import ProtocolError
from ftmem.exchange.keys import CurveKeyPair, KeyFileError
from ftmem.format.record import decode_record
from ftmem.launch.peers import verified_entry
from ftmem.launch.rendezvous import SlotOffer
from ftmem.protocol import flush_jobs
from ftmem.protocol.rejoin import RejoinOrder

BOMB = "[" * 200_000 + "]" * 200_000

READERS: list[tuple[str, Callable[[str], Any], type[Exception]]] = [
    ("rejoin order", lambda t: RejoinOrder.from_json(t.encode()), ProtocolError),
    ("flush job", flush_jobs.parse_job, ProtocolError),
    ("flush reply", flush_jobs.parse_reply, ProtocolError),
    ("rendezvous entry", lambda t: verified_entry(None, t.encode(), SlotOffer, {}), ProtocolError),
    ("key pair", CurveKeyPair.from_json, KeyFileError),
    ("commit record", decode_record, ValueError),
]


@pytest.mark.parametrize(("what", "read", "error"), READERS, ids=[r[0] for r in READERS])
def test_nesting_too_deep_is_the_readers_malformed_error(
    what: str, read: Callable[[str], Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        read(BOMB)
