"""The wire format: round trips, and every kind of bad frame is refused with ProtocolError."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmem.errors import ProtocolError
from ftmem.protocol import messages as m
from ftmem.protocol.wire import _HEADER, decode, encode

KEY = b"k" * 32


def test_round_trip_with_key() -> None:
    msg = m.Begin(rank=3, step=12, nbytes=4096)
    rid, kind, out = decode(encode(msg, 7, KEY), KEY)
    assert (rid, kind, out) == (7, m.Kind.BEGIN, msg)


def test_reply_round_trip() -> None:
    r = m.Reply(ok=False, error="nope", data={"a": [1, 2]})
    assert decode(encode(r, 1, None), None)[2] == r


def test_wrong_key_is_refused() -> None:
    with pytest.raises(ProtocolError, match="authentication"):
        decode(encode(m.Ping(), 1, KEY), b"x" * 32)


def test_unauthenticated_is_refused() -> None:
    with pytest.raises(ProtocolError):
        decode(encode(m.Ping(), 1, None), KEY)


def test_truncated_is_refused() -> None:
    frame = encode(m.Hello(rank=0, pid=1), 1, KEY)
    for cut in (0, 3, _HEADER.size - 1, _HEADER.size + 2, len(frame) - 1):
        with pytest.raises(ProtocolError):
            decode(frame[:cut], KEY)


def test_wrong_version_is_refused() -> None:
    frame = bytearray(encode(m.Ping(), 1, None))
    struct.pack_into("<H", frame, 4, 99)
    with pytest.raises(ProtocolError, match="version"):
        decode(bytes(frame), None)


def test_oversized_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"FTMQ" + b"\0" * 5000, None, max_bytes=4096)


def test_checksum_mismatch_is_refused() -> None:
    frame = bytearray(encode(m.Heartbeat(rank=1, step=2), 1, None))
    frame[-2] ^= 0xFF
    with pytest.raises(ProtocolError):
        decode(bytes(frame), None)


def test_field_types_are_checked() -> None:
    body = b'{"rank":"0","pid":1}'
    import xxhash

    head = _HEADER.pack(b"FTMQ", 1, int(m.Kind.HELLO), 1, len(body), xxhash.xxh64_intdigest(body))
    with pytest.raises(ProtocolError, match="rank"):
        decode(head + body, None)


def test_unknown_and_missing_fields_are_refused() -> None:
    import xxhash

    for body in (b'{"rank":0,"pid":1,"evil":1}', b'{"rank":0}', b"[1,2]", b"\xff\xfe"):
        head = _HEADER.pack(
            b"FTMQ", 1, int(m.Kind.HELLO), 1, len(body), xxhash.xxh64_intdigest(body)
        )
        with pytest.raises(ProtocolError):
            decode(head + body, None)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        decode(data, KEY)
    except ProtocolError:
        pass
