"""Erasure-coded protection across nodes over real CURVE sockets on loopback (a thread per node):
protect a step, lose up to m nodes, rebuild their snapshots and parity bitwise from the rest;
and the SMP's sync of a generation (real protectors, a real slot store) when the rebuilt
snapshot cannot be installed."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ftmem import shm
from ftmem.errors import UnrecoverableError
from ftmem.exchange import keys
from ftmem.exchange.messages import PeerAddress
from ftmem.exchange.placement import GroupPlan, plan_group
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.status import ExchangeState
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.smp.allocation import SlotFiles
from ftmem.smp.exchange_commands import Result, StartCommand
from ftmem.smp.exchange_state import ExchangeContext
from ftmem.smp.exchange_sync import GenerationSync
from ftmem.smp.hashing import HashService
from ftmem.smp.slot_store import SlotStore
from tests._support.smp_mesh import layout_for

STRIPE = 256 << 10


def run_threads(fns: list[Callable[[], None]], timeout: float = 60.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def inner() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return inner

    threads = [threading.Thread(target=wrap(f), daemon=True) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a node thread hung"
    if errors:
        raise errors[0]


def port_of(address: str) -> int:
    """The port of a node's address."""
    return int(PeerAddress.parse(address).endpoint.rsplit(":", 1)[1])


def mesh(
    plan: GroupPlan, transports: list[ZmqPeerTransport]
) -> tuple[dict[str, str], list[GroupProtector]]:
    """Start and connect every node's transport; the endpoints and a protector per node."""
    eps = {str(i): t.start() for i, t in enumerate(transports)}
    for t in transports:
        t.connect(eps)
    return eps, [GroupProtector(i, plan, t, STRIPE, timeout_s=30) for i, t in enumerate(transports)]


def scenario(n: int, m: int, sizes: list[int], lost: set[int]) -> None:
    plan = plan_group(list(range(n)), m)
    key = keys.generate()
    data = [os.urandom(s) for s in sizes]
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    eps = {str(i): t.start() for i, t in enumerate(transports)}
    for t in transports:
        t.connect(eps)
    prots = [GroupProtector(i, plan, transports[i], STRIPE, timeout_s=30) for i in range(n)]
    parity_before: dict[int, dict[tuple[int, int], bytes]] = {}
    done = threading.Event()
    replacements: list[ZmqPeerTransport] = []
    try:
        run_threads([lambda i=i: prots[i].protect(1, memoryview(data[i])) for i in range(n)])
        assert all(p.is_protected(1) for p in prots)
        for i in range(n):
            parity_before[i] = dict(prots[i].steps[1].parity)
        # Lose nodes: their transports close; replacements bind the same ports, empty, with
        # keys of their own; every node learns the new addresses (a new generation).
        for i in lost:
            transports[i].close()
            t = ZmqPeerTransport(str(i), key, port=port_of(eps[str(i)]))
            eps[str(i)] = t.start()
            replacements.append(t)
            prots[i] = GroupProtector(i, plan, t, STRIPE, timeout_s=30)
        survivors = [i for i in range(n) if i not in lost]
        for i in range(n):
            prots[i].transport.connect(eps)
        for i in survivors:
            prots[i].serve_rebuild(1, lost)
        rebuilt: dict[int, bytes] = {}

        def rebuild(i: int) -> None:
            rebuilt[i] = prots[i].rebuild(1, lost, source=survivors[0])

        def serve(i: int) -> None:
            prots[i].serve(done.is_set, poll_s=0.05)

        def rebuild_all() -> None:
            try:
                run_threads([lambda i=i: rebuild(i) for i in lost])
            finally:
                done.set()

        run_threads([rebuild_all, *[lambda i=i: serve(i) for i in survivors]])
        for i in lost:
            assert rebuilt[i] == data[i], f"node {i}'s snapshot was not rebuilt bitwise"
            assert prots[i].steps[1].parity == parity_before[i], f"node {i}'s parity differs"
    finally:
        done.set()
        for t in transports + replacements:
            t.close()


def test_three_nodes_one_lost() -> None:
    scenario(3, 1, [3_300_000, 1_000_000, 2_500_000], {2})


def test_four_nodes_two_lost_at_once() -> None:
    scenario(4, 2, [1_200_000, 2_000_000, 700_000, 2_000_000], {1, 3})


def test_more_than_m_lost_is_unrecoverable() -> None:
    with pytest.raises(UnrecoverableError, match="cannot rebuild"):
        scenario(3, 1, [500_000, 500_000, 500_000], {0, 2})


def test_parity_is_about_m_over_n_minus_m() -> None:
    n, m, size = 4, 2, 2_000_000
    plan = plan_group(list(range(n)), m)
    key = keys.generate()
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    try:
        _, prots = mesh(plan, transports)
        blobs = [os.urandom(size) for _ in range(n)]
        run_threads([lambda i=i: prots[i].protect(7, memoryview(blobs[i])) for i in range(n)])
        for p in prots:
            ratio = p.parity_bytes(7) / size
            assert abs(ratio - m / (n - m)) < 0.15, ratio
    finally:
        for t in transports:
            t.close()


def _sync_with_survivors(
    sync: GenerationSync, survivors: list[GroupProtector], held: dict[int, list[int]]
) -> Result | None:
    """One generation's sync of the replacement node (its protector is ``sync.ctx``'s) while
    the survivors serve; the start command's result."""
    ctx, done, out = sync.ctx, threading.Event(), []

    def sync_once() -> None:
        try:
            start = StartCommand(
                None, epoch=0, me=ctx.me, endpoints={}, m=1, max_group=8, ranks=[1]
            )
            sync.begin(start, held=[])
            ctx.board.move(ExchangeState.SYNCING)
            for node, steps in held.items():
                sync.on_held(node, steps)
            for p in survivors:  # the survivors' own syncs decided the same
                p.serve_rebuild(1, {ctx.me})
            out.append(sync.poll())
        finally:
            done.set()

    run_threads([sync_once, *[lambda p=p: p.serve(done.is_set, poll_s=0.05) for p in survivors]])
    return out[0]


def test_a_rebuild_the_slot_store_refuses_fails_the_sync_and_the_next_one_rebuilds(
    tmp_path: Path,
) -> None:
    """Installing the rebuilt snapshot raises StoreError (every slot of the rank is being
    allocated): the start fails with that error and REBUILD_FAILED, nothing stops; once the
    slots are free, the next sync rebuilds the step into one."""
    n, size, key = 3, 1 << 20, keys.generate()
    plan = plan_group(list(range(n)), 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    hasher = HashService("n1", 1)
    hasher.start()
    store = SlotStore("n1", 2, SlotFiles(tmp_path, "run", "n1"), hasher.submit)
    ctx = ExchangeContext("n1", store, None, me=1, epoch=0, plan=plan, ranks=[1])
    try:
        eps, prots = mesh(plan, transports)
        blobs = [os.urandom(size) for _ in range(n)]
        entry = {"rank": 1, "nbytes": size, "capacity": size, "layout": layout_for(blobs[1], 1)}
        manifest = json.dumps({"step": 1, "ranks": [entry]}).encode()
        run_threads(
            [lambda i=i: prots[i].protect(1, memoryview(blobs[i]), manifest) for i in range(n)]
        )
        # Node 1 is lost; its replacement's slots of rank 1 are all being allocated.
        transports[1].close()
        transports[1] = ZmqPeerTransport("1", key, port=port_of(eps["1"]))
        eps["1"] = transports[1].start()
        for t in transports:
            t.connect(eps)
        ctx.protector = GroupProtector(1, plan, transports[1], STRIPE, timeout_s=30)
        ctx.board.move(ExchangeState.BOUND)
        allocating = store.start_resize(1, -1, size)
        sync = GenerationSync(ctx, timeout_s=30)
        survivors, held = [prots[0], prots[2]], {0: [1], 2: [1]}
        failed = _sync_with_survivors(sync, survivors, held)
        assert failed is not None and not failed.ok, failed
        assert "rebuild of step 1 failed: cannot install the rebuilt snapshot" in failed.error
        assert "no slot to take a rebuilt snapshot" in failed.error
        status = ctx.board.typed()
        assert status.state is ExchangeState.REBUILD_FAILED and failed.error == status.error
        assert ctx.protected is None and not ctx.pinned and 1 not in ctx.protector.steps
        for index, _, gen in allocating:  # the allocations finish: both slots are free
            path = store.files.path(1, index, gen)
            shm.create_segment(path, size)
            store.finish_resize(1, index, str(path), size, ok=True)
        rebuilt = _sync_with_survivors(sync, survivors, held)
        assert rebuilt is not None and rebuilt.ok and rebuilt.data["rebuilt"] is True, rebuilt
        assert ctx.board.typed().state is ExchangeState.READY and ctx.protected == 1
        with open(ctx.pinned[1].pieces[0].path, "rb") as f:
            assert f.read(size) == blobs[1]
    finally:
        for step in list(ctx.pinned):
            assert ctx.protector is not None
            ctx.protector.forget(step)
            ctx.release(step)
        for t in transports:
            t.close()
        hasher.close()
