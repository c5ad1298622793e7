"""Erasure-coded protection across nodes over real CURVE sockets on loopback (a thread per node):
protect a step, lose up to m nodes, rebuild their snapshots and parity bitwise from the rest;
and the SMP's sync of a generation (real protectors, a real slot store) when the rebuilt
snapshot cannot be installed."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ftmem import shm
from ftmem.config import MAX_SLOT_BYTES
from ftmem.errors import UnrecoverableError
from ftmem.exchange import keys, rebuilder
from ftmem.exchange.placement import GroupPlan, plan_group
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.seals import Seal
from ftmem.exchange.zmq_transport import ZmqPeerTransport
from ftmem.protocol.messages import PeerStart
from ftmem.protocol.peer import PeerAddress
from ftmem.protocol.status import ProtectionState, ProtectionStatus
from ftmem.smp.allocation import SlotFiles
from ftmem.smp.hashing import HashService
from ftmem.smp.protection_state import Generation, PinnedSteps, Result, StartCommand, StatusBoard
from ftmem.smp.protection_sync import GenerationSync
from ftmem.smp.slot_store import SlotStore
from tests._support.smp_mesh import layout_for
from tests._support.tamper import TamperingProxy, data_message, send_raw

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


def scenario(
    n: int,
    m: int,
    sizes: list[int],
    lost: set[int],
    key_file: bool = False,
    tamper: int | None = None,
    every: bool = True,
    encode_workers: int = 0,
    serve_fetch: Callable[[Callable[..., None]], Callable[..., None]] | None = None,
    dropped: dict[int, int] | None = None,
) -> dict[int, int]:
    """Protect, lose ``lost``, rebuild them bitwise; with ``tamper``, that survivor's data
    channel to each lost node goes through a proxy that flips a byte of every fragment (or,
    not ``every``, of the first). With ``encode_workers``, every node encodes in that many
    worker processes. ``serve_fetch`` wraps the first survivor's answer to fetches (to lose or
    repeat replies); ``dropped`` gets each rebuilt node's count of messages it ignored as not
    fitting its state. Returns each rebuilt node's count of refused messages."""
    plan = plan_group(list(range(n)), m)
    k = keys.generate()
    key = keys.CurveKeyPair(k.public, k.secret, from_file=key_file)  # seals checked if so
    data = [os.urandom(s) for s in sizes]
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    eps = {str(i): t.start() for i, t in enumerate(transports)}
    for t in transports:
        t.connect(eps)
    prots = [
        GroupProtector(i, plan, transports[i], STRIPE, timeout_s=30, encode_workers=encode_workers)
        for i in range(n)
    ]
    first = list(prots)
    parity_before: dict[int, dict[tuple[int, int], bytes]] = {}
    done = threading.Event()
    replacements: list[ZmqPeerTransport] = []
    proxies: list[TamperingProxy] = []
    try:
        run_threads([lambda i=i: prots[i].protect(1, memoryview(data[i])) for i in range(n)])
        assert all(p.is_protected(1) for p in prots)
        if encode_workers:  # every stripe went through the workers
            assert all(
                p.encode_pool and p.encode_pool.encoded and not p.encode_pool.fell_back
                for p in prots
            )
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
        # The survivors learn the new members first, as under the SMP, whose survivors bind a
        # fresh transport each generation: a handshake that reaches a transport which still
        # admits the old members only is refused for good (ZeroMQ does not retry it).
        for i in [*survivors, *sorted(lost)]:
            if i != tamper:
                prots[i].transport.connect(eps)
                continue
            seen = dict(eps)
            for j in lost:
                a = PeerAddress.parse(eps[str(j)])
                proxies.append(TamperingProxy(a.data, every=every, min_size=4096))
                seen[str(j)] = str(PeerAddress(a.endpoint, a.key, proxies[-1].endpoint))
            prots[i].transport.connect(seen)
        for i in survivors:
            prots[i].rebuilder.serve_only(1, lost)
        if serve_fetch is not None:
            r = prots[survivors[0]].rebuilder
            r.serve_fetch = serve_fetch(r.serve_fetch)  # type: ignore[method-assign]
        rebuilt: dict[int, bytes] = {}

        def rebuild(i: int) -> None:
            rebuilt[i] = prots[i].rebuilder.rebuild(1, lost, source=survivors[0])

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
        if dropped is not None:
            dropped.update({i: prots[i].dropped for i in lost})
        return {i: prots[i].transport.forged for i in lost}  # type: ignore[attr-defined]
    finally:
        done.set()
        for p in first + prots:
            p.close()
        for t in transports + replacements:
            t.close()
        for proxy in proxies:
            proxy.close()


def test_three_nodes_one_lost() -> None:
    scenario(3, 1, [3_300_000, 1_000_000, 2_500_000], {2})


@pytest.mark.parametrize(("n", "m", "workers"), [(3, 1, 1), (4, 2, 2)])
def test_stripes_encoded_by_worker_processes_rebuild_bitwise(n: int, m: int, workers: int) -> None:
    """``encode_workers``: every node's stripes are encoded by its pool's processes; the
    lost nodes are rebuilt from that parity bitwise, and rebuild the same parity."""
    sizes = [3_300_000, 1_000_000, 2_500_000, 2_000_000][:n]
    scenario(n, m, sizes, set(range(1, m + 1)), encode_workers=workers)


def test_four_nodes_two_lost_at_once() -> None:
    """With a key file: each rebuilt node checks its own seal and digest (and they match)."""
    scenario(4, 2, [1_200_000, 2_000_000, 700_000, 2_000_000], {1, 3}, key_file=True)


def test_fragments_altered_on_the_data_channel_are_refused_and_rebuilt_from_spares() -> None:
    """A man in the middle flips a byte of every fragment node 0 sends to the rebuilding node
    1: each is refused (wrong tag), asked for again, refused again and counted lost; with m=2
    the stripes are rebuilt from spare fragments, bitwise."""
    forged = scenario(4, 2, [1_200_000, 2_000_000, 700_000, 2_000_000], {1}, tamper=0)
    assert forged[1] >= 2, forged


def test_with_m1_altered_fragments_are_refused_with_a_clear_error() -> None:
    with pytest.raises(
        UnrecoverableError, match=r"stripe needs 2 valid fragments.*refused twice for a wrong tag"
    ):
        scenario(3, 1, [1_000_000, 1_000_000, 1_000_000], {1}, tamper=0)


def test_a_fragment_altered_once_is_asked_for_again_and_the_rebuild_succeeds() -> None:
    forged = scenario(3, 1, [1_000_000, 1_000_000, 1_000_000], {1}, tamper=0, every=False)
    assert forged[1] == 1, forged


def test_a_fetch_whose_reply_is_lost_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first survivor swallows the first fetch it gets (as a reply lost with a broken
    data-channel connection would be): unanswered, it is asked again and the rebuild ends
    bitwise."""
    monkeypatch.setattr(rebuilder, "ASK_AGAIN_S", 0.5)
    seen: list[tuple[int, int, int]] = []

    def lose_first(serve: Callable[..., None]) -> Callable[..., None]:
        def serve_fetch(sender: int, b: Any) -> None:
            seen.append((b.step, b.stripe, b.frag))
            if len(seen) > 1:
                serve(sender, b)

        return serve_fetch

    scenario(3, 1, [3_300_000, 1_000_000, 2_500_000], {2}, serve_fetch=lose_first)
    assert seen.count(seen[0]) == 2, seen


def test_a_reply_that_comes_twice_is_ignored() -> None:
    """The first survivor answers every fetch twice (a request asked again whose first reply
    was only late): the second reply is ignored as such, not counted as a message that does
    not fit, and the rebuild ends bitwise."""

    def twice(serve: Callable[..., None]) -> Callable[..., None]:
        def serve_fetch(sender: int, b: Any) -> None:
            serve(sender, b)
            serve(sender, b)

        return serve_fetch

    dropped: dict[int, int] = {}
    scenario(3, 1, [3_300_000, 1_000_000, 2_500_000], {2}, serve_fetch=twice, dropped=dropped)
    assert dropped == {2: 0}


def test_a_column_altered_on_the_data_channel_gives_the_round_up_at_once() -> None:
    """A man in the middle flips a byte of every column node 0 sends to node 1 while the
    group protects step 1: node 1 refuses them, gives the step up and tells its peers, so
    every node's round ends (StepAborted) long before its timeout; step 2, sent directly,
    is protected."""
    from ftmem.exchange.protector import StepAborted

    n, key = 3, keys.generate()
    plan = plan_group(list(range(n)), 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    proxy: TamperingProxy | None = None
    try:
        eps, prots = mesh(plan, transports)
        a = PeerAddress.parse(eps["1"])
        proxy = TamperingProxy(a.data, every=True, min_size=4096)
        transports[0].connect({**eps, "1": str(PeerAddress(a.endpoint, a.key, proxy.endpoint))})
        blobs = [os.urandom(1_000_000) for _ in range(n)]
        aborted: list[int] = []

        def protect(i: int, step: int) -> None:
            try:
                prots[i].protect(step, memoryview(blobs[i]))
            except StepAborted:
                aborted.append(i)
                prots[i].drain()  # node 1's ABORT to its peers, as the SMP's loop would
                prots[i].forget(step)

        started = time.monotonic()
        run_threads([lambda i=i: protect(i, 1) for i in range(n)])
        assert sorted(aborted) == [0, 1, 2] and time.monotonic() - started < 20, aborted
        assert transports[1].forged >= 1 and proxy.flips >= 1
        transports[0].connect(eps)  # the direct connection again
        run_threads([lambda i=i: prots[i].protect(2, memoryview(blobs[i])) for i in range(n)])
        assert all(p.is_protected(2) for p in prots)
    finally:
        for t in transports:
            t.close()
        if proxy is not None:
            proxy.close()


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
    sync: GenerationSync,
    gen: Generation,
    survivors: list[GroupProtector],
    held: dict[int, list[int]],
    expect_held: bool = True,
) -> Result | None:
    """One generation's sync of the replacement node (``gen``: its generation, with its
    protector) while the survivors serve; the start command's result.

    With ``expect_held`` the survivors serve until the replacement's HELD (sent once the
    bytes are rebuilt, even if installing them fails) has reached them (bounded: 30 s): one
    left in a socket would end the next round's serving as soon as it is read."""
    done, out = threading.Event(), []
    done_at: list[float] = []

    def sync_once() -> None:
        try:
            request = PeerStart(epoch=0, me=gen.me, endpoints={}, m=1, max_group=8, ranks=[1])
            start = StartCommand(None, request, endpoints={})
            sync.begin(start, gen, held=[])
            sync.board.move(ProtectionState.SYNCING)
            for node, steps in held.items():
                sync.on_held(node, steps)
            for p in survivors:  # the survivors' own syncs decided the same
                p.rebuilder.serve_only(1, {gen.me})
            out.append(sync.poll())
        finally:
            done_at.append(time.monotonic())
            done.set()

    def until(p: GroupProtector) -> Callable[[], bool]:
        def stop() -> bool:
            if not done.is_set():
                return False
            served = expect_held and gen.me in p.rebuilder.serving()
            return not served or time.monotonic() > done_at[0] + 30

        return stop

    run_threads([sync_once, *[lambda p=p: p.serve(until(p), poll_s=0.05) for p in survivors]])
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
    pins, board = PinnedSteps(store), StatusBoard("n1")
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
        protector = GroupProtector(1, plan, transports[1], STRIPE, timeout_s=30)
        gen = Generation(1, 0, (1,), plan, {}, protector)
        board.move(ProtectionState.BOUND)
        allocating = store.start_resize(1, -1, size)
        sync = GenerationSync(pins, board, timeout_s=30)
        survivors, held = [prots[0], prots[2]], {0: [1], 2: [1]}
        failed = _sync_with_survivors(sync, gen, survivors, held)
        assert failed is not None and not failed.ok, failed
        assert "rebuild of step 1 failed: cannot install the rebuilt snapshot" in failed.error
        assert "no slot to take a rebuilt snapshot" in failed.error
        status = ProtectionStatus.from_json(board.read().to_json())
        assert status.state is ProtectionState.REBUILD_FAILED and failed.error == status.error
        assert pins.protected is None and not pins.steps() and 1 not in protector.steps
        for index, _, slot_gen in allocating:  # the allocations finish: both slots are free
            path = store.files.path(1, index, slot_gen)
            shm.create_segment(path, size)
            store.finish_resize(1, index, str(path), size, ok=True)
        rebuilt = _sync_with_survivors(sync, gen, survivors, held)
        assert rebuilt is not None and rebuilt.ok and rebuilt.data["rebuilt"] is True, rebuilt
        assert (
            ProtectionStatus.from_json(board.read().to_json()).state is ProtectionState.READY
            and pins.protected == 1
        )
        pinned = pins.get(1)
        assert pinned is not None
        with open(pinned.pieces[0].path, "rb") as f:
            assert f.read(size) == blobs[1]
    finally:
        if pins.steps():  # only once the protector was made
            pins.keep_only(None, protector)
        for t in transports:
            t.close()
        hasher.close()


def _protected_trio(
    key: keys.CurveKeyPair, size: int = 600_000
) -> tuple[dict[str, str], list[ZmqPeerTransport], list[GroupProtector], list[bytes]]:
    """Three nodes (m=1) that protected step 1, each with a manifest naming its rank."""
    plan = plan_group([0, 1, 2], 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(3)]
    eps, prots = mesh(plan, transports)
    blobs = [os.urandom(size) for _ in range(3)]

    def manifest(i: int) -> bytes:
        entry = {"rank": i, "nbytes": size, "capacity": size, "layout": layout_for(blobs[i], 1)}
        return json.dumps({"step": 1, "ranks": [entry]}).encode()

    run_threads(
        [lambda i=i: prots[i].protect(1, memoryview(blobs[i]), manifest(i)) for i in range(3)]
    )
    return eps, transports, prots, blobs


def _replace(
    i: int, key: keys.CurveKeyPair, eps: dict[str, str], transports: list[ZmqPeerTransport]
) -> GroupProtector:
    """Node ``i`` is lost; a replacement (new keys, same port) joins a new generation."""
    transports[i].close()
    transports[i] = ZmqPeerTransport(str(i), key, port=port_of(eps[str(i)]))
    eps[str(i)] = transports[i].start()
    for t in transports:
        t.connect(eps)
    return GroupProtector(i, plan_group([0, 1, 2], 1), transports[i], STRIPE, timeout_s=30)


def _rebuild_against(
    lost: GroupProtector, survivors: list[GroupProtector]
) -> memoryview | BaseException:
    """Node ``lost`` rebuilds step 1 from node 0 while the survivors serve it; the result."""
    out: list[memoryview | BaseException] = []
    done = threading.Event()
    for p in survivors:
        p.rebuilder.serve_only(1, {lost.me})

    def rebuild() -> None:
        try:
            out.append(lost.rebuilder.rebuild(1, {lost.me}, source=0))
        except Exception as exc:
            out.append(exc)
        finally:
            done.set()

    run_threads([rebuild, *[lambda p=p: p.serve(done.is_set, poll_s=0.05) for p in survivors]])
    return out[0]


def test_a_rebuild_from_parity_a_peer_altered_is_refused() -> None:
    """Survivors serve altered parity without the stripe checksums (which came from peers, so
    the codec has nothing to check): the rebuilt bytes do not match the digest the lost node
    sealed, and the rebuild is refused."""
    k = keys.generate()
    key = keys.CurveKeyPair(k.public, k.secret, from_file=True)
    eps, transports, prots, _ = _protected_trio(key)
    try:
        for p in prots[:2]:
            st = p.steps[1]
            st.checksums.clear()
            for (stripe, frag), payload in list(st.parity.items()):
                st.parity[(stripe, frag)] = payload[:-1] + bytes([payload[-1] ^ 0xFF])
        prots[2] = _replace(2, key, eps, transports)
        got = _rebuild_against(prots[2], prots[:2])
        assert isinstance(got, UnrecoverableError), got
        assert "do not match the digest node 2 committed" in str(got)
        assert 1 not in prots[2].steps, "the refused bytes were kept"
    finally:
        for t in transports:
            t.close()


@pytest.mark.parametrize("what", ["manifest", "digest", "size"])
def test_a_manifest_or_digest_a_peer_altered_fails_the_lost_nodes_seal(what: str) -> None:
    k = keys.generate()
    key = keys.CurveKeyPair(k.public, k.secret, from_file=True)
    eps, transports, prots, _ = _protected_trio(key)
    try:
        st = prots[0].steps[1]
        if what == "manifest":
            st.manifests[2] = st.manifests[2].replace(b'"rank": 2', b'"rank": 9')
        elif what == "digest":
            old = st.seals[2]
            st.seals[2] = Seal("0" * 32, old.tag)
        else:
            st.sizes[2] -= 1
        prots[2] = _replace(2, key, eps, transports)
        got = _rebuild_against(prots[2], prots[:2])
        assert isinstance(got, UnrecoverableError), got
        assert "do not carry node 2's seal" in str(got)
    finally:
        for t in transports:
            t.close()


def test_oversized_sizes_in_a_meta_reply_are_refused_before_allocation() -> None:
    """A survivor says the lost node's snapshot has 8 TiB: refused at once, never allocated."""
    key = keys.generate()
    eps, transports, prots, _ = _protected_trio(key)
    try:
        prots[0].steps[1].sizes[2] = 1 << 43
        prots[2] = _replace(2, key, eps, transports)
        prots[2].max_node_bytes = 1 << 30
        got = _rebuild_against(prots[2], prots[:2])
        assert isinstance(got, UnrecoverableError), got
        assert "over the bound of 1073741824 bytes" in str(got)
    finally:
        for t in transports:
            t.close()


def test_a_fetch_or_meta_from_a_node_not_being_rebuilt_gets_no_bytes() -> None:
    """Node 1 (a member, not rebuilding) asks node 0 for node 2's data and for sizes: node 0
    answers nothing and counts both; once the sync says node 1 rebuilds, it is answered."""
    from ftmem.protocol import peer as pm
    from ftmem.protocol.peer import FragmentKind

    key = keys.generate()
    _, transports, prots, _ = _protected_trio(key)
    try:
        prots[0].rebuilder.hold()
        prots[0].rebuilder.serve_only(1, {2})  # the sync decided: node 2 rebuilds step 1
        fetch = pm.FetchRequest(1, 0, 0, FragmentKind.DATA, 0, 1000)
        for body in (fetch, pm.MetaRequest(1)):
            transports[1].send("0", body.to_header(0), [])
        until = time.monotonic() + 10
        prots[0].serve(
            lambda: prots[0].rebuilder.refused >= 2 or time.monotonic() > until, poll_s=0.05
        )
        assert prots[0].rebuilder.refused == 2
        assert transports[1].recv(1.0) is None, "node 0 answered a refused request"
        prots[0].rebuilder.serve_only(1, {1})
        transports[1].send("0", fetch.to_header(0), [])
        sent = prots[0].sent_bytes
        until = time.monotonic() + 10
        prots[0].serve(lambda: prots[0].sent_bytes > sent or time.monotonic() > until, poll_s=0.05)
        got = transports[1].recv(10.0)
        assert got is not None and got.header["t"] == "fetched" and got.buffers
    finally:
        for t in transports:
            t.close()


def test_a_flood_of_fragments_for_many_steps_stays_within_the_byte_bound() -> None:
    """A member sends columns and parity of 200 steps nobody protects (100 MiB), then 10 MiB
    of columns of one step: node 0 keeps at most its unplanned-bytes bound (4 MiB here) and
    the newest MAX_OPEN_STEPS steps, drops and counts the rest, and protects a real step
    afterwards."""
    from ftmem.exchange.steps import MAX_OPEN_STEPS
    from ftmem.protocol import peer as pm

    key = keys.generate()
    plan = plan_group([0, 1, 2], 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(3)]
    try:
        _, prots = mesh(plan, transports)
        prots[0].table.max_unplanned_bytes = 4 << 20
        piece = os.urandom(256 << 10)
        flood = [
            body
            for step in range(100, 300)
            for body in (pm.Data(step, 0, 0), pm.Parity(step, 0, 2, (1, 2, 3)))
        ]
        flood += [pm.Data(500, stripe, 0) for stripe in range(40)]  # 10 MiB of one step
        received = 0
        for body in flood:
            transports[1].send("0", body.to_header(0), [piece])
            msg = transports[0].recv(0)
            while msg is not None:  # node 0 keeps up with the flood
                prots[0].handle(msg)
                received += 1
                msg = transports[0].recv(0)
        while received < len(flood):  # every message of the flood is in before step 1 starts
            msg = transports[0].recv(10.0)
            assert msg is not None, f"{len(flood) - received} messages of the flood lost"
            prots[0].handle(msg)
            received += 1
        kept = sum(
            sum(map(len, st.columns.values())) + sum(map(len, st.parity.values()))
            for st in prots[0].steps.values()
        )
        assert kept <= 4 << 20, kept
        assert len(prots[0].steps) <= MAX_OPEN_STEPS and min(prots[0].steps) >= 300 - MAX_OPEN_STEPS
        assert prots[0].dropped >= 40 - 16, "the columns past the byte bound were not dropped"
        blobs = [os.urandom(300_000) for _ in range(3)]
        run_threads([lambda i=i: prots[i].protect(1, memoryview(blobs[i])) for i in range(3)])
        assert all(p.is_protected(1) for p in prots)
    finally:
        for t in transports:
            t.close()


def test_a_rebuild_manifest_asking_for_more_than_free_shared_memory_is_refused(
    tmp_path: Path,
) -> None:
    """The lost node's manifest (sealed: as a holder of the job key could make one) claims
    a slot 1 GiB larger than the free space: the sync refuses the rebuild before any slot or
    buffer is allocated."""
    n, size, key = 3, 1 << 20, keys.generate()
    vfs = os.statvfs(tmp_path)
    claim = vfs.f_bavail * vfs.f_frsize + (1 << 30)
    if claim > MAX_SLOT_BYTES:
        pytest.skip("more free space than one slot may have")
    plan = plan_group(list(range(n)), 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    hasher = HashService("n1", 1)
    hasher.start()
    store = SlotStore("n1", 2, SlotFiles(tmp_path, "run", "n1"), hasher.submit)
    pins, board = PinnedSteps(store), StatusBoard("n1")
    try:
        eps, prots = mesh(plan, transports)
        blobs = [os.urandom(size) for _ in range(n)]
        entry = {"rank": 1, "nbytes": size, "capacity": claim, "layout": layout_for(blobs[1], 1)}
        manifest = json.dumps({"step": 1, "ranks": [entry]}).encode()
        run_threads(
            [lambda i=i: prots[i].protect(1, memoryview(blobs[i]), manifest) for i in range(n)]
        )
        transports[1].close()
        transports[1] = ZmqPeerTransport("1", key, port=port_of(eps["1"]))
        eps["1"] = transports[1].start()
        for t in transports:
            t.connect(eps)
        protector = GroupProtector(1, plan, transports[1], STRIPE, timeout_s=30)
        gen = Generation(1, 0, (1,), plan, {}, protector)
        board.move(ProtectionState.BOUND)
        sync = GenerationSync(pins, board, timeout_s=30)
        failed = _sync_with_survivors(
            sync, gen, [prots[0], prots[2]], {0: [1], 2: [1]}, expect_held=False
        )
        assert failed is not None and not failed.ok, failed
        assert f"the rebuilt slots need {claim} bytes" in failed.error, failed.error
        assert (
            ProtectionStatus.from_json(board.read().to_json()).state
            is ProtectionState.REBUILD_FAILED
        )
        assert not list(tmp_path.iterdir()), "a slot was allocated"
    finally:
        for t in transports:
            t.close()
        hasher.close()


def test_forged_messages_naming_a_member_abort_no_round() -> None:
    """Anyone can reach the data channel: a stranger without the job's key floods node 1 with
    columns, sizes and parity of the step being protected that name node 0 and carry a made-up
    tag. They are refused and counted, and, since the real ones keep coming, no round is given
    up: every node protects the step."""
    import xxhash

    from ftmem.protocol import messages as m
    from ftmem.protocol.wire import encode

    n, key = 3, keys.generate()
    plan = plan_group(list(range(n)), 1)
    transports = [ZmqPeerTransport(str(i), key) for i in range(n)]
    stop = threading.Event()
    try:
        eps, prots = mesh(plan, transports)
        data = PeerAddress.parse(eps["1"]).data
        payload = b"x" * 4096
        headers = [
            encode(
                m.Peer(
                    header={"t": t, "e": 0, "step": 1, **extra},
                    sizes=[4096],
                    hashes=[xxhash.xxh3_64_hexdigest(payload)],
                ),
                1,
                None,
            )
            for t, extra in (
                ("data", {"stripe": 0, "col": 0}),
                ("parity", {"stripe": 0, "frag": 0}),
                ("size", {"nbytes": 1000}),
            )
        ]

        def forge() -> None:
            while not stop.is_set():
                for h in headers:  # a wrong head tag closes the connection: one per message
                    with contextlib.suppress(OSError):
                        send_raw(data, data_message(b"0", h, [payload]))
                time.sleep(0.005)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        time.sleep(0.2)  # the flood is on before the round starts
        blobs = [os.urandom(1_000_000) for _ in range(n)]
        run_threads([lambda i=i: prots[i].protect(1, memoryview(blobs[i])) for i in range(n)])
        assert all(p.is_protected(1) for p in prots)
        assert transports[1].forged >= 1
    finally:
        stop.set()
        for t in transports:
            t.close()
