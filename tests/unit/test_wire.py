"""The wire format: round trips, and every kind of bad frame is refused with ProtocolError."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmem.errors import ErrorKind, ProtocolError
from ftmem.protocol import messages as m
from ftmem.protocol.wire import _HEADER, decode, encode
from ftmem.typed_json import Most, build

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


@dataclass(frozen=True, slots=True)
class _Inner:
    n: int


@dataclass(frozen=True, slots=True)
class _Doc:
    """Every kind of annotation the one reader knows."""

    name: Annotated[str, Most(4)]
    nums: Annotated[tuple[int, ...], Most(3)] = ()
    inner: _Inner | None = None
    items: list[_Inner] = field(default_factory=list)
    counts: Annotated[Mapping[str, int], Most(2)] = field(default_factory=dict)
    kind: ErrorKind | None = None
    seconds: float = 0.0


def test_the_one_reader_builds_nested_fields_and_keeps_every_bound() -> None:
    doc = {
        "name": "abcd",
        "nums": [1, 2],
        "inner": {"n": 3},
        "items": [{"n": 4}],
        "counts": {"a": 1},
        "kind": "unknown-layout",
        "seconds": 1,
    }
    got = build(_Doc, doc)
    want = _Doc("abcd", (1, 2), _Inner(3), [_Inner(4)], {"a": 1}, ErrorKind.UNKNOWN_LAYOUT, 1.0)
    assert got == want
    assert isinstance(got.seconds, float)
    for bad in (
        {"name": "abcde"},  # longer than its bound
        {"name": "a", "nums": [1, 2, 3, 4]},
        {"name": "a", "counts": {"a": 1, "b": 2, "c": 3}},
        {"name": "a", "nums": [True]},
        {"name": "a", "nums": [1 << 63]},
        {"name": "a", "inner": {"n": 1, "extra": 2}},  # strict all the way down
        {"name": "a", "items": [{"n": "1"}]},
        {"name": "a", "kind": "REFUSED"},
        {"name": "a", "kind": ["refused"]},
        {"name": "a", "seconds": float("nan")},
        {"name": None},
        {},
    ):
        with pytest.raises(ProtocolError):
            build(_Doc, bad)


def test_a_report_ignores_unknown_fields_and_reads_null_as_the_default() -> None:
    doc = {"name": "a", "nums": None, "newer": 1, "inner": {"n": 1, "newer": [2]}}
    assert build(_Doc, doc, strict=False) == _Doc("a", (), _Inner(1))
    with pytest.raises(ProtocolError, match="unknown fields"):
        build(_Doc, doc)
    with pytest.raises(ProtocolError):  # a required field is still required
        build(_Doc, {"name": None}, strict=False)


@dataclass(frozen=True)
class _Rows:
    rows: list[tuple[int | None, str]]


def test_a_fixed_tuple_is_a_list_of_exactly_its_items_each_of_its_own_type() -> None:
    assert build(_Rows, {"rows": [[1, "a"], [None, "b"]]}) == _Rows([(1, "a"), (None, "b")])
    for bad in ([[1]], [[1, "a", 2]], [["a", 1]], [{"0": 1, "1": "a"}], [[True, "a"]]):
        with pytest.raises(ProtocolError):
            build(_Rows, {"rows": bad})


def test_a_refusal_carries_its_kind_across_the_wire() -> None:
    r = m.refusal("unknown layout 3 of rank 0", ErrorKind.UNKNOWN_LAYOUT)
    back = decode(encode(r, 1, KEY), KEY)[2]
    assert back == r and back.kind is ErrorKind.UNKNOWN_LAYOUT
    assert decode(encode(m.Reply(ok=True), 2, KEY), KEY)[2].kind is None


def test_smp_ready_document_round_trips_and_refuses_the_rest() -> None:
    ready = m.SmpReady(1234, "ipc:///tmp/x/smp.sock", "node0", "run1")
    assert m.SmpReady.from_json(ready.to_json()) == ready
    for bad in (
        "",
        "{",
        "[]",
        '{"pid": 1234}',
        '{"pid": 0, "endpoint": "e", "node": "n", "run_id": "r"}',
        '{"pid": true, "endpoint": "e", "node": "n", "run_id": "r"}',
        '{"pid": 1, "endpoint": "e", "node": "n", "run_id": "r", "extra": 1}',
        '{"pid": 1, "endpoint": "' + "e" * 5000 + '", "node": "n", "run_id": "r"}',
    ):
        with pytest.raises(ProtocolError):
            m.SmpReady.from_json(bad)
