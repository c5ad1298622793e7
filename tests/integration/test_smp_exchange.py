"""Erasure-coded protection between real SMP processes over CURVE/TCP on loopback.

Each "node" is an SMP process; a test plays its ranks through the SMP protocol (begin, write
the slot file, commit), so a node's snapshot is known bytes. Nodes are lost for real (SIGKILL
of the SMP and removal of its shared memory) and replaced by a fresh SMP that must rebuild.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import xxhash
import zmq

from ftmem.errors import SmpRequestError
from ftmem.exchange import keys
from ftmem.protocol import messages as m
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import FragmentKind, PeerAddress
from ftmem.protocol.wire import encode
from tests._support.smp_mesh import Cluster, Node


def member_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], c: Cluster, as_node: int, to: int, name: bytes
) -> zmq.Socket[bytes]:
    """A DEALER to node ``to`` with node ``as_node``'s key of this generation (a member, as a
    node of the mesh that misbehaves would be), claiming the routing id ``name``."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 1000)
    d.setsockopt(zmq.ROUTING_ID, name)
    d.curve_serverkey = PeerAddress.parse(c.endpoints[str(to)]).key
    pair = c.node_keys[as_node]
    d.curve_publickey, d.curve_secretkey = pair.public, pair.secret
    d.connect(c.endpoint(to))
    return d


def peer_frames(header: dict[str, object]) -> list[bytes]:
    """A well-formed peer message without buffers."""
    return [encode(m.Peer(header=header), 1, None)]


def test_three_nodes_protect_lose_one_and_rebuild(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(3, 1, ranks_per_node=2)
    c.generation()
    c.save_all(1, 3 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    c.save_all(2, 3 << 20)
    c.wait("step 2 protected", lambda: c.protected(2))
    # `ftmem status` on the three nodes: parity per node within 10% of m/(n-m) = 1/2 of own.
    cmd = [sys.executable, "-m", "ftmem.cli", "status", "--json", "--run-dir"]
    out = subprocess.run(
        cmd + [str(n.run_dir) for n in c.nodes], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    docs = json.loads("[" + out.stdout.replace("}\n{", "},\n{") + "]")
    assert len(docs) == 3
    for doc in docs:
        ex = doc["protection"]
        assert ex["protected_step"] == 2 and ex["own_bytes"] == 2 * (3 << 20), ex
        assert abs(ex["parity_bytes"] / ex["own_bytes"] - 0.5) <= 0.05, ex
        assert all(p["last_seen_s"] is not None for p in ex["peers"].values()), ex
    table = subprocess.run(
        [*cmd[:-2], "--run-dir", str(c.nodes[0].run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "protected step 2" in table.stdout and "m/(n-m) = 0.500" in table.stdout, table.stdout
    c.save_all(3, 3 << 20)  # committed, perhaps not protected yet
    lost = c.nodes[2]
    lost.lose()
    lost.start()
    res = c.generation()
    assert res[2]["rebuilt"] is True and res[2]["step"] in (2, 3), res  # type: ignore[index]
    step = int(res[2]["step"])  # type: ignore[index, call-overload]
    for r in c.ranks(lost):
        want = xxhash.xxh3_128_digest(f"{r}-{step}".encode()) * ((3 << 20) // 16)
        assert lost.read(r, step) == want
    # Protection goes on with the replacement.
    c.save_all(4, 3 << 20)
    c.wait("step 4 protected", lambda: c.protected(4))


def test_each_node_told_only_its_groups_endpoints_protects_and_rebuilds(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """Two groups of three (6 nodes, groups of at most 3): each SMP is told the job's size
    and only its group's endpoints (what an agent reads from the store), protects, and a lost
    node of the second group is rebuilt; a start that lacks a group member's endpoint is
    refused with a clear error, not a sync that waits for a peer it cannot reach."""
    c = cluster_factory(6, 1, max_group=3)
    c.generation()
    assert [n.protection().group for n in c.nodes] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    lost = c.nodes[4]
    lost.lose()
    lost.start()
    res = c.generation()
    assert res[4]["rebuilt"] is True and res[4]["step"] == 1, res  # type: ignore[index]
    assert lost.read(4, 1) == xxhash.xxh3_128_digest(b"4-1") * ((1 << 20) // 16)
    node = c.nodes[0]
    node.req(m.PeerBind(keys=c.key.to_json(), host="127.0.0.1", me=0))
    short = {str(i): c.endpoints[str(i)] for i in (0, 1)}
    start = m.PeerStart(epoch=99, me=0, endpoints=short, m=1, max_group=3, ranks=[0], nodes=6)
    with pytest.raises(SmpRequestError, match=r"no endpoint for the group's nodes \[2\]"):
        node.req(start, timeout=timedelta(seconds=30))


def test_more_than_m_lost_is_a_clear_error(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(3, 1)
    c.generation()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    for node in c.nodes[1:]:
        node.lose()
        node.start()
    res = c.generation(expect_fail=True)
    assert all(isinstance(r, str) and r.startswith("unrecoverable: ") for r in res), res
    assert all("more than m=1" in str(r) for r in res), res


def payload(rank: int, step: int, size: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{rank}-{step}".encode()) * (size // 16)


def flip_slot_byte(node: Node, rank: int, step: int, offset: int) -> None:
    """Corrupt one byte of a committed slot in shared memory (a bad DIMM, a stray write)."""
    assert node.client is not None
    path = next(s.path for s in node.client.query(rank) if s.step == step)
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x55]), offset)
    finally:
        os.close(fd)


def test_corrupt_survivor_data_is_detected_and_rebuilt_from_spare_parity(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(4, 2)
    c.generation()
    c.save_all(1, 2 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    # Stripe 0 is (node 0's chunk 0, node 1's chunk 0 | parity on nodes 2 and 3): node 1's
    # rebuild reads node 0's chunk, finds it fails its checksum, and uses the other parity.
    flip_slot_byte(c.nodes[0], 0, 1, 100)
    c.nodes[1].lose()
    c.nodes[1].start()
    res = c.generation()
    assert res[1]["rebuilt"] is True and res[1]["step"] == 1  # type: ignore[index]
    assert c.nodes[1].read(1, 1) == payload(1, 1, 2 << 20)
    assert "failed their checksum" in c.nodes[1].log().read_text()


def test_corrupt_data_without_spare_is_never_restored(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(3, 1)
    c.generation()
    c.save_all(1, 2 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    flip_slot_byte(c.nodes[0], 0, 1, 100)
    c.nodes[1].lose()
    c.nodes[1].start()
    res = c.generation(expect_fail=True)
    assert isinstance(res[1], str) and "rebuild of step 1 failed" in res[1], res
    assert "checksum" in res[1] or "valid fragments" in res[1], res
    assert c.nodes[1].read(1, 1) is None, "a rebuild that failed its checksums was installed"


def test_corrupt_parity_is_detected_and_rebuilt_from_the_rest(
    cluster_factory: Callable[..., Cluster],
) -> None:
    flip = {2: {"FTMEM_FAULT": "parity_held:rank=2:step=1:fault=flip"}}
    c = cluster_factory(4, 2, env=flip)
    c.generation()
    c.save_all(1, 2 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    c.nodes[1].lose()
    c.nodes[1].start()
    res = c.generation()
    assert res[1]["rebuilt"] is True  # type: ignore[index]
    assert c.nodes[1].read(1, 1) == payload(1, 1, 2 << 20)
    assert "FAULT: flipped a byte of parity" in c.nodes[2].log().read_text()
    assert "failed their checksum" in c.nodes[1].log().read_text()


def test_garbage_and_wrong_key_on_the_peer_port_are_refused_mesh_keeps_working(
    cluster_factory: Callable[..., Cluster],
) -> None:
    import socket

    c = cluster_factory(3, 1)
    c.generation()
    host, port = c.endpoint(0).removeprefix("tcp://").rsplit(":", 1)
    for blob in (
        os.urandom(4096),
        b"\xff" * 10 + b"\x7f" + os.urandom(100),
        b"GET / HTTP/1.0\r\n\r\n",
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(blob)
    # A peer with its own key pair (no member's): the CURVE handshake refuses it.
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        other = keys.generate()
        d.curve_serverkey = PeerAddress.parse(c.endpoints["0"]).key
        d.curve_publickey, d.curve_secretkey = other.public, other.secret
        d.setsockopt(zmq.ROUTING_ID, b"1")
        d.connect(c.endpoint(0))
        d.send_multipart([b"FTMQ" + os.urandom(64), os.urandom(1024)], flags=zmq.NOBLOCK)
        time.sleep(0.5)  # give the handshake its chance to (wrongly) succeed
        d.close(linger=0)
    finally:
        ctx.term()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected despite the garbage", lambda: c.protected(1))
    for node in c.nodes:
        assert node.proc is not None and node.proc.poll() is None


def test_the_peer_port_has_a_tagged_data_channel_unless_bound_to_encrypt_everything(
    cluster_factory: Callable[..., Cluster],
) -> None:
    c = cluster_factory(3, 1)
    node = c.nodes[0]
    plain = node.req(m.PeerBind(keys=c.key.to_json(), host="127.0.0.1", me=0))
    assert PeerAddress.parse(plain["endpoint"]).data.startswith("tcp://127.0.0.1:")
    curve = node.req(m.PeerBind(keys=c.key.to_json(), host="127.0.0.1", me=0, encrypt=True))
    assert PeerAddress.parse(curve["endpoint"]).data == ""


@pytest.mark.parametrize(
    "bad",
    ["tcp://127.0.0.1:99999", "ipc:///tmp/x", "x" * 5000],
)
def test_a_malformed_peer_endpoint_is_refused_at_once_and_the_exchange_keeps_serving(
    cluster_factory: Callable[..., Cluster], bad: str
) -> None:
    """An endpoint from the rendezvous store that zmq cannot connect to used to kill the
    protection thread inside PEER_START: no reply (the agent waited its rebuild timeout), and
    every later PEER_BIND timed out."""
    c = cluster_factory(3, 1)
    node = c.nodes[0]
    node.req(m.PeerBind(keys=c.key.to_json(), host="127.0.0.1", me=0))
    endpoints = {"0": "tcp://127.0.0.1:1", "1": bad, "2": "tcp://127.0.0.1:2"}
    started = time.monotonic()
    with pytest.raises(SmpRequestError, match="bad peer endpoints"):
        node.req(
            m.PeerStart(epoch=1, me=0, endpoints=endpoints, m=1, max_group=8, ranks=[0]),
            timeout=timedelta(seconds=30),
        )
    assert time.monotonic() - started < 30
    c.generation()  # the thread still serves: a correct generation binds, syncs and protects
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected after the bad endpoint", lambda: c.protected(1))


def test_a_multipart_message_over_the_size_bound_is_dropped_and_the_mesh_keeps_working(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """ZeroMQ's MAXMSGSIZE bounds frames, not messages: two frames of 40 MiB from a holder of
    a member's key (80 MiB, past a 64 MiB bound) and 2000 tiny frames are refused whole."""
    c = cluster_factory(3, 1)
    c.generation()
    ctx = zmq.Context()
    d = member_socket(ctx, c, as_node=1, to=0, name=b"7")  # no handover of a real name
    try:
        d.send_multipart([b"x" * (40 << 20)] * 2)
        d.send_multipart([b"y"] * 2000)
        c.wait(
            "both messages refused",
            lambda: c.nodes[0].log().read_text().count("dropped a peer message") >= 2,
        )
    finally:
        d.close(linger=0)
        ctx.term()
    log = c.nodes[0].log().read_text()
    assert "larger than" in log and "frames (at most" in log
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected after the oversize messages", lambda: c.protected(1))


def test_a_member_claiming_another_nodes_name_is_dropped_and_a_stale_key_is_refused(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """Node 2's key claiming to be node 1 (an ABORT of the step being protected, as node 1),
    and node 1's key of the previous generation: node 0 never acts on either; the step is
    protected."""
    c = cluster_factory(3, 1)
    c.generation()
    old = c.node_keys[1]
    c.generation()  # new keys for everyone; the old one is no member's any more
    ctx = zmq.Context()
    try:
        forged = member_socket(ctx, c, as_node=2, to=0, name=b"1")
        forged.send_multipart(peer_frames(pm.Abort(1).to_header(c.epoch)))
        c.wait(
            "the forged name dropped",
            lambda: (
                "claiming to be from node b'1' came over the connection of node '2'"
                in c.nodes[0].log().read_text()
            ),
            timeout=20,
        )
        forged.close(linger=0)
        stale = ctx.socket(zmq.DEALER)
        stale.setsockopt(zmq.LINGER, 0)
        stale.setsockopt(zmq.ROUTING_ID, b"1")
        stale.curve_serverkey = PeerAddress.parse(c.endpoints["0"]).key
        stale.curve_publickey, stale.curve_secretkey = old.public, old.secret
        stale.connect(c.endpoint(0))
        stale.send_multipart(peer_frames(pm.Abort(1).to_header(c.epoch)), flags=zmq.NOBLOCK)
        c.wait(
            "the stale key refused",
            lambda: "a CURVE key of no member of this generation" in c.nodes[0].log().read_text(),
            timeout=20,
        )
        stale.close(linger=0)
    finally:
        ctx.term()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    assert "gave up" not in c.nodes[0].log().read_text()


def test_fetch_and_meta_outside_a_rebuild_are_refused(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """A member (node 1's key, under its own name) asks node 0 for node 2's data and sizes of
    the protected step while nobody rebuilds: node 0 refuses both (counted, logged once) and
    sends no bytes; node 1's SMP never receives a reply it did not ask for."""
    c = cluster_factory(3, 1)
    c.generation()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    ctx = zmq.Context()
    try:
        d = member_socket(ctx, c, as_node=1, to=0, name=b"1")
        fetch = pm.FetchRequest(1, 0, 0, FragmentKind.DATA, 0, 4096)
        d.send_multipart(peer_frames(fetch.to_header(c.epoch)))
        d.send_multipart(peer_frames(pm.MetaRequest(1).to_header(c.epoch)))
        c.wait(
            "the fetch refused",
            lambda: (
                "refused a 'fetch' of step 1 from node 1: it is not rebuilding"
                in c.nodes[0].log().read_text()
            ),
            timeout=20,
        )
        d.close(linger=0)
    finally:
        ctx.term()
    c.save_all(2, 1 << 20)  # a round later, anything node 0 had sent node 1 would be in
    c.wait("step 2 protected", lambda: c.protected(2))
    assert "nobody asked for" not in c.nodes[1].log().read_text()
    assert c.nodes[0].log().read_text().count("refused a ") == 1, "logged more than once"
