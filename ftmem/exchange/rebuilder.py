"""Rebuilder: both ends of a GroupProtector's rebuild of a lost node's snapshot.

A lost node (:meth:`Rebuilder.rebuild`) asks a survivor for the step's sizes (META), derives
the same stripe map and the rebuild plan, FETCHes k fragments per stripe it took part in (data
ranges from the column nodes, parity with its checksums from holders), and reconstructs its
own data and its parity, a window of stripes at a time. Survivors answer with
:meth:`Rebuilder.serve_meta` and :meth:`Rebuilder.serve_fetch` from the steps they hold.

The rebuilder belongs to its :class:`~ftmem.exchange.protector.GroupProtector` (same thread):
it sends and waits through the protector and keeps only what is in flight (sizes asked for,
fragments fetched, their checksums).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ftmem._logging import get_logger
from ftmem.errors import ProtocolError, UnrecoverableError
from ftmem.exchange import messages as pm
from ftmem.exchange.placement import (
    Fetch,
    FragmentKind,
    StripePlan,
    StripeRebuild,
    rebuild_plan,
    stripe_map,
)
from ftmem.exchange.segments import SegmentedBytes

if TYPE_CHECKING:
    from ftmem.exchange.codec import Rebuilt
    from ftmem.exchange.protector import GroupProtector, StepState

log = get_logger(__name__)

WINDOW_BYTES = 64 << 20
"""Fragments held at once during a rebuild, besides the output (fetching every stripe first
needed n times the node's snapshot)."""


def spare_fetches(
    stripe: StripePlan, lost: set[int] | frozenset[int], used: set[int]
) -> list[Fetch]:
    """Every surviving fragment of ``stripe`` not in ``used`` (for a retry after corruption)."""
    k = stripe.k
    out = [
        Fetch(f, c.node, FragmentKind.DATA, c.offset, c.length)
        for f, c in enumerate(stripe.columns)
        if c.length and c.node not in lost and f not in used
    ]
    out += [
        Fetch(k + t, h, FragmentKind.PARITY, 0, stripe.chunk_bytes)
        for t, h in enumerate(stripe.holders)
        if h not in lost and k + t not in used
    ]
    return out


class Rebuilder:
    """Fetches a lost node's fragments and answers other nodes' fetches (module docstring).

    Error handling: waits are the protector's (bounded by its ``timeout_s``); a fetch of
    something this node does not hold is answered empty, which the asking node counts as lost.
    """

    def __init__(self, protector: GroupProtector) -> None:
        self.p = protector
        self._fetched: dict[tuple[int, int, int], bytes] = {}
        self._meta: dict[int, dict[int, int]] = {}
        self._sums: dict[tuple[int, int], tuple[int, ...]] = {}

    def clear(self) -> None:
        """Forget pending fetches and sizes (the group was reconfigured)."""
        self._fetched.clear()
        self._meta.clear()
        self._sums.clear()

    # -- survivor side -------------------------------------------------------------------------
    def serve_meta(self, sender: int, step: int) -> None:
        """Answer META: the step's sizes (if protected here) and the asker's own manifest."""
        st = self.p.steps.get(step)
        sizes = st.sizes if st is not None and st.held_sent else {}
        manifest = st.manifests.get(sender, b"") if st is not None else b""
        self.p.send(sender, pm.MetaReply(step, dict(sizes)), [manifest])

    def serve_fetch(self, sender: int, b: pm.FetchRequest) -> None:
        """Answer FETCH with the data range or parity fragment (empty if not held here)."""
        p = self.p
        st = p.steps.get(b.step)
        reply = pm.FetchReply(b.step, b.stripe, b.frag)
        if b.kind is FragmentKind.DATA:
            if st is None or st.data is None:
                log.warning(
                    "[%d] fetch of data of step %d I do not hold, from %d", p.me, b.step, sender
                )
                p.send(sender, reply)
                return
            try:
                piece = st.data.read(b.offset, b.length)
            except ValueError as exc:
                raise ProtocolError(f"fetch of step {b.step}: {exc}") from exc
            p.send(sender, reply, [piece])
            return
        payload = st.parity.get((b.stripe, b.frag)) if st is not None else None
        if st is None or payload is None:
            log.warning(
                "[%d] fetch of parity of step %d I do not hold, from %d", p.me, b.step, sender
            )
            p.send(sender, reply)
            return
        sums = st.checksums.get(b.stripe) or ()
        p.send(sender, pm.FetchReply(b.step, b.stripe, b.frag, tuple(sums)), [payload])

    # -- lost node side: replies ---------------------------------------------------------------
    def on_meta(self, b: pm.MetaReply, bufs: tuple[memoryview, ...]) -> None:
        """A survivor's sizes of a step (and this node's manifest)."""
        self._meta[b.step] = dict(b.sizes)
        if bufs:
            self.p._st(b.step).manifests[self.p.me] = bytes(bufs[0])

    def on_fetched(self, b: pm.FetchReply, bufs: tuple[memoryview, ...]) -> None:
        """A fetched fragment (empty: the holder no longer has it)."""
        key = (b.step, b.stripe, b.frag)
        if not bufs:  # the holder no longer has it
            self._fetched[key] = b""
            return
        if b.sums:
            self._sums[(b.step, b.stripe)] = b.sums
        self._fetched[key] = bytes(bufs[0])

    # -- lost node side: the rebuild -----------------------------------------------------------
    def rebuild(self, step: int, lost: set[int] | frozenset[int], source: int) -> memoryview:
        """See :meth:`GroupProtector.rebuild`."""
        p = self.p
        sizes = self._sizes(step, source)
        stripes = stripe_map(p.plan, sizes, p.stripe_bytes)
        mine = rebuild_plan(p.plan, stripes, lost).for_node(p.me)
        out = bytearray(sizes.get(p.me, 0))
        st = p._st(step)
        st.sizes = dict(sizes)
        st.stripes = {s.index: s for s in stripes}
        per = max(1, WINDOW_BYTES // max(1, p.stripe_bytes))
        overall = sum(len(sr.fetch) for sr in mine.stripes)
        done_frags = 0
        for w in range(0, len(mine.stripes), per):
            window = mine.stripes[w : w + per]
            for sr in window:
                self._fetch(step, sr.stripe, sr.fetch)
            wanted = {(step, sr.stripe.index, f.fragment) for sr in window for f in sr.fetch}
            self._wait_fetched(step, wanted, done_frags, overall)
            done_frags += len(wanted)
            for sr in window:
                self._rebuild_stripe(step, sr, lost, st, out)
        st.data = SegmentedBytes([out])
        st.held = set(p.plan.nodes)
        st.held_sent = True
        p.drain()
        return memoryview(out)

    def _sizes(self, step: int, source: int) -> dict[int, int]:
        """Every node's snapshot size of ``step``, asked of ``source``."""
        self.p.send(source, pm.MetaRequest(step))
        self.p.pump(
            lambda: step in self._meta, lambda: f"no sizes of step {step} from node {source}"
        )
        sizes = self._meta.pop(step)
        if set(sizes) != set(self.p.plan.nodes):
            raise UnrecoverableError(f"node {source} does not hold step {step}")
        return sizes

    def _rebuild_stripe(
        self,
        step: int,
        sr: StripeRebuild,
        lost: set[int] | frozenset[int],
        st: StepState,
        out: bytearray,
    ) -> None:
        """Reconstruct one stripe from its fetched fragments into ``out`` and ``st.parity``."""
        s = sr.stripe
        frags = {f.fragment: self._fetched.pop((step, s.index, f.fragment)) for f in sr.fetch}
        # The stripe's k+m checksums travel with any fetched parity fragment.
        sums = self._sums.pop((step, s.index), None)
        try:
            got = self._reconstruct(s, frags, sr.rebuild, sums)
        except UnrecoverableError as exc:
            spares = spare_fetches(s, lost, set(frags) | set(sr.rebuild))
            log.warning(
                "[%d] step %d stripe %d: %s; retrying with %d more fragments",
                self.p.me,
                step,
                s.index,
                exc,
                len(spares),
            )
            if not spares:
                raise
            self._fetch(step, s, spares)
            self._wait_fetched(step, {(step, s.index, f.fragment) for f in spares})
            frags.update(
                {f.fragment: self._fetched.pop((step, s.index, f.fragment)) for f in spares}
            )
            sums = self._sums.pop((step, s.index), sums)
            got = self._reconstruct(s, frags, sr.rebuild, sums)
        for frag, payload in got.fragments.items():
            if frag < s.k:
                c = s.columns[frag]
                out[c.offset : c.offset + c.length] = payload[: c.length]
            else:
                st.parity[(s.index, frag)] = payload
        if sums is not None:
            st.checksums[s.index] = sums

    def _reconstruct(
        self,
        s: StripePlan,
        frags: dict[int, bytes],
        wanted: Sequence[int],
        sums: tuple[int, ...] | None,
    ) -> Rebuilt:
        return self.p.codec.reconstruct(
            frags, wanted, chunk_bytes=s.chunk_bytes, lengths=s.lengths, checksums=sums
        )

    def _fetch(self, step: int, stripe: StripePlan, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            body = pm.FetchRequest(step, stripe.index, f.fragment, f.kind, f.offset, f.length)
            self.p.send(f.node, body)

    def _wait_fetched(
        self, step: int, wanted: set[tuple[int, int, int]], base: int = 0, overall: int = 0
    ) -> None:
        """Pump until every fragment of ``wanted`` is in; ``base`` of ``overall`` fragments
        were done before (progress is reported over the whole rebuild)."""
        total = len(wanted)
        overall = max(overall, base + total)
        last = [time.monotonic()]
        on_progress = self.p.on_progress

        def done() -> bool:
            n = len(self._fetched)
            now = time.monotonic()
            if on_progress is not None and now - last[0] >= 1.0:
                last[0] = now
                on_progress(step, base + min(n, total), overall)
            return n >= total and wanted <= self._fetched.keys()

        self.p.pump(
            done, lambda: f"{len(wanted - set(self._fetched))} fragments of step {step} missing"
        )
