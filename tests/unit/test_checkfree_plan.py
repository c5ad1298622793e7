"""CheckFree's pure planning: which neighbours rebuild which lost stage, and when it refuses."""

from __future__ import annotations

import pytest

from ftmem.client.checkfree import plan_rebuild
from ftmem.errors import InconsistentSnapshotError


def _stages(order: list[int]) -> list[tuple[int, int]]:
    return [(s, len(order)) for s in order]


def test_a_middle_stage_is_rebuilt_from_the_ranks_of_its_neighbours() -> None:
    assert plan_rebuild(_stages([0, 1, 2, 3]), [2]) == {2: (1, 3)}
    # stages need not sit on ranks in order
    assert plan_rebuild(_stages([3, 0, 2, 1]), [2]) == {2: (3, 0)}
    assert plan_rebuild(_stages([0, 1, 2, 3, 4]), [1, 3]) == {1: (0, 2), 3: (2, 4)}


@pytest.mark.parametrize(
    ("stages", "lost", "why"),
    [
        (_stages([0, 1, 2, 3]), [0], "the first and the last stage"),
        (_stages([0, 1, 2, 3]), [3], "the first and the last stage"),
        (_stages([0, 1, 2, 3]), [1, 2], "a neighbouring stage is lost too"),
        ([(0, 4), (1, 4), (2, 4), (-1, -1)], [2], "CheckFreeStage in every rank"),
        ([(0, 4), (1, 4), (1, 4), (3, 4)], [2], "one stage per rank"),
        ([(0, 4), (1, 4), (2, 3), (3, 4)], [2], "the same stage count"),
    ],
)
def test_what_cannot_be_rebuilt_is_refused(
    stages: list[tuple[int, int]], lost: list[int], why: str
) -> None:
    with pytest.raises(InconsistentSnapshotError, match=why):
        plan_rebuild(stages, lost)
