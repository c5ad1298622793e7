"""Pure placement for the erasure-coded peer exchange: groups, stripes, parity holders, rebuilds.

Nothing here does I/O; every plan is a frozen dataclass, so the whole layout is unit-tested
without sockets or pyeclib.

Groups. Nodes ``0..N-1`` are cut into ``ceil(N / max_group_size)`` groups of consecutive node
ranks whose sizes differ by at most one (N=10, cap 8 -> 5 + 5; never 8 + 2). A group needs at
least ``m + 2`` nodes (so ``k = n - m >= 2``: the ISA-L backend rejects ``k = 1``); when the
balanced split would make a group smaller than that, fewer and larger groups are made, so the
cap is exceeded only in that case (N=9, m=3, cap 8 -> one group of 9).

Stripes (systematic code, parity rotated as in RAID-6). Each node keeps its own snapshot in
full, cut into chunks of ``chunk_bytes`` (the last chunk short). A stripe has ``k`` data
columns and ``m`` parity fragments; in stripe ``j`` the node at group position ``p`` plays slot
``s = (p - j) mod n``: slots ``0..k-1`` are data columns (fragment index ``s``: the node's
*next* unused chunk, taken in order), slots ``k..n-1`` hold parity fragment ``s`` (index
``k + t`` lives on the t-th holder). So every byte of a node appears exactly once as data, and
over any ``n`` consecutive stripes each node is a parity holder ``m`` times and a data column
``k`` times: it holds ``m / k`` parity chunks per own chunk, i.e. ``m / (n - m)`` of its snapshot.
A node whose data is used up contributes zeros (padding: never stored, never sent), a short
last chunk is zero-padded to ``chunk_bytes``, and a stripe whose columns are all padding is
skipped. Stripes are generated until every node's data is placed, so with unequal sizes the
parity per node is about ``m / (n - m)`` of the *largest* snapshot of the group.

Worked example, n=3, m=1 (k=2), three nodes A, B, C with 4 chunks each (a0..a3, ...)::

    stripe  col0  col1  parity(2)      each node holds 2 parity chunks = 2/4 of its data
    0       a0    b0    on C           = m/(n-m) = 1/2
    1       b1    c0    on A
    2       c1    a1    on B
    3       a2    b2    on C
    4       b3    c2    on A
    5       c3    a3    on B

n=4, m=2 (k=2), nodes A..D with 2 chunks each: stripe 0 = (a0, b0 | parity on C, D),
1 = (b1, c0 | D, A), 2 = (c1, d0 | A, B), 3 = (d1, a1 | B, C): each node holds 2 parity
chunks for 2 chunks of data (m/(n-m) = 1). Losing, say, A and C leaves, in every stripe, its
surviving columns and parity: always >= k fragments, because at most m of the n are lost.

Rebuild. For each lost node and each stripe it takes part in (as a column with real bytes, or
as a parity holder) the plan lists the ``k`` fragments to use: padding columns first (known
zeros, free), then surviving data columns, then surviving parity. Each replacement node fetches
and rebuilds its own share (its data and its parity), independently of the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ftmem.errors import UnrecoverableError
from ftmem.protocol.peer import FragmentKind

ALIGN = 64
"""Chunk sizes are rounded up to this many bytes (ISA-L works on aligned vectors)."""

DEFAULT_MAX_GROUP_SIZE = 8
"""Default cap on the number of nodes per erasure-coding group."""


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One erasure-coding group: its nodes in group order and its parity count ``m``."""

    nodes: tuple[int, ...]
    """Node ranks; a node's index here is its group position."""
    m: int
    """Parity fragments per stripe: any ``m`` nodes of the group may be lost."""

    def __post_init__(self) -> None:
        if self.m < 1:
            raise ValueError(f"m must be >= 1, got {self.m}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"group nodes must be distinct, got {self.nodes}")
        if len(self.nodes) < self.m + 2:
            raise ValueError(
                f"a group with m={self.m} needs at least {self.m + 2} nodes, got {len(self.nodes)}"
            )

    @property
    def n(self) -> int:
        """Number of nodes in the group."""
        return len(self.nodes)

    @property
    def k(self) -> int:
        """Data columns per stripe (``n - m``)."""
        return len(self.nodes) - self.m

    def columns(self, stripe: int) -> tuple[int, ...]:
        """Nodes that are the data columns 0..k-1 of stripe ``stripe``, in column order."""
        return tuple(self.nodes[(stripe + s) % self.n] for s in range(self.k))

    def holders(self, stripe: int) -> tuple[int, ...]:
        """Nodes holding parity fragments ``k..n-1`` of stripe ``stripe``, in fragment order."""
        return tuple(self.nodes[(stripe + s) % self.n] for s in range(self.k, self.n))


def plan_group(nodes: Sequence[int], m: int) -> GroupPlan:
    """The plan of one group of ``nodes`` (in group order); raises ValueError as GroupPlan."""
    return GroupPlan(nodes=tuple(nodes), m=m)


def plan_groups(
    num_nodes: int, m: int, max_group_size: int = DEFAULT_MAX_GROUP_SIZE
) -> tuple[GroupPlan, ...]:
    """Split nodes ``0..num_nodes-1`` into groups of consecutive ranks, sizes differing by
    at most one (rule in the module docstring; ``max_group_size`` is exceeded only to keep
    ``m + 2`` nodes per group).

    Raises:
        ValueError: ``m < 1``, ``max_group_size < m + 2`` or ``num_nodes < m + 2``.
    """
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if max_group_size < m + 2:
        raise ValueError(f"max_group_size must be >= m + 2 = {m + 2}, got {max_group_size}")
    if num_nodes < m + 2:
        raise ValueError(f"erasure coding with m={m} needs at least {m + 2} nodes, got {num_nodes}")
    count = min(-(-num_nodes // max_group_size), num_nodes // (m + 2))
    base, extra = divmod(num_nodes, count)
    groups = []
    start = 0
    for g in range(count):
        size = base + (1 if g < extra else 0)
        groups.append(GroupPlan(nodes=tuple(range(start, start + size)), m=m))
        start += size
    return tuple(groups)


def group_of(groups: Iterable[GroupPlan], node: int) -> GroupPlan:
    """Return the group that contains ``node``.

    Raises:
        ValueError: No group contains it.
    """
    for g in groups:
        if node in g.nodes:
            return g
    raise ValueError(f"node {node} is in no group")


def group_nodes(nodes: int, parity: int, max_group: int, me: int) -> list[int]:
    """The nodes of ``me``'s group among ``nodes`` (:func:`plan_groups`): the only peer
    endpoints its SMP needs, so each launcher reads a bounded number of store keys, not one
    per node of the job. Every node where the placement refuses (the SMP then says why)."""
    try:
        return list(group_of(plan_groups(nodes, parity, max_group), me).nodes)
    except ValueError:
        return list(range(nodes))


def chunk_bytes_for(k: int, stripe_bytes: int) -> int:
    """Chunk size for stripes of about ``stripe_bytes`` data bytes: ``stripe_bytes / k``, aligned.

    Raises:
        ValueError: ``k < 1`` or ``stripe_bytes < 1``.
    """
    if k < 1 or stripe_bytes < 1:
        raise ValueError(f"need k >= 1 and stripe_bytes >= 1, got k={k}, {stripe_bytes}")
    per = -(-stripe_bytes // k)
    return -(-per // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class Column:
    """Data column of a stripe: a byte range of one node's snapshot, zero-padded to the chunk."""

    node: int
    offset: int
    """Byte offset in the node's snapshot."""
    length: int
    """Real bytes, ``0..chunk_bytes``; the rest of the chunk is zeros (0: pure padding)."""


@dataclass(frozen=True, slots=True)
class StripePlan:
    """One stripe: ``k`` data columns (fragments ``0..k-1``) and ``m`` parity holders."""

    index: int
    """Rotation index ``j`` (all-padding stripes are skipped, so indices may have gaps)."""
    chunk_bytes: int
    columns: tuple[Column, ...]
    holders: tuple[int, ...]
    """Fragment ``k + t`` (a parity fragment) lives on ``holders[t]``."""

    @property
    def k(self) -> int:
        """Number of data columns."""
        return len(self.columns)

    @property
    def encoder(self) -> int:
        """Suggested encoder: the first holder gathers the columns, keeps and forwards parity."""
        return self.holders[0]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Real byte count of each data column (what the codec needs for padding/checksums)."""
        return tuple(c.length for c in self.columns)


def stripe_map(plan: GroupPlan, sizes: Mapping[int, int], stripe_bytes: int) -> list[StripePlan]:
    """Place every byte of every node's snapshot (``sizes``; a missing node counts as 0) in
    stripes of about ``stripe_bytes`` data bytes (layout in the module docstring).

    Returns:
        The stripes in rotation order, all-padding stripes left out.

    Raises:
        ValueError: A size is negative or names a node outside the group.
    """
    for node, size in sizes.items():
        if node not in plan.nodes:
            raise ValueError(f"node {node} is not in group {plan.nodes}")
        if size < 0:
            raise ValueError(f"node {node} has a negative size {size}")
    chunk = chunk_bytes_for(plan.k, stripe_bytes)
    remaining = {node: sizes.get(node, 0) for node in plan.nodes}
    offset = dict.fromkeys(plan.nodes, 0)
    stripes: list[StripePlan] = []
    j = 0
    while any(remaining.values()):
        cols = []
        for node in plan.columns(j):
            length = min(chunk, remaining[node])
            cols.append(Column(node=node, offset=offset[node], length=length))
            offset[node] += length
            remaining[node] -= length
        if any(c.length for c in cols):
            stripes.append(StripePlan(j, chunk, tuple(cols), plan.holders(j)))
        j += 1
    return stripes


def parity_bytes_per_node(
    plan: GroupPlan, stripes: Iterable[StripePlan], header_bytes: int = 0
) -> dict[int, int]:
    """``{node: parity bytes}`` each node of the group holds for the others (0 if none),
    counting ``header_bytes`` (e.g. pyeclib's fragment header) per fragment."""
    held = dict.fromkeys(plan.nodes, 0)
    for s in stripes:
        for node in s.holders:
            held[node] += s.chunk_bytes + header_bytes
    return held


@dataclass(frozen=True, slots=True)
class Fetch:
    """One fragment to fetch from a survivor."""

    fragment: int
    """Fragment index in the stripe (``< k``: data column, else parity)."""
    node: int
    kind: FragmentKind
    offset: int
    """DATA: byte offset in ``node``'s snapshot. PARITY: 0."""
    length: int
    """DATA: real bytes (receiver pads to the chunk). PARITY: ``chunk_bytes`` of payload."""


@dataclass(frozen=True, slots=True)
class StripeRebuild:
    """How one lost node rebuilds its share of one stripe."""

    stripe: StripePlan
    rebuild: tuple[int, ...]
    """Fragment indices this node owned and must rebuild (its column and/or its parity)."""
    fetch: tuple[Fetch, ...]
    zeros: tuple[int, ...]
    """Pure-padding data columns, used as known zeros (nothing to fetch)."""


@dataclass(frozen=True, slots=True)
class NodeRebuild:
    """Everything one lost node rebuilds, stripe by stripe."""

    node: int
    stripes: tuple[StripeRebuild, ...]


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """The rebuild of the lost nodes of one group."""

    nodes: tuple[NodeRebuild, ...]
    """One entry per lost node, in ascending node order."""

    def for_node(self, node: int) -> NodeRebuild:
        """The share of lost node ``node``.

        Raises:
            KeyError: ``node`` is not lost.
        """
        for nr in self.nodes:
            if nr.node == node:
                return nr
        raise KeyError(node)


def survivors(stripe: StripePlan, lost: Iterable[int]) -> list[Fetch]:
    """Every fragment of ``stripe`` a survivor holds: real data columns, then parity."""
    k, lost = stripe.k, set(lost)
    out = [
        Fetch(f, c.node, FragmentKind.DATA, c.offset, c.length)
        for f, c in enumerate(stripe.columns)
        if c.length and c.node not in lost
    ]
    out += [
        Fetch(k + t, h, FragmentKind.PARITY, 0, stripe.chunk_bytes)
        for t, h in enumerate(stripe.holders)
        if h not in lost
    ]
    return out


def _stripe_rebuild(stripe: StripePlan, node: int, lost: frozenset[int]) -> StripeRebuild | None:
    k = stripe.k
    mine = [f for f, c in enumerate(stripe.columns) if c.node == node and c.length]
    mine += [k + t for t, h in enumerate(stripe.holders) if h == node]
    if not mine:
        return None
    zeros = [f for f, c in enumerate(stripe.columns) if c.length == 0]
    fetch = survivors(stripe, lost)
    need = k - len(zeros)
    if len(fetch) < need:
        raise AssertionError(f"stripe {stripe.index}: {len(fetch)} survivors < {need}")
    return StripeRebuild(stripe, tuple(mine), tuple(fetch[: max(need, 0)]), tuple(zeros))


def rebuild_plan(
    plan: GroupPlan, stripes: Sequence[StripePlan], lost: Iterable[int]
) -> RebuildPlan:
    """Plan how the ``lost`` nodes of a group get back their data and their parity, given
    the stripe map of the lost step: for each, the stripes it takes part in, which fragments
    it must rebuild and which ``k`` fragments to use (fetched from whom, or known zeros).

    Raises:
        ValueError: A lost node is not in the group.
        UnrecoverableError: More than ``m`` nodes are lost; the message names them.
    """
    lost_set = frozenset(lost)
    outside = sorted(lost_set - set(plan.nodes))
    if outside:
        raise ValueError(f"nodes {outside} are not in group {list(plan.nodes)}")
    if len(lost_set) > plan.m:
        raise UnrecoverableError(
            f"cannot rebuild: {len(lost_set)} nodes {sorted(lost_set)} of group "
            f"{list(plan.nodes)} are lost, but m={plan.m} parity fragments per stripe can "
            f"replace at most {plan.m}"
        )
    rebuilds = []
    for node in sorted(lost_set):
        parts = (_stripe_rebuild(s, node, lost_set) for s in stripes)
        rebuilds.append(NodeRebuild(node, tuple(p for p in parts if p is not None)))
    return RebuildPlan(tuple(rebuilds))
