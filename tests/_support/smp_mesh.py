"""Real SMP processes meshed over CURVE/TCP on loopback, without launchers: each "node" is an
SMP; a test plays its ranks through the SMP protocol (begin, write the slot file, commit) and
plays the launcher's part (bind every SMP, then start them all), so a node's snapshot is
known bytes. Nodes are lost for real (SIGKILL of the SMP, removal of its shared memory) and
replaced by a fresh SMP that must rebuild. The ``cluster_factory`` fixture
(tests/conftest.py) makes and stops them."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import xxhash

from ftmem.errors import SmpRequestError
from ftmem.exchange import keys
from ftmem.exchange.placement import group_nodes
from ftmem.format.layout import TensorExtent, layout_json, tensors_json
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.protocol.status import ProtectionStatus
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import pid_gone, remove_shm

T = timedelta(seconds=60)
"""Every start and request deadline."""


def layout_for(payload: bytes, step: int) -> str:
    """A committed layout (no checksums: the SMP computes them) of one uint8 tensor."""
    n = len(payload)
    return layout_json(tensors_json([TensorExtent(0, "t", "uint8", (n,), 0, n)]), step, (n, 0))


def commit_of(rank: int, slot: int, gen: int, step: int, payload: bytes) -> m.Commit:
    """The COMMIT of ``payload`` as one uint8 tensor (registering its layout, id 1: no
    checksums, the SMP computes them), the skeleton empty right after it."""
    n = len(payload)
    return m.Commit(
        rank=rank,
        slot=slot,
        gen=gen,
        step=step,
        layout_id=1,
        objects_offset=n,
        objects_nbytes=0,
        layout=tensors_json([TensorExtent(0, "t", "uint8", (n,), 0, n)]),
    )


@dataclass
class Node:
    """One node: its SMP (``proc``), a client to it, and what its ranks committed."""

    index: int
    run_dir: Path
    run_id: str
    proc: SmpProcess | None = None
    client: SmpClient | None = None
    committed: dict[tuple[int, int], bytes] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The node's name, ``n<index>``."""
        return f"n{self.index}"

    def start(self, slots: int = 3, env: dict[str, str] | None = None) -> None:
        """Start the node's SMP (``env`` added to this process's) and a client to it."""
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
        """The SMP's log file."""
        return self.run_dir.parent / f"{self.name}-smp.log"

    def req(self, payload: object, timeout: timedelta = T) -> dict[str, object]:
        """One request to the SMP; its reply."""
        assert self.client is not None
        return self.client.request(payload, timeout)

    def commit(self, rank: int, step: int, payload: bytes) -> bool:
        """Play rank ``rank`` saving ``payload`` as ``step``; False if the SMP said skip."""
        assert self.client is not None
        begin = m.Begin(rank=rank, step=step, nbytes=len(payload))
        r = self.client.call(begin)
        if r.action is m.Decision.RESIZE:
            self.req(m.Prepare(rank=rank, slot=r.slot, nbytes=len(payload)))
            r = self.client.call(begin)
        if r.action is m.Decision.SKIP:
            return False
        assert r.action is m.Decision.WRITE, r
        fd = os.open(r.path, os.O_WRONLY)
        try:
            os.pwrite(fd, payload, 0)
        finally:
            os.close(fd)
        self.req(commit_of(rank, r.slot, r.gen, step, payload))
        self.committed[(rank, step)] = payload
        return True

    def read(self, rank: int, step: int) -> bytes | None:
        """The bytes the SMP holds of ``rank`` at ``step``, or None."""
        assert self.client is not None
        for s in self.client.query(rank):
            if s.step == step:
                n = json.loads(s.layout)["tensors"][0]["nbytes"]
                with open(s.path, "rb") as f:
                    return f.read(n)
        return None

    def protection(self) -> ProtectionStatus:
        """The exchange part of the SMP's status."""
        assert self.client is not None
        ex = self.client.status().protection
        assert ex is not None, "the SMP's exchange status does not parse"
        return ex

    def lose(self) -> None:
        """The node dies: SMP SIGKILLed, its shared memory gone with the machine."""
        assert self.proc is not None
        if self.client is not None:
            self.client.close()
            self.client = None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.stop(timeout=timedelta(seconds=10))
        remove_shm(self.run_id, self.name)
        for name in ("smp.sock", "smp.ready", "auth.key"):
            (self.run_dir / name).unlink(missing_ok=True)

    def stop(self) -> None:
        """Close the client and stop the SMP (asserting it is gone)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.proc.stop()
            assert pid_gone(self.proc.pid)
            self.proc = None


class Cluster:
    """``n`` nodes with erasure coding ``m``, each started at once; :meth:`close` stops them."""

    def __init__(
        self,
        base: Path,
        run_id: str,
        n: int,
        m: int,
        ranks_per_node: int = 1,
        env: dict[int, dict[str, str]] | None = None,
        max_group: int = 8,
    ) -> None:
        self.key = keys.generate()
        self.m = m
        self.max_group = max_group
        self.rpn = ranks_per_node
        self.nodes = [Node(i, base / f"n{i}", run_id) for i in range(n)]
        self.epoch = 0
        self.endpoints: dict[str, str] = {}
        """Every node's address (endpoint and public key) of the current generation."""
        self.node_keys: dict[int, keys.CurveKeyPair] = {}
        """Every node's own key pair of the current generation (as its agent makes it)."""
        self.timing: dict[str, float] = {}
        """The newest :meth:`generation`'s binds (one after the other, from here) and its
        starts (all at once, until the last reply: every group synced), in seconds."""
        for node in self.nodes:
            node.start(env=(env or {}).get(node.index))

    def ranks(self, node: Node) -> list[int]:
        """The global ranks of ``node``."""
        return [node.index * self.rpn + j for j in range(self.rpn)]

    def generation(self, expect_fail: bool = False) -> list[dict[str, object] | str]:
        """What the launcher does each round: bind every SMP (with a fresh key pair of its
        own), then start them all at once, each told its group's endpoints and the job's size."""
        self.epoch += 1
        eps = {}
        t0 = time.monotonic()
        for node in self.nodes:
            self.node_keys[node.index] = keys.generate()
            pair = self.key.with_node(self.node_keys[node.index]).to_json()
            r = node.req(m.PeerBind(keys=pair, host="127.0.0.1", me=node.index))
            eps[str(node.index)] = str(r["endpoint"])
        self.endpoints = eps
        t1 = time.monotonic()
        # Start requests are answered after the sync: send all first, then collect.
        out: list[dict[str, object] | str] = []
        results: dict[int, dict[str, object] | str] = {}

        def start(node: Node) -> None:
            try:
                group = group_nodes(len(self.nodes), self.m, self.max_group, node.index)
                results[node.index] = node.req(
                    m.PeerStart(
                        epoch=self.epoch,
                        me=node.index,
                        endpoints={str(i): eps[str(i)] for i in group},
                        m=self.m,
                        max_group=self.max_group,
                        ranks=self.ranks(node),
                        nodes=len(self.nodes),
                    )
                )
            except SmpRequestError as exc:  # the refusal's kind, then its text
                results[node.index] = f"{exc.kind.value}: {exc}"

        # Each node's client belongs to one thread at a time: one thread per node here.
        threads = [threading.Thread(target=start, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a start request hung"
        self.timing = {"bind_s": t1 - t0, "start_s": time.monotonic() - t1}
        out = [results[n.index] for n in self.nodes]
        if not expect_fail:
            for r in out:
                assert isinstance(r, dict), r
        return out

    def save_all(self, step: int, size: int) -> None:
        """Every rank of every node commits ``size`` known bytes as ``step``."""
        for node in self.nodes:
            for r in self.ranks(node):
                payload = xxhash.xxh3_128_digest(f"{r}-{step}".encode()) * (size // 16)
                assert node.commit(r, step, payload)

    def wait(self, what: str, cond: Callable[[], bool], timeout: float = 60.0) -> None:
        """Poll until ``cond()``; fail (naming ``what``) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    def endpoint(self, node: int) -> str:
        """Node ``node``'s bare endpoint ``tcp://host:port`` (its address without the key)."""
        return self.endpoints[str(node)].split(" ", 1)[0]

    def protected(self, step: int) -> bool:
        """Every node reports ``step`` as its protected step."""
        return all(n.protection().protected_step == step for n in self.nodes)

    def close(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()
