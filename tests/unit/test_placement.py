"""Placement: groups, the rotated stripe layout, parity overhead and rebuild plans (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftmem.exchange.placement import (
    ALIGN,
    GroupPlan,
    StripePlan,
    UnrecoverableError,
    chunk_bytes_for,
    group_of,
    parity_bytes_per_node,
    plan_group,
    plan_groups,
    rebuild_plan,
    stripe_map,
)
from ftmem.protocol.peer import FragmentKind

C = ALIGN  # one aligned chunk; stripe_bytes = k * C gives chunk_bytes = C


def layout(stripes: list[StripePlan]) -> list[tuple[list[tuple[int, int]], tuple[int, ...]]]:
    """Stripes as ([(node, chunk number)], holders), for comparing with the docstring examples."""
    return [([(c.node, c.offset // C) for c in s.columns], s.holders) for s in stripes]


def check_coverage(sizes: dict[int, int], stripes: list[StripePlan]) -> None:
    """Every byte of every node is data exactly once, in order, and columns fit their chunk."""
    seen: dict[int, int] = dict.fromkeys(sizes, 0)
    for s in stripes:
        assert any(c.length for c in s.columns), "all-padding stripe kept"
        assert {c.node for c in s.columns}.isdisjoint(s.holders)
        for c in s.columns:
            assert 0 <= c.length <= s.chunk_bytes
            if c.length:
                assert c.offset == seen[c.node]
                seen[c.node] += c.length
    assert seen == sizes


def test_worked_example_n3_m1() -> None:
    g = plan_group([0, 1, 2], m=1)
    stripes = stripe_map(g, dict.fromkeys(g.nodes, 4 * C), 2 * C)
    assert layout(stripes) == [
        ([(0, 0), (1, 0)], (2,)),
        ([(1, 1), (2, 0)], (0,)),
        ([(2, 1), (0, 1)], (1,)),
        ([(0, 2), (1, 2)], (2,)),
        ([(1, 3), (2, 2)], (0,)),
        ([(2, 3), (0, 3)], (1,)),
    ]
    assert parity_bytes_per_node(g, stripes) == dict.fromkeys(g.nodes, 2 * C)


def test_worked_example_n4_m2() -> None:
    g = plan_group([0, 1, 2, 3], m=2)
    stripes = stripe_map(g, dict.fromkeys(g.nodes, 2 * C), 2 * C)
    assert layout(stripes) == [
        ([(0, 0), (1, 0)], (2, 3)),
        ([(1, 1), (2, 0)], (3, 0)),
        ([(2, 1), (3, 0)], (0, 1)),
        ([(3, 1), (0, 1)], (1, 2)),
    ]
    assert parity_bytes_per_node(g, stripes, header_bytes=80) == dict.fromkeys(g.nodes, 2 * C + 160)


@pytest.mark.parametrize(
    ("num", "m", "cap", "sizes"),
    [
        (3, 1, 8, [3]),
        (8, 2, 8, [8]),
        (10, 1, 8, [5, 5]),
        (17, 2, 8, [6, 6, 5]),
        (9, 3, 8, [9]),  # 5 + 4 would leave a group below m + 2: the cap gives way
        (16, 1, 4, [4, 4, 4, 4]),
    ],
)
def test_plan_groups(num: int, m: int, cap: int, sizes: list[int]) -> None:
    groups = plan_groups(num, m, cap)
    assert [g.n for g in groups] == sizes
    assert [n for g in groups for n in g.nodes] == list(range(num))
    assert all(g.m == m and g.k >= 2 for g in groups)
    assert group_of(groups, num - 1) is groups[-1]
    with pytest.raises(ValueError, match="no group"):
        group_of(groups, num)


@pytest.mark.parametrize(
    ("num", "m", "cap"), [(2, 1, 8), (1, 1, 8), (5, 0, 8), (5, 2, 3), (3, 2, 8)]
)
def test_plan_groups_rejects(num: int, m: int, cap: int) -> None:
    with pytest.raises(ValueError):
        plan_groups(num, m, cap)


def test_group_plan_validation() -> None:
    with pytest.raises(ValueError, match="distinct"):
        GroupPlan(nodes=(0, 0, 1), m=1)
    with pytest.raises(ValueError, match="at least 4"):
        plan_group([0, 1, 2], m=2)
    g = plan_group([0, 1, 2], m=1)
    with pytest.raises(ValueError, match="not in group"):
        stripe_map(g, {7: 10}, 2 * C)
    with pytest.raises(ValueError, match="negative"):
        stripe_map(g, {0: -1}, 2 * C)
    with pytest.raises(ValueError, match="not in group"):
        rebuild_plan(g, [], {5})


def test_chunk_bytes_for() -> None:
    assert chunk_bytes_for(2, 1 << 20) == 1 << 19
    assert chunk_bytes_for(3, 1 << 20) % ALIGN == 0
    assert chunk_bytes_for(3, 1 << 20) * 3 >= 1 << 20
    assert chunk_bytes_for(4, 1) == ALIGN


@pytest.mark.parametrize(("n", "m"), [(3, 1), (4, 1), (4, 2), (5, 2), (6, 3), (8, 2), (8, 6)])
@pytest.mark.parametrize("chunks", [1, 7, 60])
def test_rotation_balance_and_overhead(n: int, m: int, chunks: int) -> None:
    g = plan_group(list(range(n)), m)
    size = chunks * C - 5  # a short last chunk
    sizes = dict.fromkeys(g.nodes, size)
    stripes = stripe_map(g, sizes, g.k * C)
    check_coverage(sizes, stripes)
    held = parity_bytes_per_node(g, stripes)
    assert max(held.values()) - min(held.values()) <= m * C
    for node, nbytes in held.items():
        # m/(n-m) of the node's own bytes, within m + 1 chunks of rounding
        assert abs(nbytes - size * m / g.k) <= (m + 1) * C, (node, nbytes)
    # Every stripe has k columns and m holders, all distinct.
    for s in stripes:
        assert len({*(c.node for c in s.columns), *s.holders}) == n
        assert s.encoder == s.holders[0]


def test_unequal_sizes_are_padded_per_stripe() -> None:
    g = plan_group([0, 1, 2, 3], m=1)
    sizes = {0: 5 * C + 3, 1: 0, 2: C, 3: 2 * C - 1}
    stripes = stripe_map(g, sizes, 3 * C)
    check_coverage(sizes, stripes)
    real = {
        node: [c.length for s in stripes for c in s.columns if c.node == node and c.length]
        for node in sizes
    }
    assert real == {0: [C] * 5 + [3], 1: [], 2: [C], 3: [C, C - 1]}
    # Stripe 5 (node 0 holds its parity, every other node is used up) is all padding: skipped.
    assert [s.index for s in stripes] == [0, 1, 2, 3, 4, 6, 7]
    assert stripes[-1].lengths == (0, 3, 0)
    held = parity_bytes_per_node(g, stripes)
    assert sum(held.values()) == len(stripes) * C


def fragment_node(s: StripePlan, fragment: int) -> int:
    """The node that owns ``fragment`` of ``s`` (column node or parity holder)."""
    return s.columns[fragment].node if fragment < s.k else s.holders[fragment - s.k]


def check_rebuild(g: GroupPlan, stripes: list[StripePlan], lost: set[int]) -> None:
    plan = rebuild_plan(g, stripes, lost)
    assert [nr.node for nr in plan.nodes] == sorted(lost)
    for node in lost:
        nr = plan.for_node(node)
        expected = {
            (s.index, f)
            for s in stripes
            for f in range(s.k + len(s.holders))
            if fragment_node(s, f) == node and (f >= s.k or s.columns[f].length)
        }
        got = {(sr.stripe.index, f) for sr in nr.stripes for f in sr.rebuild}
        assert got == expected
        for sr in nr.stripes:
            s = sr.stripe
            used = [f.fragment for f in sr.fetch] + list(sr.zeros)
            assert len(set(used)) == len(used) >= s.k
            assert len(sr.fetch) + min(len(sr.zeros), s.k) >= s.k
            assert not set(sr.rebuild) & {f.fragment for f in sr.fetch}
            for f in sr.fetch:
                assert f.node not in lost and f.node == fragment_node(s, f.fragment)
                if f.kind is FragmentKind.DATA:
                    col = s.columns[f.fragment]
                    assert (f.offset, f.length) == (col.offset, col.length) and col.length
                else:
                    assert f.fragment >= s.k and f.length == s.chunk_bytes
            assert all(s.columns[z].length == 0 for z in sr.zeros)


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_every_loss_up_to_m_is_rebuildable(n: int) -> None:
    for m in range(1, n - 1):
        g = plan_group(list(range(10, 10 + n)), m)
        for sizes in (
            dict.fromkeys(g.nodes, 9 * C),
            {node: (i * 3 + 1) * C + i for i, node in enumerate(g.nodes)},
            {**dict.fromkeys(g.nodes, 0), g.nodes[-1]: 11 * C},
        ):
            stripes = stripe_map(g, sizes, g.k * C)
            check_coverage(sizes, stripes)
            for r in range(m + 1):
                for lost in itertools.combinations(g.nodes, r):
                    check_rebuild(g, stripes, set(lost))


def test_more_than_m_lost_raises_naming_nodes() -> None:
    g = plan_group([0, 1, 2, 3], m=2)
    stripes = stripe_map(g, dict.fromkeys(g.nodes, 4 * C), 2 * C)
    with pytest.raises(UnrecoverableError, match=r"\[0, 2, 3\].*m=2"):
        rebuild_plan(g, stripes, {3, 0, 2})
    assert rebuild_plan(g, stripes, set()).nodes == ()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(3, 7),
    data=st.data(),
)
def test_random_sizes_cover_and_rebuild(n: int, data: st.DataObject) -> None:
    m = data.draw(st.integers(1, n - 2))
    g = plan_group(list(range(n)), m)
    sizes = {node: data.draw(st.integers(0, 12 * C)) for node in g.nodes}
    stripes = stripe_map(g, sizes, data.draw(st.integers(1, 4 * C)))
    check_coverage(sizes, stripes)
    lost = data.draw(st.sets(st.sampled_from(g.nodes), max_size=m))
    check_rebuild(g, stripes, lost)
