"""The peer (SMP <-> SMP) messages: every kind round-trips through its header, and every
malformed field (missing, of the wrong type, a bool, Infinity, NaN, a huge or negative int, a
list too long) is refused with ProtocolError and nothing else. Also the protection service's state
machine and the typed status replies the launcher reads."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmem.errors import ProtocolError
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import FragmentKind, PeerMessage
from ftmem.protocol.status import (
    IllegalTransition,
    PeerHealth,
    ProtectionState,
    ProtectionStatus,
    RebuildProgress,
    RoundCounters,
    SyncReply,
)

SAMPLES: list[pm.PeerBody] = [
    pm.Size(3, 1 << 30),
    pm.Data(3, 17, 1),
    pm.Parity(3, 17, 2, (0, 12345, (1 << 64) - 1)),
    pm.Held(0),
    pm.Abort(9),
    pm.MetaRequest(4),
    pm.MetaReply(4, {0: 10, 1: 0, 2: 1 << 40}),
    pm.MetaReply(4, {}),
    pm.FetchRequest(4, 2, 1, FragmentKind.DATA, 1 << 20, 4096),
    pm.FetchRequest(4, 2, 3, FragmentKind.PARITY, 0, 4096),
    pm.FetchReply(4, 2, 1),
    pm.FetchReply(4, 2, 3, (5, 6, 7)),
    pm.HeldSteps((1, 2)),
    pm.HeldSteps(()),
    pm.Avail((8, 7, 6)),
    pm.ProtectOrder(8),
    pm.Heartbeat(),
]

# Values no integer field accepts.
NOT_INTS: list[Any] = [
    True,
    False,
    None,
    1.0,
    float("inf"),
    float("-inf"),
    float("nan"),
    "1",
    [1],
    {"a": 1},
    -1,
    1 << 63,
    10**5000,
]


def _fields(body: pm.PeerBody) -> list[str]:
    return [k for k in body.to_header(0) if k not in ("t", "e")]


def _buffers(body: pm.PeerBody) -> list[memoryview]:
    return [memoryview(b"x")] * body.BUFFERS[0]


def test_every_kind_has_a_sample() -> None:
    assert {type(b) for b in SAMPLES} == set(pm.BODY_TYPES.values())
    assert set(pm.BODY_TYPES) == set(pm.PeerKind)


@pytest.mark.parametrize("body", SAMPLES, ids=repr)
def test_round_trip_through_json(body: pm.PeerBody) -> None:
    header = json.loads(json.dumps(body.to_header(7), allow_nan=False))
    assert header["t"] == body.KIND.value and header["e"] == 7
    assert pm.parse_header(header) == (7, body)
    env = pm.Envelope.parse(PeerMessage("2", header, _buffers(body)))
    assert (env.sender, env.epoch, env.body, env.kind) == (2, 7, body, body.KIND)
    assert body.KIND.is_service == body.KIND.value.startswith("x:")


@pytest.mark.parametrize("body", SAMPLES, ids=repr)
def test_a_missing_field_is_refused(body: pm.PeerBody) -> None:
    header = body.to_header(0)
    for name in [*_fields(body), "t", "e"]:
        if isinstance(body, pm.FetchReply) and name == "sums":
            continue  # optional
        if name in ("digest", "tag"):
            continue  # optional (a seal is checked where it is used: seals.py)
        broken = {k: v for k, v in header.items() if k != name}
        with pytest.raises(ProtocolError):
            pm.parse_header(broken)


@pytest.mark.parametrize("body", SAMPLES, ids=repr)
def test_a_field_of_the_wrong_type_or_range_is_refused(body: pm.PeerBody) -> None:
    header = body.to_header(0)
    for name in [*_fields(body), "e"]:
        for bad in NOT_INTS:
            if (name in ("held", "steps") and bad == [1]) or (name == "sizes" and bad == {}):
                continue  # a valid value of those fields
            with pytest.raises(ProtocolError):
                pm.parse_header({**header, name: bad})


@pytest.mark.parametrize("body", SAMPLES, ids=repr)
def test_an_unknown_field_is_refused(body: pm.PeerBody) -> None:
    with pytest.raises(ProtocolError, match="unknown fields"):
        pm.parse_header({**body.to_header(0), "bogus": 1})


@pytest.mark.parametrize(
    "header",
    [
        None,
        [],
        "size",
        1,
        {},
        {"e": 0},
        {"t": "nope", "e": 0, "step": 1},
        {"t": ["size"], "e": 0, "step": 1, "nbytes": 1},
        {"t": "SIZE", "e": 0, "step": 1, "nbytes": 1},
        {"t": "size", "step": 1, "nbytes": 1},
        {"t": "size", "e": True, "step": 1, "nbytes": 1},
        {"t": "size", "e": 0, "step": 1, "nbytes": (1 << 44) + 1},
        {
            "t": "fetch",
            "e": 0,
            "step": 1,
            "stripe": 0,
            "frag": 0,
            "kind": "x",
            "offset": 0,
            "length": 1,
        },
        {
            "t": "fetch",
            "e": 0,
            "step": 1,
            "stripe": 0,
            "frag": 0,
            "kind": 1,
            "offset": 0,
            "length": 1,
        },
        {
            "t": "fetch",
            "e": 0,
            "step": 1,
            "stripe": 0,
            "frag": 0,
            "kind": "data",
            "offset": 1 << 50,
            "length": 1,
        },
    ],
)
def test_malformed_headers_are_refused(header: Any) -> None:
    with pytest.raises(ProtocolError):
        pm.parse_header(header)


@pytest.mark.parametrize(
    "sums",
    [
        [1, 2],  # ints, not decimal strings
        ["1", None],
        ["-1"],
        ["0x10"],
        [" 1"],
        ["1.5"],
        [""],
        ["\u0661\u0662"],  # non-ASCII digits
        [str(1 << 64)],
        ["9" * 21],
        ["9" * 5000],
        ["1"] * (pm.MAX_SUMS + 1),
        "123",
        {"0": "1"},
    ],
)
def test_bad_checksums_are_refused(sums: Any) -> None:
    for body in (pm.Parity(1, 0, 2, (1,)), pm.FetchReply(1, 0, 2, (1,))):
        with pytest.raises(ProtocolError):
            pm.parse_header({**body.to_header(0), "sums": sums})


@pytest.mark.parametrize(
    "sizes",
    [
        {"a": 1},
        {"-1": 1},
        {"1.0": 1},
        {"": 1},
        {"\u0661": 1},
        {"9" * 5000: 1},
        {str(pm.MAX_NODE + 1): 1},
        {"0": -1},
        {"0": True},
        {"0": float("inf")},
        {"0": float("nan")},
        {"0": "1"},
        {str(i): 1 for i in range(pm.MAX_NODES + 1)},
        [["0", 1]],
    ],
)
def test_bad_sizes_are_refused(sizes: Any) -> None:
    with pytest.raises(ProtocolError):
        pm.parse_header({**pm.MetaReply(1, {}).to_header(0), "sizes": sizes})


@pytest.mark.parametrize("body", [pm.HeldSteps((1,)), pm.Avail((1,))], ids=repr)
def test_step_lists_are_bounded_and_typed(body: pm.PeerBody) -> None:
    (name,) = _fields(body)
    header = body.to_header(0)
    assert pm.parse_header({**header, name: list(range(pm.MAX_STEPS))})[1] is not None
    for bad in ([0] * (pm.MAX_STEPS + 1), [1, None], [1, True], [1.0], [-1], [1 << 63], "12"):
        with pytest.raises(ProtocolError):
            pm.parse_header({**header, name: bad})


@pytest.mark.parametrize(
    "sender",
    ["", "x", "-1", "+1", " 1", "1.0", "\u0661", "1" * 10, str(pm.MAX_NODE + 1), "intruder"],
)
def test_a_sender_that_is_not_a_node_index_is_refused(sender: str) -> None:
    with pytest.raises(ProtocolError):
        pm.Envelope.parse(PeerMessage(sender, pm.Held(1).to_header(0), []))


@pytest.mark.parametrize("body", SAMPLES, ids=repr)
def test_the_buffer_count_is_checked(body: pm.PeerBody) -> None:
    lo, hi = body.BUFFERS
    header = body.to_header(0)
    for n in (lo - 1, hi + 1):
        if n < 0:
            continue
        with pytest.raises(ProtocolError, match="buffers"):
            pm.Envelope.parse(PeerMessage("1", header, [memoryview(b"x")] * n))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**4300)
    | st.floats()
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)
_KEYS = ["t", "e", "step", "nbytes", "stripe", "col", "frag", "sums", "sizes", "kind", "offset"]
_KEYS += ["length", "held", "steps"]


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(_KEYS),
        json_values | st.sampled_from([k.value for k in pm.PeerKind]),
        max_size=8,
    )
    | json_values,
    st.sampled_from(["0", "1", "x", "", "9" * 9]),
    st.integers(0, 3),
)
def test_anything_is_parsed_or_refused_with_protocol_error(
    header: Any, sender: str, nbufs: int
) -> None:
    try:
        env = pm.Envelope.parse(PeerMessage(sender, header, [memoryview(b"")] * nbufs))
    except ProtocolError:
        return
    # Whatever is accepted encodes back to the same message.
    assert pm.parse_header(env.body.to_header(env.epoch)) == (env.epoch, env.body)


# ------------------------------------------------------------------------ protection state


S = ProtectionState


def test_the_transitions_the_service_makes_are_allowed() -> None:
    for path in (
        [S.UNBOUND, S.BOUND, S.SYNCING, S.READY, S.BOUND, S.SYNCING, S.READY, S.SYNCING],
        [S.UNBOUND, S.BOUND, S.SYNCING, S.REBUILDING, S.READY],
        [S.UNBOUND, S.BOUND, S.SYNCING, S.REBUILDING, S.REBUILD_FAILED, S.BOUND],
        [S.UNBOUND, S.BOUND, S.SYNCING, S.SYNC_FAILED, S.SYNCING, S.UNRECOVERABLE, S.SYNCING],
        [S.UNBOUND, S.BOUND, S.BOUND, S.SYNCING, S.SYNCING, S.BOUND, S.READY],
    ):
        state = path[0]
        for new in path[1:]:
            state = state.to(new)
        assert state is path[-1]
    for state in S:
        assert state.can_become(S.FAILED) is (state is not S.FAILED)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (S.UNBOUND, S.SYNCING),
        (S.UNBOUND, S.READY),
        (S.READY, S.REBUILDING),
        (S.READY, S.READY),
        (S.REBUILDING, S.SYNCING),
        (S.REBUILDING, S.BOUND),
        (S.SYNC_FAILED, S.READY),
        (S.FAILED, S.BOUND),
        (S.FAILED, S.FAILED),
        (S.BOUND, S.UNBOUND),
    ],
)
def test_illegal_transitions_are_refused(old: ProtectionState, new: ProtectionState) -> None:
    assert not old.can_become(new)
    with pytest.raises(IllegalTransition, match=f"{old.value} -> {new.value}"):
        old.to(new)


def test_every_state_is_reachable_from_unbound() -> None:
    seen = {S.UNBOUND}
    while True:
        more = {new for old in seen for new in S if old.can_become(new)} - seen
        if not more:
            break
        seen |= more
    assert seen == set(S)


# ------------------------------------------------------------------------ typed replies


def _status(**kw: Any) -> dict[str, Any]:
    """An protection status as the SMP reports it (smp/protection.py)."""
    doc: dict[str, Any] = {
        "enabled": True,
        "state": "rebuilding",
        "endpoint": "tcp://127.0.0.1:5555",
        "epoch": 2,
        "me": 1,
        "group": [0, 1, 2],
        "m": 1,
        "error": "",
        "rebuilding": 7,
        "rebuild_progress": {"step": 7, "fragments": 3, "of": 10},
        "protecting": None,
        "protected_step": 6,
        "own_bytes": 100,
        "parity_bytes": 50,
        "peers": {"0": {"endpoint": "tcp://x:1", "last_seen_s": 0.5}},
        "counters": {"protected": 1, "aborted": 0, "failed": 0, "rebuilt": 0},
        "last_protect_s": 0.25,
        "last_rebuild_s": 0.0,
        "dropped_messages": 4,
        "sent_bytes": 10,
    }
    doc.update(kw)
    return doc


def test_exchange_status_parses_what_the_smp_reports() -> None:
    ex = ProtectionStatus.from_json(json.loads(json.dumps(_status())))
    assert ex.enabled and ex.state is ProtectionState.REBUILDING
    assert ex.rebuild_progress == RebuildProgress(7, 3, 10)
    assert (ex.epoch, ex.me, ex.group, ex.m) == (2, 1, (0, 1, 2), 1)
    assert (ex.protected_step, ex.protecting, ex.rebuilding) == (6, None, 7)
    assert ex.dropped_messages == 4 and ex.last_protect_s == 0.25
    assert (ex.own_bytes, ex.parity_bytes, ex.sent_bytes) == (100, 50, 10)
    assert ex.counters == RoundCounters(protected=1) and ex.endpoint == "tcp://127.0.0.1:5555"
    assert ex.peers == (PeerHealth(0, "tcp://x:1", 0.5),)
    never = _status(peers={"10": {"endpoint": "e", "last_seen_s": None}, "2": {"endpoint": "f"}})
    assert [(p.node, p.last_seen_s) for p in ProtectionStatus.from_json(never).peers] == [
        (2, None),
        (10, None),
    ]
    for state in ProtectionState:
        assert ProtectionStatus.from_json(_status(state=state.value)).state is state
    minimal = ProtectionStatus.from_json({"enabled": True, "state": "unbound"})
    assert minimal.state is ProtectionState.UNBOUND and minimal.rebuild_progress is None
    assert ProtectionStatus.from_json(_status(rebuild_progress={})).rebuild_progress is None


@pytest.mark.parametrize("doc", [None, {}, {"enabled": False}])
def test_exchange_status_when_off(doc: Any) -> None:
    ex = ProtectionStatus.from_json(doc)
    assert not ex.enabled and ex.state is None


@pytest.mark.parametrize(
    "doc",
    [
        [],
        "ready",
        {"enabled": "yes"},
        _status(state="REBUILDING"),
        _status(state=None),
        _status(state=3),
        _status(epoch=True),
        _status(epoch=1.5),
        _status(protected_step=float("nan")),
        _status(protected_step=10**5000),
        _status(group=[0, None]),
        _status(group="012"),
        _status(error=5),
        _status(last_protect_s=math.inf),
        _status(last_protect_s="1"),
        _status(dropped_messages=[]),
        _status(rebuild_progress=[1, 2]),
        _status(rebuild_progress={"step": 1, "fragments": "3", "of": 10}),
        _status(rebuild_progress={"step": 1, "fragments": 3, "of": float("inf")}),
        _status(counters=[1]),
        _status(counters={"protected": "1"}),
        _status(peers=[]),
        _status(peers={"x": {"endpoint": "e"}}),
        _status(peers={"\u00b2": {"endpoint": "e"}}),  # a digit to str.isdigit, not to int()
        _status(peers={"0": {"endpoint": 5}}),
        _status(peers={"0": {"endpoint": "e", "last_seen_s": "1"}}),
        _status(own_bytes=1.5),
    ],
)
def test_a_malformed_exchange_status_is_refused(doc: Any) -> None:
    with pytest.raises(ProtocolError):
        ProtectionStatus.from_json(doc)


def test_sync_reply_round_trip_and_refusals() -> None:
    doc: dict[str, Any] = {"step": 4, "lost": [2], "rebuilt": True}
    bads: list[Any] = [None, [], {**doc, "step": "4"}, {**doc, "step": True}, {**doc, "lost": 2}]
    bads += [{**doc, "lost": [None]}, {**doc, "rebuilt": 1}]
    assert SyncReply.from_json(doc) == SyncReply(4, (2,), True)
    assert SyncReply.from_json(doc).to_json() == doc
    assert SyncReply.from_json({"step": None, "lost": [], "rebuilt": False}).step is None
    for bad in bads:
        with pytest.raises(ProtocolError):
            SyncReply.from_json(bad)


# -- addresses, seals, store entries (who a peer is; what a rebuilt node checks) ---------------


def test_a_peer_address_carries_a_valid_curve_key() -> None:
    import zmq

    from ftmem.protocol.peer import PeerAddress, parse_endpoint

    public, _ = zmq.curve_keypair()
    good = f"tcp://127.0.0.1:5555 key={public.decode()}"
    assert parse_endpoint(good) == good and PeerAddress.parse(good).key == public
    for bad in (
        "tcp://127.0.0.1:5555",  # no key: the node could not be authenticated
        f"tcp://127.0.0.1:5555 key={public.decode()[:-1]}",
        "tcp://127.0.0.1:5555 key=" + "#" * 40,  # Z85 characters, but not 32 bytes
        f"tcp://127.0.0.1:0 key={public.decode()}",
        f"ipc:///tmp/x key={public.decode()}",
    ):
        with pytest.raises(ProtocolError):
            parse_endpoint(bad)


def test_seal_fields_are_hex_of_their_length_or_absent() -> None:
    ok = pm.Size(1, 10, "a" * 32, "b" * 64).to_header(0)
    assert pm.parse_header(ok)[1] == pm.Size(1, 10, "a" * 32, "b" * 64)
    assert pm.parse_header({"t": "size", "e": 0, "step": 1, "nbytes": 10})[1] == pm.Size(1, 10)
    for field, value in (("digest", "A" * 32), ("digest", "a" * 31), ("tag", 5), ("tag", "g" * 64)):
        with pytest.raises(ProtocolError):
            pm.parse_header({**ok, field: value})


def test_a_seal_binds_step_node_size_digest_and_manifest() -> None:
    from ftmem.exchange import keys, seals

    job = keys.generate()
    s = seals.seal(job, 2, 7, 100, "0" * 32, b"manifest")
    assert seals.check(job, 2, 7, 100, b"manifest", s)
    assert not seals.check(job, 1, 7, 100, b"manifest", s)  # another node's
    assert not seals.check(job, 2, 8, 100, b"manifest", s)
    assert not seals.check(job, 2, 7, 101, b"manifest", s)
    assert not seals.check(job, 2, 7, 100, b"manifesT", s)
    assert not seals.check(job, 2, 7, 100, b"manifest", seals.Seal("1" * 32, s.tag))
    assert not seals.check(keys.generate(), 2, 7, 100, b"manifest", s)  # another job's key
    assert not seals.check(job, 2, 7, 100, b"manifest", seals.Seal(s.digest, ""))


def test_store_entries_are_authenticated_and_bound_to_generation_and_node() -> None:
    import json

    import zmq

    from ftmem.errors import FtmemError
    from ftmem.exchange import keys
    from ftmem.launch.peers import peer_entry, read_peer_entry

    job = keys.generate()
    public, _ = zmq.curve_keypair()
    addr = f"tcp://10.0.0.1:4000 key={public.decode()}"
    entry = peer_entry(job, 3, 1, addr)
    assert read_peer_entry(job, entry.encode(), 3, 1) == addr
    forged = json.loads(entry)
    forged["address"] = f"tcp://10.6.6.6:4000 key={public.decode()}"
    for raw, generation, node, why in (
        (json.dumps(forged), 3, 1, "authentication"),
        (peer_entry(keys.generate(), 3, 1, addr), 3, 1, "authentication"),  # not the job's key
        (entry, 4, 1, "generation 3"),  # a replay of an older generation
        (entry, 3, 2, "node 1"),  # node 1's entry under node 2's name
        ("{", 3, 1, "malformed"),
        (json.dumps({"generation": 3}), 3, 1, "malformed"),
    ):
        with pytest.raises(FtmemError, match=why):
            read_peer_entry(job, raw.encode(), generation, node)


def test_an_entry_of_an_earlier_generation_is_read_again_until_this_ones_is_written() -> None:
    """Where a round's number came back, node 1's key still holds its entry of the round's
    first formation (generation 3) until node 1 writes this generation's (4): that one is
    read; an entry that stays refused raises its error after the wait."""
    import threading
    from datetime import timedelta

    import zmq
    from torch.distributed import TCPStore

    from ftmem.errors import FtmemError
    from ftmem.exchange import keys
    from ftmem.launch.peers import peer_entry, read_entries, read_peer_entry

    job = keys.generate()
    public, _ = zmq.curve_keypair()
    addr = f"tcp://10.0.0.1:4000 key={public.decode()}"
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    store.set("peer/0", peer_entry(job, 4, 0, addr))
    store.set("peer/1", peer_entry(job, 3, 1, addr))

    def read(i: int, raw: bytes) -> str:
        return read_peer_entry(job, raw, 4, i)

    late = threading.Timer(0.2, lambda: store.set("peer/1", peer_entry(job, 4, 1, addr)))
    late.start()
    try:
        assert read_entries(store, ["peer/0", "peer/1"], read, wait_s=10) == [addr, addr]
    finally:
        late.join()
    store.set("peer/1", peer_entry(keys.generate(), 4, 1, addr))  # a plant that stays
    with pytest.raises(FtmemError, match="authentication"):
        read_entries(store, ["peer/0", "peer/1"], read, wait_s=0.2)


def test_a_round_store_stops_waiting_for_a_node_that_left_the_round() -> None:
    """A RoundStore's blocking reads (get, multi_get, wait, and a clone's) ask ``abandoned``
    each second while a key is missing: a reason ends the wait with RoundAbandoned (the agent
    joins the next round); None waits on, up to the store's timeout; present keys are never
    asked about, and the rest of the store is the store's."""
    from datetime import timedelta

    from torch.distributed import DistStoreError, TCPStore

    from ftmem.errors import RoundAbandoned
    from ftmem.launch.elastic_compat import RoundStore
    from ftmem.launch.peers import read_entries

    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=2))
    asked: list[int] = []

    def left() -> str | None:
        asked.append(1)
        return "a node waits to join the next round" if len(asked) % 2 == 0 else None

    rs = RoundStore(store, left)
    rs.set("peer/0", b"zero")  # the store's own
    with pytest.raises(RoundAbandoned, match="next round: stopped waiting for"):
        read_entries(rs, ["peer/0", "peer/1"], lambda i, raw: raw)
    assert len(asked) == 2
    for read in (lambda: rs.get("peer/1"), lambda: rs.clone().wait(["peer/1"])):
        with pytest.raises(RoundAbandoned):
            read()
    assert len(asked) == 6
    with pytest.raises(DistStoreError):  # never abandoned: the store's timeout
        RoundStore(store, lambda: None).multi_get(["peer/0", "peer/1"])
    store.set("peer/1", b"one")
    assert read_entries(rs, ["peer/0", "peer/1"], lambda i, raw: raw) == [b"zero", b"one"]
    assert rs.get("peer/1") == b"one" and len(asked) == 6  # present: never asked


def test_key_pairs_carry_the_node_pair_and_whether_they_come_from_a_file() -> None:
    from ftmem.exchange import keys

    job, node = keys.generate(), keys.generate()
    back = keys.CurveKeyPair.from_json(job.with_node(node).to_json())
    assert back == job and back.node == node and not back.from_file
    with pytest.raises(keys.KeyFileError):
        keys.CurveKeyPair.from_json('{"public": "x", "secret": "y", "node": 5}')
    for bad in (
        '{"public": 5, "secret": "y"}',
        '{"public": "x", "secret": "' + "y" * 65 + '"}',
        '{"public": "x"}',
        '{"public": "x", "secret": "y", "from_file": "yes"}',
        "[1]",
        "{",
    ):
        with pytest.raises(keys.KeyFileError):
            keys.CurveKeyPair.from_json(bad)
