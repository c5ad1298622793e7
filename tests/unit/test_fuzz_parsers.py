"""Hostile input to every parser that reads what another process wrote: snapshot layouts, commit
records, checkpoint manifests, peer protocol headers. Each must refuse with its own error (or
drop the message) and never raise anything else, never hang, never unpickle."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftmem.client.flatten import parse_layout
from ftmem.errors import CorruptSnapshotError, ProtocolError
from ftmem.exchange.placement import plan_group
from ftmem.exchange.protector import GroupProtector
from ftmem.exchange.segments import SegmentedBytes
from ftmem.exchange.transport import PeerTransport
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import FragmentKind, PeerMessage
from ftmem.smp import records
from ftmem.smp.protection_sync import decide
from ftmem.tiers import signing
from ftmem.tiers.checkpoints import MANIFEST, read_checkpoint
from tests._support.strategies import json_values

# Peer headers reach the protector as Python objects (no JSON text in between), so they may
# also hold what JSON text cannot carry back: ints of thousands of digits.
peer_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**4300)
    | st.floats()
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=30,
)


def _layout_like() -> st.SearchStrategy[Any]:
    tensor = st.fixed_dictionaries(
        {
            "i": st.integers(-2, 3),
            "name": st.text(max_size=8),
            "dtype": st.sampled_from(["float32", "int64", "bogus", 3]),
            "shape": st.lists(st.integers(-3, 1 << 40), max_size=3),
            "offset": st.integers(-5, 1 << 41),
            "nbytes": st.integers(-5, 1 << 41),
            "hash": st.text(max_size=16),
        }
    )
    return st.fixed_dictionaries(
        {
            "version": st.sampled_from([1, 2, "1"]),
            "step": st.integers(-1, 10) | st.text(max_size=3),
            "tensors": st.lists(tensor, max_size=4),
            "objects": st.fixed_dictionaries(
                {"offset": st.integers(-5, 1 << 41), "nbytes": st.integers(-5, 1 << 41)}
            )
            | json_values,
        }
    )


@settings(max_examples=300, deadline=None)
@given(st.one_of(_layout_like(), json_values).map(json.dumps) | st.text(max_size=200))
def test_layouts_are_parsed_or_refused(text: str) -> None:
    try:
        snap = parse_layout(text, capacity=1 << 30)
    except CorruptSnapshotError:
        return
    for t in snap.tensors:  # whatever is accepted lies inside the slot
        assert 0 <= t.offset and t.offset + t.nbytes <= 1 << 30


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400) | json_values.map(lambda v: json.dumps(v).encode()))
def test_commit_records_are_read_or_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "ftmem-x-n-r0-s0-g1.commit"
        p.write_bytes(data)
        try:
            records.read_record(p)
        except (ValueError, OSError):
            pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=300)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries(
        {
            "version": st.just(1),
            "step": st.integers(-1, 5),
            "world_size": st.integers(-1, 5),
            "files": st.dictionaries(
                st.sampled_from(["a.distcp", "../etc", "/abs", ".metadata", "x/y", ".."]),
                st.fixed_dictionaries({"bytes": st.integers(-1, 10), "xxh3": st.text(max_size=4)}),
                max_size=3,
            ),
        }
    ).map(lambda v: json.dumps(v).encode())
)
def test_manifests_are_read_or_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        ck = Path(d) / "step_0000000001"
        ck.mkdir()
        (ck / "a.distcp").write_bytes(b"0123456789")
        try:  # signed as ftmem signs, where it can be: the parser below the check runs
            doc = json.loads(data)
            if isinstance(doc, dict):
                data = json.dumps(signing.sign(doc, signing.tier_key(create=True))).encode()
        except ValueError:
            pass  # not JSON, or not signable (Infinity): refused unsigned
        (ck / MANIFEST).write_bytes(data)
        try:
            got = read_checkpoint(ck)
        except CorruptSnapshotError:
            return
        for name in got.files:  # accepted names stay inside the checkpoint directory
            assert "/" not in name and name != ".."


class _Recorder(PeerTransport):
    """An in-memory transport: the protector under test only talks through it."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def start(self) -> str:
        return "mem://"

    def connect(self, peers: dict[str, str]) -> None:
        pass

    def send(self, node: str, header: dict[str, Any], buffers: list[Any]) -> None:
        self.sent.append((node, header))

    def try_send(self, node: str, header: dict[str, Any], buffers: list[Any]) -> bool:
        self.sent.append((node, header))
        return True

    def recv(self, timeout_s: float) -> PeerMessage | None:
        return None

    def close(self) -> None:
        pass


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["0", "1", "2", "7", "x", ""]),
    st.dictionaries(
        st.sampled_from(
            [
                "t",
                "step",
                "e",
                "nbytes",
                "stripe",
                "col",
                "frag",
                "sums",
                "sizes",
                "kind",
                "offset",
                "length",
                "held",
                "protect",
            ]
        ),
        peer_values | st.sampled_from([k.value for k in pm.PeerKind]),
        max_size=8,
    ),
    st.lists(st.binary(max_size=64), max_size=2),
)
def test_peer_headers_never_crash_the_protector(
    sender: str, header: dict[str, Any], bufs: list[bytes]
) -> None:
    header.setdefault("e", 0)
    others: list[pm.Envelope] = []
    p = GroupProtector(0, plan_group([0, 1, 2], 1), _Recorder(), 1 << 16, on_other=others.append)
    p.handle(PeerMessage(sender, header, [memoryview(b) for b in bufs]))
    p.flush()


_GOOD_HEADERS = [
    b.to_header(0)
    for b in (
        pm.Size(1, 100),
        pm.Data(1, 0, 1),
        pm.Parity(1, 0, 2, (1, 2, 3)),
        pm.Held(1),
        pm.Abort(1),
        pm.MetaRequest(1),
        pm.MetaReply(1, {0: 100, 1: 100, 2: 100}),
        pm.FetchRequest(1, 0, 0, FragmentKind.DATA, 0, 50),
        pm.FetchRequest(1, 0, 2, FragmentKind.PARITY, 0, 50),
        pm.FetchReply(1, 0, 2, (1, 2, 3)),
        pm.HeldSteps((1,)),
        pm.Avail((1,)),
        pm.ProtectOrder(1),
        pm.Heartbeat(),
    )
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(["0", "1", "2"]),
    st.sampled_from(_GOOD_HEADERS),
    st.dictionaries(
        st.sampled_from(["t", "e", "step", "nbytes", "stripe", "col", "frag", "sums", "sizes"])
        | st.sampled_from(["kind", "offset", "length", "held", "steps"]),
        peer_values
        | st.sampled_from([-1, 1 << 63, 10**5000, float("inf"), float("-inf"), float("nan")])
        | st.sampled_from([True, [float("inf")], ["1" * 30], {"0": float("nan")}, {"x": 1}]),
        max_size=2,
    ),
    st.lists(st.binary(max_size=64), max_size=2),
    st.booleans(),
    st.booleans(),
)
def test_mutated_peer_messages_never_crash_the_protector(
    sender: str,
    good: dict[str, Any],
    changes: dict[str, Any],
    bufs: list[bytes],
    holding: bool,
    with_service: bool,
) -> None:
    """A well-formed message with a field or two replaced by hostile values (NaN, Infinity,
    huge ints, bools...) to a protector that holds the step or not: handled or dropped."""
    others: list[pm.Envelope] = []
    p = GroupProtector(
        0,
        plan_group([0, 1, 2], 1),
        _Recorder(),
        1 << 16,
        on_other=others.append if with_service else None,
    )
    if holding:  # this node's data of step 1 and its peers' sizes but one: deeper paths
        st = p.table.get(1)
        st.data, st.sizes, st.held_sent = SegmentedBytes([bytes(100)]), {0: 100, 1: 100}, True
    dropped = p.dropped
    p.handle(PeerMessage(sender, {**good, **changes}, [memoryview(b) for b in bufs]))
    p.flush()
    try:
        pm.Envelope.parse(PeerMessage(sender, {**good, **changes}, [memoryview(b) for b in bufs]))
    except Exception as exc:
        assert isinstance(exc, ProtocolError), exc
        assert p.dropped == dropped + 1, "a malformed message was not counted"


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 3), st.lists(st.integers(0, 6), max_size=4), min_size=4, max_size=4
    )
)
def test_sync_verdict_keeps_a_step_only_when_enough_nodes_hold_it(
    held: dict[int, list[int]],
) -> None:
    plan = plan_group([0, 1, 2, 3], 2)
    v = decide(plan, held)
    if v.step is None:
        assert not any(len([n for n in held if s in held[n]]) >= 2 for s in range(7))
    else:
        assert len(v.holders) >= 2 and v.lost == frozenset(plan.nodes) - v.holders
        assert all(v.step in held[n] for n in v.holders)
        newer = [s for s in range(v.step + 1, 7) if len([n for n in held if s in held[n]]) >= 2]
        assert not newer
