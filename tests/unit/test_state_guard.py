"""The rendezvous state guard (ftmem.launch.state_guard, its rules of rounds):
a real elastic state round-trips; a pickle that names anything else runs nothing and is
refused; a MACed state verifies only with the job's key and run id; a refused read answers
the last state that passed, with the refused value's token."""

from __future__ import annotations

import base64
import builtins
import logging
import os
import pickle
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _NodeDesc,
    _RendezvousState,
)

from ftmem.launch.elastic_compat import (
    trust_rendezvous_state_for,
)
from ftmem.launch.state_guard import (
    MAGIC,
    GuardedBackend,
    RoundRules,
    StateRefused,
    _clean_state,
    guard_rendezvous_state,
    leaving_round,
    load_rendezvous_state,
    restricted_loads,
    seal,
    unseal,
)
from tests._support.launcher import free_port


def _state() -> _RendezvousState:
    s = _RendezvousState()
    a, b = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 12, 1)
    now = datetime.now(timezone.utc)
    s.round, s.complete, s.deadline = 3, True, now + timedelta(seconds=5)
    s.participants = {a: 0}
    s.wait_list, s.redundancy_list = {b}, set()
    s.last_heartbeats = {a: now, b: now - timedelta(seconds=1)}
    return s


class Runs:
    """``__reduce__`` of a pickle that would call ``fn(*args)`` when loaded."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def test_a_real_state_round_trips_in_the_protocols_elastic_uses() -> None:
    want = _state()
    for protocol in (4, 5):
        got = load_rendezvous_state(pickle.dumps(want, protocol=protocol))
        assert type(got) is _RendezvousState and vars(got) == vars(want)
    # the guard's bytes are what elastic unpickles: the same state again
    assert vars(pickle.loads(_clean_state(pickle.dumps(want)))) == vars(want)


@pytest.mark.parametrize(
    "evil",
    [
        lambda m: Runs(os.system, f"touch {m}"),
        lambda m: Runs(builtins.eval, f"open({str(m)!r}, 'w')"),
        lambda m: Runs(subprocess.call, ["touch", str(m)]),
        lambda m: Runs(open, str(m), "w"),
        # the payload hidden inside an otherwise real state
        lambda m: {**vars(_state()), "round": Runs(os.system, f"touch {m}")},
    ],
)
def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(
    tmp_path: Path, evil: Any
) -> None:
    marker = tmp_path / "MARKER"
    bits = pickle.dumps(evil(marker))
    with pytest.raises(pickle.UnpicklingError, match="is not allowed"):
        load_rendezvous_state(bits)
    assert not marker.exists()


@pytest.mark.parametrize(
    "bad",
    [
        {"x": 1},  # not a state
        _NodeDesc("a", 1, 2),
        datetime.now(timezone.utc),
    ],
)
def test_allowed_globals_that_are_no_state_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="not a rendezvous state"):
        load_rendezvous_state(pickle.dumps(bad))


def test_a_state_with_wrong_field_types_is_refused() -> None:
    s = _state()
    s.last_heartbeats = {next(iter(s.participants)): datetime.now()}  # naive: elastic would crash
    with pytest.raises(ValueError, match="aware datetime"):
        load_rendezvous_state(pickle.dumps(s))
    s = _state()
    s.participants = {_NodeDesc("a", "1", 0): 0}  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="_NodeDesc"):
        load_rendezvous_state(pickle.dumps(s))
    with pytest.raises(pickle.UnpicklingError, match="over the bound"):
        restricted_loads(b"x" * 100, frozenset(), max_bytes=99)


def test_the_mac_binds_the_key_and_the_run_id() -> None:
    body = pickle.dumps(_state())
    framed = seal(b"k" * 32, b"run", body)
    assert framed.startswith(MAGIC) and unseal(b"k" * 32, b"run", framed) == body
    for key, ctx, data in [
        (b"j" * 32, b"run", framed),  # another job's key
        (b"k" * 32, b"other-run", framed),  # another run
        (b"k" * 32, b"run", body),  # no MAC
        (b"k" * 32, b"run", framed[:-1] + bytes([framed[-1] ^ 1])),  # tampered
    ]:
        with pytest.raises(StateRefused):
            unseal(key, ctx, data)


class DictBackend:
    """A backend over a dict, with elastic's token semantics (a counter)."""

    name = "dict"

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.token = 0

    def get_state(self) -> tuple[bytes, Any] | None:
        return None if self.value is None else (self.value, self.token)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        if (token or 0) == self.token:
            self.value, self.token = state, self.token + 1
            return state, self.token, True
        assert self.value is not None
        return self.value, self.token, False


@pytest.mark.parametrize("key", [None, b"k" * 32])
def test_a_planted_state_answers_the_last_one_that_passed_with_its_token(
    tmp_path: Path, key: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    inner = DictBackend()
    empty = pickle.dumps(_RendezvousState())
    guard = GuardedBackend(inner, _clean_state, empty, key, "run")
    marker, real = tmp_path / "MARKER", _state()
    # nothing passed yet: a planted value reads as a fresh state
    inner.value, inner.token = pickle.dumps(Runs(os.system, f"touch {marker}")), 7
    with caplog.at_level(logging.INFO, logger="ftmem.launch.state_guard"):
        assert guard.get_state() == (empty, 7)
        written = guard.set_state(pickle.dumps(real), 7)  # elastic's next write wins
        assert written is not None and written[2]
        assert vars(pickle.loads(written[0])) == vars(real)
        assert (inner.value or b"").startswith(MAGIC) == (key is not None)
        last = written[0]
        for _ in range(3):  # planted again: the last state that passed, the planted token
            inner.value, inner.token = pickle.dumps(Runs(os.system, f"touch {marker}")), 9
            assert guard.get_state() == (last, 9)
        if key is not None:  # a real state without this job's MAC is refused too
            inner.value = pickle.dumps(real)
            assert guard.get_state() == (last, 9)
        assert guard.set_state(pickle.dumps(real), 9) is not None
        assert guard.get_state() == (last, 10)
    assert not marker.exists()
    refused = [r for r in caplog.records if "not written by this job" in r.message]
    assert len(refused) == 2  # once per incident (3 planted reads in the second)
    assert sum("passes its checks again" in r.message for r in caplog.records) == 2


def test_a_refused_read_while_leaving_a_complete_round_reads_as_the_next_round() -> None:
    """Leaving a complete round it took part in, a node whose read is refused reads the next
    round, open and empty; not leaving, or not a participant, it reads its last good state
    as it was; and every state that passes is read as it is."""
    a, b = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 12, 1)
    rules = RoundRules(a)
    inner = DictBackend()
    guard = GuardedBackend(inner, _clean_state, pickle.dumps(_RendezvousState()), None, "r", rules)

    def state(round_: int, complete: bool, *nodes: _NodeDesc) -> bytes:
        s = _RendezvousState()
        s.round, s.complete = round_, complete
        s.participants = {n: i for i, n in enumerate(nodes)}
        s.last_heartbeats = {n: datetime.now(timezone.utc) for n in nodes}
        return pickle.dumps(s)

    def read(bits: bytes | None = None) -> Any:
        if bits is not None:
            inner.value, inner.token = bits, inner.token + 1
        got = guard.get_state()
        assert got is not None and got[1] == inner.token
        return load_rendezvous_state(got[0])

    assert (read(state(1, False, b)).round, read(state(1, True, a, b)).round) == (1, 1)
    rules.leaving, rules.left = True, 1  # as leaving_round sets it: this node leaves round 1
    inner.value = b"planted"
    after = read()
    assert (after.round, after.complete, after.participants) == (2, False, {})
    rules.leaving = False  # not leaving: the last good state, as it was
    assert (read().round, read().complete) == (1, True)
    rules.leaving = True
    read(state(3, True, b))  # a complete round without this node: its wait list is right
    inner.value = b"planted"
    assert (read().round, set(read().participants)) == (3, {b})
    # A first join (no round read before it): once it read a complete round with itself
    # in it, it joined that round; a refused read is that round, not the next.
    rules.leaving, rules.left, rules.newest = True, None, None
    assert read(state(4, True, a, b)).round == 4 and rules.joined == 4
    inner.value = b"planted"
    assert (read().round, read().complete) == (4, True)


def test_a_round_read_complete_does_not_come_back_open_nor_an_older_round() -> None:
    """Node a read round 1 complete; a node's stale view of round 1, open, written back with
    this job's MAC (as after a store writer erased the state), and a replay of round 0 are
    refused like planted states, and a writes round 1 back over them at once (its answer:
    that state and its token). A newer round passes."""
    a, b = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 12, 1)
    key = b"k" * 32
    inner = DictBackend()
    guard = GuardedBackend(
        inner, _clean_state, pickle.dumps(_RendezvousState()), key, "r", RoundRules(a)
    )

    def state(round_: int, complete: bool, *nodes: _NodeDesc) -> bytes:
        s = _RendezvousState()
        s.round, s.complete = round_, complete
        s.participants = {n: i for i, n in enumerate(nodes)}
        return seal(key, b"r", pickle.dumps(s))

    def read(bits: bytes) -> tuple[int, bool, set[Any], int]:
        inner.value, inner.token = bits, inner.token + 1
        got = guard.get_state()
        assert got is not None
        s = load_rendezvous_state(got[0])
        return s.round, s.complete, set(s.participants), got[1]

    assert read(state(0, True, a, b))[:2] == (0, True)
    assert read(state(1, False, b))[:2] == (1, False)
    assert read(state(1, True, a, b))[:3] == (1, True, {a, b})
    stale = read(state(1, False, b))  # refused, and round 1 complete written back over it
    assert stale == (1, True, {a, b}, inner.token)
    assert inner.value is not None
    back = load_rendezvous_state(unseal(key, b"r", inner.value))
    assert (back.round, back.complete, set(back.participants)) == (1, True, {a, b})
    assert read(state(0, True, a, b))[:2] == (1, True)  # a replay of an older round
    # a's own write meets a stale state (its compare-and-set fails on it): written back too
    inner.value, inner.token = state(1, False, b), inner.token + 1
    mine = _RendezvousState()
    mine.round, mine.complete, mine.participants = 1, True, {a: 0, b: 1}
    answer = guard.set_state(pickle.dumps(mine), inner.token - 1)
    assert answer is not None and not answer[2] and answer[1] == inner.token
    back = load_rendezvous_state(unseal(key, b"r", inner.value))
    assert (back.round, back.complete, set(back.participants)) == (1, True, {a, b})
    # Leaving round 1 (as the agent's join does), a refused read is round 2, open, empty;
    # once this node read round 2 complete (it joined), a stale state of round 2 is written
    # back, and a planted one reads as round 2 still: leaving round 1 is over.
    with leaving_round(SimpleNamespace(_state_holder=SimpleNamespace(_backend=guard))):
        assert read(b"planted")[:3] == (2, False, set())
        assert read(state(2, False, b))[:3] == (2, False, {b})
        assert read(state(2, True, a, b))[:3] == (2, True, {a, b})
        assert read(state(2, False, b))[:3] == (2, True, {a, b})
        back = load_rendezvous_state(unseal(key, b"r", inner.value))
        assert (back.round, back.complete) == (2, True)
        assert read(b"planted")[:3] == (2, True, {a, b})


def _join(handler: Any, results: dict[str, Any], name: str) -> threading.Thread:
    """``handler.next_rendezvous()`` on a thread, leaving its round as the agent does."""

    def run() -> None:
        try:
            with leaving_round(handler):
                results[name] = handler.next_rendezvous()
        except Exception as exc:  # reported by the test
            results[name] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _guarded_handler(port: int, rid: str, key: bytes, trust_s: float) -> Any:
    """A real c10d handler of a 2-node round over the TCPStore at ``port``, its state
    guarded with ``key``, trusted ``trust_s``, without keep-alive reads during a test."""
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    h = DynamicRendezvousHandler.from_backend(
        rid,
        client,
        C10dRendezvousBackend(client, rid),
        min_nodes=2,
        max_nodes=2,
        timeout=RendezvousTimeout(join=timedelta(seconds=20)),
        keep_alive_interval=60,
    )
    assert guard_rendezvous_state(h, key)
    trust_rendezvous_state_for(h, trust_s)
    return h


def test_a_store_writer_during_a_restart_brings_back_no_round_that_ended() -> None:
    """Two real elastic handlers over a real TCPStore finish round 0; node 1 leaves it and
    waits for round 1; a store writer then erases the state, and node 0 leaves its round.
    Node 0's last state that passed is round 0 with both nodes: answered as it was, node 0
    would rewrite round 0 without itself and node 1 would finish round 0 again alone. Both
    nodes must meet in round 1, two of them."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    rid, key = "restart", b"k" * 32

    a, b = _guarded_handler(port, rid, key, 0.1), _guarded_handler(port, rid, key, 0.1)
    watcher = GuardedBackend(C10dRendezvousBackend(server, rid), _clean_state, b"", key, rid)
    results: dict[str, Any] = {}
    try:
        for t in [_join(a, results, "a0"), _join(b, results, "b0")]:
            t.join(30)
        assert [results[n].world_size for n in ("a0", "b0")] == [2, 2], results
        tb = _join(b, results, "b1")  # node 1 leaves round 0: it waits for the next
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = watcher.get_state()
            if got is not None and b._this_node in load_rendezvous_state(got[0]).wait_list:
                break
            time.sleep(0.05)
        else:
            pytest.fail("node 1 never waited for the next round")
        server.set(f"torch.rendezvous.{rid}", base64.b64encode(b"planted"))
        ta = _join(a, results, "a1")  # node 0 leaves round 0 from its last good state
        ta.join(40)
        tb.join(40)
        got = [results.get(n) for n in ("a1", "b1")]
        assert all(not isinstance(r, Exception) and r is not None for r in got), got
        assert sorted(r.rank for r in got) == [0, 1] and {r.world_size for r in got} == {2}
        final = watcher.get_state()
        assert final is not None
        state = load_rendezvous_state(final[0])
        assert state.round == 1 and state.complete and len(state.participants) == 2
    finally:
        for h in (a, b):
            h._stop_heartbeats()
        server = None


def test_a_node_waiting_for_group_rank_0_writes_back_the_round_a_stale_view_reopened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real elastic handler (node b) completes round 0 with node x (played by the test)
    and waits for x, group rank 0, to publish MASTER_ADDR. Meanwhile the state is replaced by
    x's stale view, round 0 open with x alone (what x writes back after a store writer erased
    the complete state it never read). elastic's blocking read would hold b, which alone
    knows the round completed, until its store timeout while x waits for b forever; b must
    write the complete round back while it waits, and go on once x publishes."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    from ftmem.launch.elastic_compat import awaiting_group_rank_0
    from ftmem.launch.state_guard import reread_state

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    rid, key = "reopened", b"k" * 32
    b = _guarded_handler(port, rid, key, 0.05)
    watcher = GuardedBackend(C10dRendezvousBackend(server, rid), _clean_state, b"", key, rid)

    def x_alone() -> bytes:
        s = _RendezvousState()
        x = _NodeDesc("", 1, 0)  # sorts before b: group rank 0
        s.participants, s.last_heartbeats = {x: 0}, {x: datetime.now(timezone.utc)}
        return pickle.dumps(s)

    def state_now() -> Any:
        got = watcher.get_state()
        return None if got is None else (load_rendezvous_state(got[0]), got[1])

    def wait_for(what: Any, why: str) -> Any:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = state_now()
            if got is not None and what(got[0]):
                return got
            time.sleep(0.02)
        pytest.fail(why)

    def complete(s: Any) -> bool:
        return bool(s.complete) and b._this_node in s.participants

    assert watcher.set_state(x_alone()) is not None
    results: dict[str, Any] = {}

    def join() -> None:
        try:
            with leaving_round(b), awaiting_group_rank_0(lambda: reread_state(b), 0.05):
                results["b"] = b.next_rendezvous()
        except Exception as exc:  # reported by the test
            results["b"] = exc

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    try:
        _, token = wait_for(complete, "b never completed round 0 with x")
        assert watcher.set_state(x_alone(), token) is not None  # x's stale view, written back
        wait_for(complete, "b never wrote the complete round back while it waited")
        prefixed = f"torch.rendezvous.{rid}.0/"
        server.set(prefixed + RendezvousStoreInfo.MASTER_ADDR_KEY, "x-host")
        server.set(prefixed + RendezvousStoreInfo.MASTER_PORT_KEY, "1234")
        thread.join(20)
        info = results.get("b")
        assert not isinstance(info, Exception) and info is not None, info
        assert (info.rank, info.world_size) == (1, 2)
        assert info.bootstrap_store_info.master_addr == "x-host"
    finally:
        b._stop_heartbeats()
        thread.join(5)
