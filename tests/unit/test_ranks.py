"""Stable global ranks and generations (ftmem.launch.ranks, pure)."""

from __future__ import annotations

import pytest

from ftmem.launch.ranks import RankPlace, assign_slots, next_generation, slot_ranks


def test_assign_slots_keeps_survivors_and_fills_gaps() -> None:
    assert assign_slots([None, None, None]) == [0, 1, 2]
    # node c (was slot 2) now sorts before the replacement: it keeps slot 2
    assert assign_slots([0, 2, None]) == [0, 2, 1]
    # the slot-0 node was replaced: the newcomer takes slot 0
    assert assign_slots([1, 2, None]) == [1, 2, 0]
    # shrink: a slot beyond the node count is re-assigned; duplicates go to the lower rank
    assert assign_slots([2, 1]) == [0, 1]
    assert assign_slots([1, 1]) == [1, 0]
    assert assign_slots([]) == []


def test_the_most_recent_holder_of_a_slot_keeps_it() -> None:
    # node 0 held slot 1 until generation 3 and was cut off; node 2 (a spare) took slot 1
    # over in generation 5: node 0 is fenced to the free slot 2
    assert assign_slots([1, 0, 1], [3, 5, 5]) == [2, 0, 1]
    # equal generations: the lower group rank wins, as without generations
    assert assign_slots([1, 1], [4, 4]) == [1, 0]


@pytest.mark.parametrize("n", range(1, 7))
def test_assign_slots_is_a_permutation_for_any_history(n: int) -> None:
    import itertools

    choices = [None, *range(n + 1)]
    for prev in itertools.product(choices, repeat=n):
        slots = assign_slots(list(prev))
        assert sorted(slots) == list(range(n))
        for i, p in enumerate(prev):  # the first claimant of a valid slot keeps it
            if p is not None and p < n and p not in prev[:i]:
                assert slots[i] == p


def test_slot_ranks_are_the_slots_block() -> None:
    assert slot_ranks(1, 2, 3) == [RankPlace(0, 2, 6), RankPlace(1, 3, 6)]
    assert slot_ranks(0, 1, 1) == [RankPlace(0, 0, 1)]
    for bad in ((3, 2, 3), (-1, 2, 3), (0, 0, 3), (0, 2, 0)):
        with pytest.raises(ValueError):
            slot_ranks(*bad)


def test_generation_follows_the_rendezvous_round_else_counts() -> None:
    assert next_generation(4, previous=1) == 4  # a late joiner takes the round's number
    assert next_generation(None, previous=-1) == 0
    assert next_generation(None, previous=3) == 4
    assert next_generation(0, previous=0) == 1  # a round number that came back
