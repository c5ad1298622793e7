"""The SMP mesh transport on loopback: CURVE admits only the job's key; bad frames are dropped."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from xxhash import xxh64_intdigest as xxh64

from ftmem.errors import ProtocolError
from ftmem.exchange import keys
from ftmem.exchange.messages import Envelope
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.protocol import messages as m


@pytest.fixture
def pair() -> Iterator[tuple[ZmqPeerTransport, ZmqPeerTransport]]:
    k = keys.generate()
    a, b = ZmqPeerTransport("a", k), ZmqPeerTransport("b", k)
    try:
        eps = {"a": a.start(), "b": b.start()}
        a.connect(eps)
        b.connect(eps)
        yield a, b
    finally:
        a.close()
        b.close()


def recv_one(t: ZmqPeerTransport, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    msg = t.recv(timeout)
    assert msg is not None
    return msg


def test_round_trip_with_buffers(pair: tuple[ZmqPeerTransport, ZmqPeerTransport]) -> None:
    a, b = pair
    data = os.urandom(3 << 20)
    a.send("b", {"kind": "fragment", "step": 3}, [memoryview(data), b"xy"])
    msg = recv_one(b)
    assert msg.sender == "a" and msg.header == {"kind": "fragment", "step": 3}
    assert bytes(msg.buffers[0]) == data and bytes(msg.buffers[1]) == b"xy"
    b.send("a", {"ack": 3}, [])
    assert recv_one(a).header == {"ack": 3}


def test_wrong_key_is_refused(pair: tuple[ZmqPeerTransport, ZmqPeerTransport]) -> None:
    a, b = pair
    intruder = ZmqPeerTransport("evil", keys.generate())
    try:
        intruder.start()
        intruder.connect({"b": b.endpoint})
        intruder.send("b", {"x": 1}, [b"data"])
        # The handshake fails: nothing from the intruder ever arrives.
        assert b.recv(2.0) is None
    finally:
        intruder.close()
    a.send("b", {"still": "ok"}, [])
    assert recv_one(b).header == {"still": "ok"}


def test_plain_tcp_client_gets_nothing_through(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    _, b = pair
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(b.endpoint)
    s.send_multipart([b"garbage", b"more"])
    assert b.recv(2.0) is None
    s.close()
    ctx.term()


def test_malformed_but_authenticated_is_dropped(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    a, b = pair
    sock = a._peers["b"]  # an authenticated peer sending junk
    sock.send_multipart([b"junk"])
    sock.send_multipart([b"FTMQ" + b"\0" * 40, b"x"])
    assert b.recv(5.0) is None or b.dropped >= 1
    a.send("b", {"ok": 1}, [b"1"])
    got = None
    for _ in range(5):
        got = b.recv(5.0)
        if got is not None:
            break
    assert got is not None and got.header == {"ok": 1}
    assert b.dropped == 2


def test_a_header_json_cannot_read_back_is_dropped(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    """An int of 5000 digits (json.loads raises a bare ValueError) is dropped and counted by
    the transport; Infinity is JSON, passes the transport and is refused by the protocol."""
    a, b = pair
    sock = a._peers["b"]
    body = b'{"header": {"t": "held", "e": 0, "step": ' + b"9" * 5000 + b"}}"
    head = struct.pack("<4sHHQIQ", b"FTMQ", 1, int(m.Kind.PEER), 1, len(body), xxh64(body))
    sock.send_multipart([head + body])
    assert b.recv(10.0) is None  # dropped (recv returns None for it), not raised
    assert b.dropped == 1
    a.send("b", {"t": "held", "e": 0, "step": float("inf")}, [])
    got = recv_one(b)
    assert math.isinf(got.header["step"])
    with pytest.raises(ProtocolError):
        Envelope.parse(got)


def test_key_file_round_trip_and_permissions(tmp_path: Path) -> None:
    k = keys.generate()
    p = tmp_path / "job.key"
    keys.write_key_file(p, k)
    assert (p.stat().st_mode & 0o777) == 0o600
    assert keys.read_key_file(p) == k
    p.chmod(0o644)
    with pytest.raises(keys.KeyFileError, match="readable by others"):
        keys.read_key_file(p)
    bad = tmp_path / "bad.key"
    bad.write_text("{}")
    bad.chmod(0o600)
    with pytest.raises(keys.KeyFileError):
        keys.read_key_file(bad)
