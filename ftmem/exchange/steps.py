"""The per-step state a :class:`~ftmem.exchange.protector.GroupProtector` keeps, and its bounds.

:class:`StepState` is what one node holds and knows of one step; :class:`StepTable` holds the
steps of one protector and keeps what peers' messages make it store within bounds: at most
:data:`MAX_OPEN_STEPS` steps this node does not hold, and, before a step's stripe map is known,
at most ``max_unplanned_bytes`` of columns and parity over all steps; once the map is known
only the pieces it gives this node are kept, each of exactly its planned length. Only the
protector's thread touches a table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ftmem._logging import get_logger
from ftmem.errors import ProtocolError
from ftmem.exchange.placement import StripePlan
from ftmem.exchange.seals import Seal
from ftmem.exchange.segments import SegmentedBytes
from ftmem.protocol import peer as pm

log = get_logger(__name__)

MAX_OPEN_STEPS = 8
"""Most steps tracked at once that this node does not hold (a round, the next one's early
messages, leftovers); a new one beyond evicts the oldest that has none of this node's data."""

MAX_UNPLANNED_BYTES = 256 << 20
"""Default bound of the columns and parity kept, over all steps, before a step's stripe map
is known (peers may be a few messages ahead of this node)."""


def physical_memory() -> int:
    """Bytes of physical memory of this machine (MAX_NODE_BYTES if unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return pm.MAX_NODE_BYTES


@dataclass
class StepState:
    """What this node holds and knows of one step (its data, every node's size and manifest,
    columns received, parity held, who sent HELD)."""

    data: SegmentedBytes | None = None
    sizes: dict[int, int] = field(default_factory=dict)
    manifests: dict[int, bytes] = field(default_factory=dict)
    stripes: dict[int, StripePlan] | None = None
    columns: dict[tuple[int, int], bytes] = field(default_factory=dict)
    parity: dict[tuple[int, int], bytes] = field(default_factory=dict)
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)
    encoded: set[int] = field(default_factory=set)
    held_sent: bool = False
    aborted: bool = False
    missing: dict[int, int] = field(default_factory=dict)
    """Stripes this node encodes -> data columns not received yet (set once stripes are known)."""
    owed_left: set[tuple[int, int]] | None = None
    """Parity fragments this node must hold and does not yet (None until stripes are known)."""
    seals: dict[int, Seal] = field(default_factory=dict)
    """Each node's seal of the step (its digest and tag, seals.py), kept for its rebuild."""
    unplanned: int = 0
    """Bytes of columns and parity kept before the stripe map was known."""
    refused_at: float | None = None
    """When (monotonic) a message of this step naming a member was first refused (wrong tag)."""
    progress_at: float = 0.0
    """When (monotonic) a valid size, column or parity of this step last came in."""


class StepTable:
    """The steps of one protector (``steps``, by step), with the bounds of the module
    docstring. ``header_bytes(chunk)`` is the codec's fragment header size."""

    def __init__(
        self, me: int, max_unplanned_bytes: int, header_bytes: Callable[[int], int]
    ) -> None:
        self.me = me
        self.steps: dict[int, StepState] = {}
        self.max_unplanned_bytes = max_unplanned_bytes
        self.unplanned = 0
        """Bytes kept, over all steps, before their stripe maps were known."""
        self._header_bytes = header_bytes

    def get(self, step: int) -> StepState:
        """The state of ``step``, added (empty) if not tracked yet."""
        return self.steps.setdefault(step, StepState())

    def for_peer(self, step: int) -> StepState:
        """The state of ``step`` for a peer's message: a step not tracked yet is added only
        within MAX_OPEN_STEPS, forgetting the oldest step with none of this node's data.

        Raises:
            ProtocolError: no room (the message is dropped and counted).
        """
        st = self.steps.get(step)
        if st is not None:
            return st
        open_ = [s for s, v in self.steps.items() if not v.held_sent]
        if len(open_) >= MAX_OPEN_STEPS:
            idle = [s for s in open_ if self.steps[s].data is None]
            if not idle:
                raise ProtocolError(f"more than {MAX_OPEN_STEPS} steps in progress")
            log.warning(
                "[%d] dropping peers' messages of step %d for newer ones", self.me, min(idle)
            )
            self.forget(min(idle))
        return self.get(step)

    def keep_unplanned(self, st: StepState, nbytes: int) -> None:
        """Account ``nbytes`` kept for ``st`` before its stripe map is known. Past the bound,
        other steps this node holds no data of are forgotten (the fullest first), so that what peers sent for steps nobody protects cannot keep a real step out.

        Raises:
            ProtocolError: still no room (the piece is dropped and counted).
        """
        if self.unplanned + nbytes > self.max_unplanned_bytes:
            idle = [s for s, v in self.steps.items() if v is not st and v.data is None]
            for s in sorted(idle, key=lambda s: -self.steps[s].unplanned):
                if (
                    self.unplanned + nbytes <= self.max_unplanned_bytes
                    or not self.steps[s].unplanned
                ):
                    break
                log.warning(
                    "[%d] dropping peers' messages of step %d: the unplanned bound is reached",
                    self.me,
                    s,
                )
                self.forget(s)
        if self.unplanned + nbytes > self.max_unplanned_bytes:
            raise ProtocolError(
                f"more than {self.max_unplanned_bytes} bytes of columns and parity before "
                "their stripe map is known"
            )
        self.unplanned += nbytes
        st.unplanned += nbytes

    def keep_planned(self, st: StepState) -> None:
        """The stripe map is known: keep only what it says this node receives, each piece of
        its planned length; release the unplanned budget."""
        assert st.stripes is not None
        self.release(st)
        st.columns = {k: v for k, v in st.columns.items() if self.column_len(st, *k) == len(v)}
        st.parity = {k: v for k, v in st.parity.items() if self.parity_len(st, *k) == len(v)}

    def release(self, st: StepState) -> None:
        """Give back the unplanned budget ``st`` used (its map is known, or it is forgotten)."""
        self.unplanned -= st.unplanned
        st.unplanned = 0

    def forget(self, step: int) -> None:
        """Drop everything held for ``step``: its budget, and its views of the data."""
        st = self.steps.pop(step, None)
        if st is not None:
            self.release(st)
            if st.data is not None:
                st.data.release()

    def column_len(self, st: StepState, stripe: int, col: int) -> int | None:
        """The planned length of a column this node encodes (None: not one it receives)."""
        s = st.stripes.get(stripe) if st.stripes is not None else None
        if s is None or s.encoder != self.me or not 0 <= col < s.k or stripe in st.encoded:
            return None
        c = s.columns[col]
        return c.length if c.length and c.node != self.me else None

    def parity_len(self, st: StepState, stripe: int, frag: int) -> int | None:
        """The length of a parity fragment this node holds (None: not one it holds)."""
        s = st.stripes.get(stripe) if st.stripes is not None else None
        if s is None or not s.k <= frag < s.k + len(s.holders) or s.holders[frag - s.k] != self.me:
            return None
        return s.chunk_bytes + self._header_bytes(s.chunk_bytes)
