"""Erasure-coded protection between real SMP processes over CURVE/TCP on loopback.

Each "node" is an SMP process; a test plays its ranks through the SMP protocol (begin, write
the slot file, commit), so a node's snapshot is known bytes. Nodes are lost for real (SIGKILL
of the SMP and removal of its shared memory) and replaced by a fresh SMP that must rebuild.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import xxhash

from ftmem.errors import SmpRequestError
from ftmem.exchange import keys
from ftmem.format.layout import TensorExtent, layout_json, tensors_json
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess, start_smp
from tests.conftest import pid_gone, shm_files

T = timedelta(seconds=60)


def layout_for(payload: bytes, step: int) -> str:
    """A committed layout (no checksums: the SMP computes them) of one uint8 tensor."""
    n = len(payload)
    return layout_json(tensors_json([TensorExtent(0, "t", "uint8", (n,), 0, n)]), step, (n, 0))


@dataclass
class Node:
    index: int
    run_dir: Path
    run_id: str
    proc: SmpProcess | None = None
    client: SmpClient | None = None
    committed: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"n{self.index}"

    def start(self, slots: int = 3, env: dict[str, str] | None = None) -> None:
        self.proc = start_smp(
            env={**os.environ, **(env or {})},
            run_dir=self.run_dir,
            run_id=self.run_id,
            node=self.name,
            slots=slots,
            start_timeout=T,
            log_path=self.log(),
            extra_args=["--no-adopt"],
        )
        self.client = SmpClient(self.run_dir, timeout=T)

    def log(self) -> Path:
        return self.run_dir.parent / f"{self.name}-smp.log"

    def req(self, payload: object, timeout: timedelta = T) -> dict[str, object]:
        assert self.client is not None
        return self.client.request(payload, timeout)

    def commit(self, rank: int, step: int, payload: bytes) -> bool:
        """Play rank ``rank`` saving ``payload`` as ``step``; False if the SMP said skip."""
        r = self.req(m.Begin(rank=rank, step=step, nbytes=len(payload)))
        if r["action"] == "resize":
            self.req(m.Prepare(rank=rank, slot=int(r["slot"]), nbytes=len(payload)))  # type: ignore[call-overload]
            r = self.req(m.Begin(rank=rank, step=step, nbytes=len(payload)))
        if r["action"] == "skip":
            return False
        assert r["action"] == "write", r
        fd = os.open(str(r["path"]), os.O_WRONLY)
        try:
            os.pwrite(fd, payload, 0)
        finally:
            os.close(fd)
        self.req(
            m.Commit(
                rank=rank,
                slot=int(r["slot"]),
                gen=int(r["gen"]),
                step=step,
                layout=layout_for(payload, step),
            )  # type: ignore[call-overload]
        )
        self.committed[(rank, step)] = payload
        return True

    def read(self, rank: int, step: int) -> bytes | None:
        snaps = self.req(m.Query(rank=rank))["snapshots"]
        for s in snaps:  # type: ignore[attr-defined]
            if s["step"] == step:
                n = json.loads(s["layout"])["tensors"][0]["nbytes"]
                with open(s["path"], "rb") as f:
                    return f.read(n)
        return None

    def exchange(self) -> dict[str, object]:
        return self.req(m.Status())["exchange"]  # type: ignore[return-value]

    def lose(self) -> None:
        """The node dies: SMP SIGKILLed, its shared memory gone with the machine."""
        assert self.proc is not None
        if self.client is not None:
            self.client.close()
            self.client = None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.stop(timeout=timedelta(seconds=10))
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"ftmem-{self.run_id}-{self.name}-"):
                os.unlink(f"/dev/shm/{name}")
        for name in ("smp.sock", "smp.ready", "auth.key"):
            (self.run_dir / name).unlink(missing_ok=True)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.stop()
            assert pid_gone(self.proc.pid)
            self.proc = None


class Cluster:
    def __init__(
        self,
        base: Path,
        run_id: str,
        n: int,
        m: int,
        ranks_per_node: int = 1,
        env: dict[int, dict[str, str]] | None = None,
    ) -> None:
        self.key = keys.generate()
        self.m = m
        self.rpn = ranks_per_node
        self.nodes = [Node(i, base / f"n{i}", run_id) for i in range(n)]
        self.epoch = 0
        self.endpoints: dict[str, str] = {}
        for node in self.nodes:
            node.start(env=(env or {}).get(node.index))

    def ranks(self, node: Node) -> list[int]:
        return [node.index * self.rpn + j for j in range(self.rpn)]

    def generation(self, expect_fail: bool = False) -> list[dict[str, object] | str]:
        """What the launcher does each round: bind every SMP, then start them all at once."""
        self.epoch += 1
        eps = {}
        for node in self.nodes:
            r = node.req(m.PeerBind(keys=self.key.to_json(), host="127.0.0.1", me=node.index))
            eps[str(node.index)] = str(r["endpoint"])
        self.endpoints = eps
        # Start requests are answered after the sync: send all first, then collect.
        out: list[dict[str, object] | str] = []
        import threading

        results: dict[int, dict[str, object] | str] = {}

        def start(node: Node) -> None:
            try:
                results[node.index] = node.req(
                    m.PeerStart(
                        epoch=self.epoch,
                        me=node.index,
                        endpoints=eps,
                        m=self.m,
                        max_group=8,
                        ranks=self.ranks(node),
                    )
                )
            except SmpRequestError as exc:
                results[node.index] = str(exc)

        # Each node's client belongs to one thread at a time: one thread per node here.
        threads = [threading.Thread(target=start, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a start request hung"
        out = [results[n.index] for n in self.nodes]
        if not expect_fail:
            for r in out:
                assert isinstance(r, dict), r
        return out

    def save_all(self, step: int, size: int) -> None:
        for node in self.nodes:
            for r in self.ranks(node):
                payload = xxhash.xxh3_128_digest(f"{r}-{step}".encode()) * (size // 16)
                assert node.commit(r, step, payload)

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def protected(self, step: int) -> bool:
        return all(n.exchange().get("protected_step") == step for n in self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            node.stop()


@pytest.fixture
def cluster_factory(
    tmp_path_factory: pytest.TempPathFactory, run_id: str
) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []
    base = Path(__import__("tempfile").mkdtemp(prefix="ftx-", dir="/tmp"))

    def make(
        n: int, m: int, ranks_per_node: int = 1, env: dict[int, dict[str, str]] | None = None
    ) -> Cluster:
        c = Cluster(base, run_id, n, m, ranks_per_node, env)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        assert shm_files(run_id) == [], "an SMP left shared memory behind"
        __import__("shutil").rmtree(base, ignore_errors=True)


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
        ex = doc["exchange"]
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


def test_more_than_m_lost_is_a_clear_error(cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(3, 1)
    c.generation()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected", lambda: c.protected(1))
    for node in c.nodes[1:]:
        node.lose()
        node.start()
    res = c.generation(expect_fail=True)
    assert all(isinstance(r, str) and "more than m=1" in r for r in res), res


def payload(rank: int, step: int, size: int) -> bytes:
    return xxhash.xxh3_128_digest(f"{rank}-{step}".encode()) * (size // 16)


def flip_slot_byte(node: Node, rank: int, step: int, offset: int) -> None:
    """Corrupt one byte of a committed slot in shared memory (a bad DIMM, a stray write)."""
    snaps = node.req(m.Query(rank=rank))["snapshots"]
    path = next(s["path"] for s in snaps if s["step"] == step)  # type: ignore[attr-defined]
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

    import zmq

    c = cluster_factory(3, 1)
    c.generation()
    host, port = c.endpoints["0"].removeprefix("tcp://").rsplit(":", 1)
    for blob in (
        os.urandom(4096),
        b"\xff" * 10 + b"\x7f" + os.urandom(100),
        b"GET / HTTP/1.0\r\n\r\n",
    ):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(blob)
    # A peer with its own key pair (not the job's): the CURVE handshake refuses it.
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        other = keys.generate()
        d.curve_serverkey = c.key.public
        d.curve_publickey, d.curve_secretkey = other.public, other.secret
        d.setsockopt(zmq.ROUTING_ID, b"1")
        d.connect(c.endpoints["0"])
        d.send_multipart([b"FTMQ" + os.urandom(64), os.urandom(1024)], flags=zmq.NOBLOCK)
        time.sleep(0.5)  # give the handshake its chance to (wrongly) succeed
        d.close(linger=0)
    finally:
        ctx.term()
    c.save_all(1, 1 << 20)
    c.wait("step 1 protected despite the garbage", lambda: c.protected(1))
    for node in c.nodes:
        assert node.proc is not None and node.proc.poll() is None
