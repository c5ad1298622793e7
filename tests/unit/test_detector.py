"""The failure detector's pure parts: who watches whom, the heartbeat's wire form, the verdicts."""

from __future__ import annotations

import json

import pytest

from ftmem.launch.detector import (
    MAX_DATAGRAM,
    Heartbeat,
    WatchedRound,
    WatchEntry,
    neighbours,
    read_watch_entry,
    verdicts,
    watch_entry,
)

KEY = b"k" * 32
NODES = ["a", "b", "c", "d"]


def test_small_rings_watch_everyone_and_large_ones_a_bounded_neighbourhood() -> None:
    assert sorted(neighbours(NODES, "a")) == ["b", "c", "d"]
    assert neighbours(["a", "b"], "b") == ["a"]
    assert neighbours(["a"], "a") == []
    assert neighbours(NODES, "z") == []
    ring = [f"n{i}" for i in range(1000)]
    assert sorted(neighbours(ring, "n0")) == ["n1", "n2", "n998", "n999"]
    # Everyone is watched by exactly as many nodes as it watches: the fan-out is flat.
    watchers = {n: 0 for n in ring}
    for n in ring:
        for p in neighbours(ring, n):
            watchers[p] += 1
    assert set(watchers.values()) == {4}


def test_a_heartbeat_round_trips_and_anything_else_is_refused() -> None:
    beat = Heartbeat("run", "a", 7, 3, suspects=("b",), lost=("c",), leaving=False)
    data = beat.encode(KEY)
    assert Heartbeat.decode(KEY, data) == beat
    with pytest.raises(ValueError, match="tag is wrong"):
        Heartbeat.decode(b"x" * 32, data)
    with pytest.raises(ValueError, match="tag is wrong"):
        Heartbeat.decode(KEY, data[:-1] + b" ")
    with pytest.raises(ValueError, match="datagram of"):
        Heartbeat.decode(KEY, b"\0" * (MAX_DATAGRAM + 1))
    with pytest.raises(ValueError, match="datagram of"):
        Heartbeat.decode(KEY, b"")

    def signed(doc: object) -> bytes:
        import hashlib
        import hmac

        body = json.dumps(doc).encode()
        return hmac.new(KEY, body, hashlib.sha256).digest() + body

    good = {
        "v": 2,
        "run": "r",
        "sender": "a",
        "seq": 1,
        "generation": 0,
        "suspects": [],
        "lost": [],
    }
    assert Heartbeat.decode(KEY, signed({**good, "leaving": True})).leaving
    for bad in (
        [1, 2],
        {**good, "v": 1, "leaving": False},
        {k: v for k, v in good.items() if k != "v"},
        {**good, "from": "a", "leaving": False},
        {**good, "sender": "a\nb", "leaving": False},
        {**good, "generation": 1.5, "leaving": False},
        {**good, "seq": -1, "leaving": False},
        {**good, "seq": True, "leaving": False},
        {**good, "suspects": ["x"] * 50, "leaving": False},
        {**good, "lost": [7], "leaving": False},
        {**good, "sender": "", "leaving": False},
        {**good, "leaving": "yes"},
    ):
        with pytest.raises(ValueError):
            Heartbeat.decode(KEY, signed(bad))


def test_a_store_entry_is_checked_before_it_is_believed() -> None:
    raw = watch_entry(KEY, 4, 2, "h2_77_0", ("10.0.0.2", 4000)).encode()
    assert read_watch_entry(KEY, raw, 4, 2) == WatchEntry(4, 2, "h2_77_0", ("10.0.0.2", 4000))
    with pytest.raises(ValueError, match="authentication"):
        read_watch_entry(b"y" * 32, raw, 4, 2)
    with pytest.raises(ValueError, match="not generation 5"):
        read_watch_entry(KEY, raw, 5, 2)
    with pytest.raises(ValueError, match="not generation 4"):
        read_watch_entry(KEY, raw, 4, 1)
    with pytest.raises(ValueError, match="malformed"):
        read_watch_entry(KEY, b"{", 4, 2)
    doc = json.loads(raw)
    doc["entry"] = doc["entry"].replace("4000", "4001")
    with pytest.raises(ValueError, match="authentication"):
        read_watch_entry(KEY, json.dumps(doc).encode(), 4, 2)


def rnd(me: str = "a", order: list[str] | None = None) -> WatchedRound:
    return WatchedRound(generation=1, me=me, order=order or NODES, addrs={}, since=0.0)


def test_silence_alone_is_suspicion_not_a_verdict() -> None:
    heard = {"b": 9.5, "c": 9.5, "d": 8.0}
    suspected, declare = verdicts(rnd(), 10.0, 1.0, heard, {}, set())
    assert suspected == {"d"} and declare == {}


def test_a_second_observer_that_agrees_makes_it_a_verdict() -> None:
    heard = {"b": 9.9, "c": 9.9, "d": 8.0}
    reports = {"b": (frozenset({"d"}), frozenset())}
    suspected, declare = verdicts(rnd(), 10.0, 1.0, heard, reports, set())
    assert suspected == {"d"}
    assert list(declare) == ["d"] and "suspected by b too" in declare["d"]


def test_the_agreement_of_a_peer_this_node_no_longer_hears_does_not_count() -> None:
    heard = {"b": 8.5, "c": 9.9, "d": 8.0}  # b is silent too: its old report is stale
    reports = {"b": (frozenset({"d"}), frozenset())}
    suspected, declare = verdicts(rnd(), 10.0, 1.0, heard, reports, set())
    assert suspected == {"b", "d"} and declare == {}


def test_a_node_cut_off_from_everyone_declares_nobody() -> None:
    suspected, declare = verdicts(rnd(), 10.0, 1.0, {"b": 8, "c": 8, "d": 8}, {}, set())
    assert suspected == {"b", "c", "d"} and declare == {}


def test_a_two_node_job_has_one_observer_whose_silence_is_enough() -> None:
    _, declare = verdicts(rnd(order=["a", "b"]), 10.0, 1.0, {"b": 8.0}, {}, set())
    assert list(declare) == ["b"] and "only observer" in declare["b"]


def test_a_verdict_heard_from_a_live_peer_is_acted_on() -> None:
    heard = {"b": 9.9, "c": 9.9, "d": 9.9}
    reports = {"c": (frozenset(), frozenset({"d"}))}
    _, declare = verdicts(rnd(), 10.0, 1.0, heard, reports, set())
    assert declare == {"d": "declared lost by c"}


def test_a_round_gives_every_peer_the_whole_bound_and_departed_peers_are_not_watched() -> None:
    r = rnd()
    r.since = 9.5  # the round began 0.5 s ago: older silence does not count
    assert verdicts(r, 10.0, 1.0, {"b": 1.0}, {}, set())[0] == set()
    assert verdicts(rnd(), 10.0, 1.0, {"b": 9.9, "c": 9.9}, {}, {"d"})[0] == set()


def test_a_peer_already_declared_is_not_declared_twice() -> None:
    r = rnd()
    r.declared.add("d")
    heard = {"b": 9.9, "c": 9.9, "d": 8.0}
    reports = {"b": (frozenset({"d"}), frozenset({"d"}))}
    assert verdicts(r, 10.0, 1.0, heard, reports, set())[1] == {}
