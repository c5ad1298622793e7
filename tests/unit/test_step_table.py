"""The bounds of :class:`ftmem.exchange.steps.StepTable` on what peers' messages make a node keep."""

from __future__ import annotations

import pytest

from ftmem.errors import ProtocolError
from ftmem.exchange.segments import SegmentedBytes
from ftmem.exchange.steps import StepTable


def _table(bound: int) -> tuple[StepTable, list[int]]:
    table = StepTable(0, bound, lambda chunk: 0)
    forgotten: list[int] = []
    forget = table.forget

    def record(step: int) -> None:
        forgotten.append(step)
        forget(step)

    table.forget = record  # type: ignore[method-assign]
    return table, forgotten


def test_a_step_this_node_protects_pushes_out_what_peers_sent_for_steps_it_does_not_hold() -> None:
    table, forgotten = _table(100)
    junk = table.get(500)
    table.keep_unplanned(junk, 100)  # the bound is full of a step nobody protects
    real = table.get(1)
    real.data = SegmentedBytes.of(b"x")
    table.keep_unplanned(real, 40)
    assert forgotten == [500] and table.unplanned == 40 and real.unplanned == 40


def test_a_step_with_data_is_never_pushed_out_and_past_the_bound_the_piece_is_refused() -> None:
    table, forgotten = _table(100)
    mine = table.get(1)
    mine.data = SegmentedBytes.of(b"x")
    table.keep_unplanned(mine, 90)
    other = table.get(2)
    with pytest.raises(ProtocolError, match="more than 100 bytes"):
        table.keep_unplanned(other, 20)
    assert forgotten == [] and table.unplanned == 90
