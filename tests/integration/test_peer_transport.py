"""The SMP mesh transport on loopback: CURVE admits exactly the generation's node keys, each as
its node; a member claiming another's name, the job's key alone and a key of an earlier
generation get nothing through; bad frames are dropped."""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from xxhash import xxh64_intdigest as xxh64

from ftmem.errors import ProtocolError
from ftmem.exchange import keys
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.protocol import messages as m
from ftmem.protocol.peer import Envelope, PeerAddress
from tests._support.tamper import TamperingProxy


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
    s.connect(PeerAddress.parse(b.endpoint).endpoint)
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


def _raw_peer(
    ctx: zmq.Context[zmq.Socket[bytes]], to: ZmqPeerTransport, pair: keys.CurveKeyPair, name: bytes
) -> zmq.Socket[bytes]:
    """A DEALER to ``to`` presenting ``pair`` and claiming the routing id ``name``."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.ROUTING_ID, name)
    addr = PeerAddress.parse(to.endpoint)
    d.curve_serverkey = addr.key
    d.curve_publickey, d.curve_secretkey = pair.public, pair.secret
    d.connect(addr.endpoint)
    return d


@pytest.fixture
def trio() -> Iterator[list[ZmqPeerTransport]]:
    k = keys.generate()
    ts = [ZmqPeerTransport(str(i), k) for i in range(3)]
    try:
        eps = {str(i): t.start() for i, t in enumerate(ts)}
        for t in ts:
            t.connect(eps)
        yield ts
    finally:
        for t in ts:
            t.close()


def test_a_member_claiming_another_nodes_name_is_dropped(trio: list[ZmqPeerTransport]) -> None:
    """Node 2, a member with its own key, sends as "0" (its routing id): node 1 drops it and
    counts it; node 2's messages under its own name still arrive, named by its key."""
    _, b, c = trio
    ctx = zmq.Context()
    try:
        d = _raw_peer(ctx, b, c.node_keys, b"0")
        d.send_multipart(c._frames({"t": "abort", "e": 0, "step": 1}, []))
        assert b.recv(3.0) is None
        assert b.impostors == 1 and b.dropped == 1
        d.close(linger=0)
    finally:
        ctx.term()
    c.send("1", {"mine": 1}, [])
    got = recv_one(b)
    assert got.sender == "2" and got.header == {"mine": 1}


@pytest.mark.parametrize("who", ["job key", "earlier generation", "stranger"])
def test_a_key_of_no_member_of_the_generation_is_refused(who: str) -> None:
    """The job's pair itself, a node's pair of the previous generation and an unknown pair
    all fail the handshake: nothing they send arrives; the members go on."""
    job = keys.generate()
    old = [ZmqPeerTransport(str(i), job) for i in range(2)]
    new: list[ZmqPeerTransport] = []
    ctx = zmq.Context()
    try:
        eps = {str(i): t.start() for i, t in enumerate(old)}
        for t in old:
            t.connect(eps)
        old_key = old[0].node_keys
        for t in old:
            t.close()
        new = [ZmqPeerTransport(str(i), job) for i in range(2)]
        eps = {str(i): t.start() for i, t in enumerate(new)}
        for t in new:
            t.connect(eps)
        pair = {"job key": job, "earlier generation": old_key, "stranger": keys.generate()}[who]
        d = _raw_peer(ctx, new[1], pair, b"0")
        d.send_multipart(new[0]._frames({"t": "abort", "e": 0, "step": 1}, []))
        assert new[1].recv(1.5) is None
        assert new[1].dropped == 0, "an unauthenticated message got as far as parsing"
        d.close(linger=0)
        new[0].send("1", {"ok": 1}, [])
        got = recv_one(new[1])
        assert got.sender == "0" and got.header == {"ok": 1}
    finally:
        ctx.term()
        for t in old + new:
            t.close()


def test_a_peer_that_connects_before_the_members_are_known_waits_then_gets_through() -> None:
    """ZeroMQ never retries a client that ZAP refused, so a node that starts its generation
    first must not be refused by a peer that has not learned the members yet."""
    job = keys.generate()
    a, b = ZmqPeerTransport("0", job), ZmqPeerTransport("1", job)
    try:
        eps = {"0": a.start(), "1": b.start()}
        a.connect(eps)
        a.send("1", {"early": 1}, [])
        assert b.recv(0.5) is None  # b does not know the members yet: the handshake waits
        b.connect(eps)
        got = recv_one(b)
        assert got.sender == "0" and got.header == {"early": 1}
    finally:
        a.close()
        b.close()


# -- the plain data channel (data_mac.py) ---------------------------------------------------


def test_messages_with_buffers_take_the_data_channel_named_by_their_tag(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    a, b = pair
    assert PeerAddress.parse(b.endpoint).data  # the address says where the data channel is
    data = os.urandom(1 << 20)
    a.send("b", {"step": 1}, [memoryview(data)])
    got = recv_one(b)
    assert got.sender == "a" and bytes(got.buffers[0]) == data
    a.send("b", {"held": 1}, [])  # no buffers: CURVE
    assert recv_one(b).header == {"held": 1}
    assert a.data_sent == 1 and b.forged == 0


def test_with_encrypt_data_every_message_goes_over_curve() -> None:
    k = keys.generate()
    a, b = ZmqPeerTransport("a", k, encrypt_data=True), ZmqPeerTransport("b", k)
    try:
        eps = {"a": a.start(), "b": b.start()}
        assert not PeerAddress.parse(eps["a"]).data
        a.connect(eps)
        b.connect(eps)
        a.send("b", {"step": 1}, [b"x" * 1000])
        b.send("a", {"step": 2}, [b"y" * 1000])  # a takes no plain data: b uses CURVE
        assert recv_one(b).sender == "a" and recv_one(a).sender == "b"
        assert a.data_sent == 0 and b.data_sent == 0
    finally:
        a.close()
        b.close()


def test_a_data_message_without_the_jobs_key_is_refused(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    """A node holding another key, naming itself "a" (a member), reaches b's plain port but its
    hello's tag is wrong: each try is dropped and counted (its sender tries again, as after any
    connection closed before the receiver's nonce); a's own messages still arrive."""
    a, b = pair
    intruder = ZmqPeerTransport("a", keys.generate())
    try:
        intruder.start()
        intruder.connect({"a": intruder.endpoint, "b": b.endpoint})
        intruder.send("b", {"step": 9}, [b"forged fragment"])
        assert intruder.data_sent == 1
        assert b.recv(2.0) is None and b.forged >= 1 and b.dropped >= 1
        assert b.take_refused() == []  # it came over no connection of a's: nothing to ask again
    finally:
        intruder.close()
    a.send("b", {"step": 10}, [b"real"])
    got = recv_one(b)
    assert got.header == {"step": 10} and bytes(got.buffers[0]) == b"real"


def test_a_fragment_altered_on_the_way_is_refused(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    a, b = pair
    addr = PeerAddress.parse(b.endpoint)
    proxy = TamperingProxy(addr.data, min_size=1 << 20)  # the 3 MiB buffer, once
    try:
        a.connect({"a": a.endpoint, "b": str(PeerAddress(addr.endpoint, addr.key, proxy.endpoint))})
        data = os.urandom(3 << 20)
        a.send("b", {"step": 1}, [memoryview(data)])
        assert b.recv(5.0) is None
        assert proxy.flips == 1 and b.forged == 1 and b.dropped == 1
        (notice,) = b.take_refused()  # what it claimed to be, for a rebuild to ask again
        assert notice.sender == "a" and notice.header == {"step": 1} and not notice.buffers
        a.send("b", {"step": 2}, [memoryview(data)])  # the proxy flips once: this one is intact
        got = recv_one(b)
        assert got.header == {"step": 2} and bytes(got.buffers[0]) == data
    finally:
        proxy.close()


def test_the_data_channel_takes_connections_only_from_peer_hosts(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport],
) -> None:
    """The generation's peers are on 127.0.0.1: a connection from 127.0.0.2 (another address of
    this machine) is closed at once and counted, before it is read."""
    a, b = pair
    host, port = PeerAddress.parse(b.endpoint).data.removeprefix("tcp://").rsplit(":", 1)
    before = b.dropped
    s = socket.socket()
    try:
        s.bind(("127.0.0.2", 0))
        s.connect((host, int(port)))
        s.settimeout(10)
        assert s.recv(1) == b""  # closed by b
    finally:
        s.close()
    assert b.dropped == before + 1
    a.send("b", {"step": 1}, [b"still ok"])
    assert bytes(recv_one(b).buffers[0]) == b"still ok"


def test_a_message_over_the_bound_is_dropped_before_its_buffers_and_the_next_arrives() -> None:
    """Even a key holder cannot make the receiver hold more than ``max_message_bytes`` for a
    message: its connection is closed after the head; the sender connects again for the next."""
    k = keys.generate()
    a, b = ZmqPeerTransport("a", k), ZmqPeerTransport("b", k, max_message_bytes=1 << 20)
    try:
        eps = {"a": a.start(), "b": b.start()}
        a.connect(eps)
        b.connect(eps)
        a.send("b", {"step": 1}, [os.urandom(2 << 20)])
        assert b.recv(2.0) is None
        a.send("b", {"step": 2}, [b"small"])
        got = recv_one(b)
        assert got.header == {"step": 2} and bytes(got.buffers[0]) == b"small"
        assert b.dropped >= 1 and b.forged == 0
    finally:
        a.close()
        b.close()


def test_a_data_channel_whose_io_thread_fails_makes_recv_raise(
    pair: tuple[ZmqPeerTransport, ZmqPeerTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the data channel's I/O thread must not leave the exchange waiting for data
    that never comes: recv raises, which stops the protection thread visibly (FAILED)."""
    from ftmem.exchange import data_channel

    a, b = pair

    def broken(self: object, c: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(data_channel.DataChannel, "_read", broken)
    a.send("b", {"step": 1}, [b"x" * 100])
    with pytest.raises(data_channel.DataChannelError, match="RuntimeError: a bug"):
        for _ in range(50):
            b.recv(0.2)
