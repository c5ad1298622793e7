"""The bounds of :class:`ftmem.exchange.steps.StepTable` on what peers' messages make a node keep."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ftmem.errors import ProtocolError
from ftmem.exchange.segments import SegmentedBytes
from ftmem.exchange.steps import StepTable


def _table(bound: int) -> tuple[StepTable, list[int], Callable[[int], None]]:
    table = StepTable(0, bound, lambda chunk: 0)
    forgotten: list[int] = []

    def forget(step: int) -> None:
        forgotten.append(step)
        table.release(table.steps.pop(step))

    return table, forgotten, forget


def test_a_step_this_node_protects_pushes_out_what_peers_sent_for_steps_it_does_not_hold() -> None:
    table, forgotten, forget = _table(100)
    junk = table.get(500)
    table.keep_unplanned(junk, 100, lambda s: None)  # the bound is full of a step nobody protects
    real = table.get(1)
    real.data = SegmentedBytes.of(b"x")
    table.keep_unplanned(real, 40, forget)
    assert forgotten == [500] and table.unplanned == 40 and real.unplanned == 40


def test_a_step_with_data_is_never_pushed_out_and_past_the_bound_the_piece_is_refused() -> None:
    table, forgotten, forget = _table(100)
    mine = table.get(1)
    mine.data = SegmentedBytes.of(b"x")
    table.keep_unplanned(mine, 90, lambda s: None)
    other = table.get(2)
    with pytest.raises(ProtocolError, match="more than 100 bytes"):
        table.keep_unplanned(other, 20, forget)
    assert forgotten == [] and table.unplanned == 90
