"""A change of the job's size, in pure parts: which old slots were lost and who hosts their
guests (``plan_reshape``), the launcher's request to the ranks (``$FTMEM_RESHARD``), and the
sampler whose position survives the change."""

from __future__ import annotations

import pytest

from ftmem.client.sampler import ElasticSampler
from ftmem.errors import ProtocolError
from ftmem.launch.rendezvous import SlotOffer
from ftmem.launch.reshape import plan_reshape
from ftmem.protocol.rejoin import ReshardRequest, requested


def offer(slot: int | None, nodes: int | None = 4, size: int = 2) -> SlotOffer:
    return SlotOffer(slot, size, 5, nodes if slot is not None else None)


def test_a_lost_slot_is_found_and_hosted_by_a_survivor() -> None:
    rs = plan_reshape([offer(0), offer(1), offer(3)])
    assert rs is not None
    assert (rs.old_nodes, rs.new_nodes, rs.lost, rs.old_world) == (4, 3, (2,), 8)
    assert rs.guests == {2: 0} and rs.survivors == [0, 1, 2]
    assert rs.old_ranks(2) == [4, 5]


def test_two_lost_slots_are_hosted_round_robin() -> None:
    rs = plan_reshape([offer(3, 5), offer(0, 5), offer(4, 5)])
    assert rs is not None and rs.lost == (1, 2) and rs.guests == {1: 0, 2: 1}


def test_a_new_node_grows_the_job_without_a_rebuild() -> None:
    rs = plan_reshape([offer(0, 3), offer(1, 3), offer(2, 3), offer(None)])
    assert rs is not None and (rs.old_nodes, rs.new_nodes, rs.lost) == (3, 4, ())


@pytest.mark.parametrize(
    "offers",
    [
        [offer(0), offer(1), offer(None), offer(3)],  # a spare took a lost slot: same size
        [offer(None, None), offer(None, None)],  # the first round
        [offer(0, 4, size=2), offer(1, 4, size=1), offer(2, 4, size=2)],  # nodes differ
        [offer(0, 4), offer(1, 3), offer(2, 4)],  # survivors of different rounds
    ],
)
def test_no_reshape_when_the_size_did_not_change_or_cannot_be_told(
    offers: list[SlotOffer],
) -> None:
    assert plan_reshape(offers) is None


def test_the_request_goes_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    req = ReshardRequest(8, 12)
    monkeypatch.setenv("FTMEM_RESHARD", req.to_env())
    assert requested() == req
    monkeypatch.setenv("FTMEM_RESHARD", "")
    assert requested() is None


@pytest.mark.parametrize(
    "raw", ["{", "[]", '{"world_size": 0}', '{"world_size": 4, "step": -1}', '{"step": 3}',
            '{"world_size": 4, "run_dirs": "/tmp"}'],
)  # fmt: skip
def test_a_malformed_request_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("FTMEM_RESHARD", raw)
    with pytest.raises(ProtocolError, match="FTMEM_RESHARD is malformed"):
        requested()


def _draw(samplers: list[ElasticSampler], steps: int, batch: int) -> list[int]:
    """Each rank draws ``batch`` samples per step, in lockstep, for ``steps`` steps."""
    its = [iter(s) for s in samplers]
    out: list[int] = []
    for _ in range(steps):
        for it in its:
            out += [next(it) for _ in range(batch)]
    return out


def test_the_sampler_goes_on_at_another_world_size_with_every_sample_once() -> None:
    four = [ElasticSampler(48, seed=3, rank=r, world_size=4) for r in range(4)]
    seen = _draw(four, 3, 2)  # 24 samples
    state = four[0].state_dict()
    assert all(s.state_dict() == state for s in four) and state["consumed"] == 24
    three = [ElasticSampler(48, seed=3, rank=r, world_size=3) for r in range(3)]
    for s in three:
        s.load_state_dict(state)
    seen += _draw(three, 4, 2)  # the other 24
    assert sorted(seen) == list(range(48))
    with pytest.raises(ValueError, match="dataset of 48 samples"):
        ElasticSampler(50, seed=3).load_state_dict(state)
