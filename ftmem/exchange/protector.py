"""GroupProtector: the erasure-coding protocol of one node of a group, over a PeerTransport.

Protect (every node of the group calls :meth:`GroupProtector.protect` for the same step):

1. SIZE: each node tells every peer how many bytes its snapshot of the step has; with all
   sizes known every node derives the same stripe map (placement.stripe_map).
2. DATA: for each stripe where it is a data column with real bytes, a node sends that byte
   range to the stripe's encoder (its first parity holder).
3. PARITY: an encoder with all real columns of a stripe encodes it (pyeclib, ISA-L), keeps its
   own parity fragment and sends the others, with the stripe's k+m checksums, to their holders.
4. HELD: a node that holds every parity fragment it owes for the step tells every peer; the
   step is *protected* on a node once it has seen HELD from the whole group.

Rebuild (a node that lost its memory calls :meth:`rebuild`; survivors keep calling
:meth:`serve`): it asks a survivor for the step's sizes (META), derives the same stripe map and
the rebuild plan, FETCHes k fragments per stripe it took part in (data ranges from the column
nodes, parity with its checksums from holders), and reconstructs its own data and its parity.

One thread owns a protector and its transport. The snapshot bytes are the caller's: the
protector reads them (``memoryview``) until :meth:`forget` of that step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftmem._logging import get_logger
from ftmem.exchange.codec import StripeCodec
from ftmem.exchange.placement import (
    FragmentKind,
    GroupPlan,
    StripePlan,
    rebuild_plan,
    stripe_map,
)
from ftmem.exchange.transport import PeerMessage, PeerTransport

log = get_logger(__name__)


@dataclass
class _Step:
    data: memoryview | None = None
    sizes: dict[int, int] = field(default_factory=dict)
    stripes: dict[int, StripePlan] | None = None
    columns: dict[tuple[int, int], bytes] = field(default_factory=dict)
    parity: dict[tuple[int, int], bytes] = field(default_factory=dict)
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)
    encoded: set[int] = field(default_factory=set)
    held_sent: bool = False


class GroupProtector:
    """Protects this node's snapshots with its group and rebuilds them (see module docstring).

    Error handling: waits are bounded by ``timeout_s`` and raise TimeoutError saying what is
    missing; malformed peer messages are logged and ignored.
    """

    def __init__(
        self,
        me: int,
        plan: GroupPlan,
        transport: PeerTransport,
        stripe_bytes: int = 1 << 20,
        timeout_s: float = 60.0,
    ) -> None:
        if me not in plan.nodes:
            raise ValueError(f"node {me} is not in group {plan.nodes}")
        self.me = me
        self.plan = plan
        self.transport = transport
        self.stripe_bytes = stripe_bytes
        self.timeout_s = timeout_s
        self.codec = StripeCodec(plan.k, plan.m)
        self.steps: dict[int, _Step] = {}
        self._fetched: dict[tuple[int, int, int], bytes] = {}
        self._meta: dict[int, dict[int, int]] = {}
        self._sums: dict[tuple[int, int], tuple[int, ...]] = {}

    # -- helpers -----------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        return [n for n in self.plan.nodes if n != self.me]

    def _send(self, node: int, header: dict[str, Any], bufs: list[Any] | None = None) -> None:
        self.transport.send(str(node), header, bufs or [])

    def _st(self, step: int) -> _Step:
        return self.steps.setdefault(step, _Step())

    def _plan_stripes(self, step: int) -> None:
        st = self.steps[step]
        if st.stripes is None and len(st.sizes) == len(self.plan.nodes):
            st.stripes = {s.index: s for s in stripe_map(self.plan, st.sizes, self.stripe_bytes)}
            assert st.data is not None
            for s in st.stripes.values():
                for col, c in enumerate(s.columns):
                    if c.node == self.me and c.length:
                        piece = st.data[c.offset : c.offset + c.length]
                        self._send(
                            s.encoder,
                            {"t": "data", "step": step, "stripe": s.index, "col": col},
                            [piece],
                        )
            self._progress(step)

    def _owed(self, step: int) -> list[tuple[int, int]]:
        st = self.steps[step]
        assert st.stripes is not None
        return [
            (s.index, s.k + t)
            for s in st.stripes.values()
            for t, h in enumerate(s.holders)
            if h == self.me
        ]

    def _progress(self, step: int) -> None:
        st = self.steps[step]
        if st.stripes is None:
            return
        for s in st.stripes.values():
            if s.encoder != self.me or s.index in st.encoded:
                continue
            need = [col for col, c in enumerate(s.columns) if c.length]
            if all((s.index, col) in st.columns for col in need):
                self._encode(step, s)
        if not st.held_sent and all(key in st.parity for key in self._owed(step)):
            st.held_sent = True
            st.held.add(self.me)
            for n in self._peers():
                self._send(n, {"t": "held", "step": step})

    def _encode(self, step: int, s: StripePlan) -> None:
        st = self.steps[step]
        buf = self.codec.stripe_buffer(s.chunk_bytes)  # reused: every chunk is rewritten below
        zero = bytes(s.chunk_bytes)
        for col in range(s.k):
            piece = st.columns.pop((s.index, col), b"")
            start = col * s.chunk_bytes
            buf[start : start + s.chunk_bytes] = zero
            buf[start : start + len(piece)] = piece
        enc = self.codec.encode_stripe(buf, s.lengths)
        st.encoded.add(s.index)
        st.checksums[s.index] = enc.checksums
        for t, holder in enumerate(s.holders):
            frag = s.k + t
            if holder == self.me:
                st.parity[(s.index, frag)] = enc.parity[t]
            else:
                hdr = {
                    "t": "parity",
                    "step": step,
                    "stripe": s.index,
                    "frag": frag,
                    "sums": [str(c) for c in enc.checksums],
                }
                self._send(holder, hdr, [enc.parity[t]])

    # -- message handling ----------------------------------------------------------------------
    def _handle(self, msg: PeerMessage) -> None:
        h = msg.header
        try:
            kind, step, sender = str(h["t"]), int(h["step"]), int(msg.sender)
        except (KeyError, TypeError, ValueError):
            log.warning("[%d] ignoring a malformed peer message %r", self.me, h)
            return
        if sender not in self.plan.nodes:
            log.warning("[%d] ignoring a message from node %s outside the group", self.me, sender)
            return
        if kind == "size":
            self._st(step).sizes[sender] = int(h["nbytes"])
            if self.steps[step].data is not None:
                self._plan_stripes(step)
        elif kind == "data":
            self._st(step).columns[(int(h["stripe"]), int(h["col"]))] = bytes(msg.buffers[0])
            self._progress(step)
        elif kind == "parity":
            st = self._st(step)
            st.parity[(int(h["stripe"]), int(h["frag"]))] = bytes(msg.buffers[0])
            st.checksums[int(h["stripe"])] = tuple(int(x) for x in h["sums"])
            self._progress(step)
        elif kind == "held":
            self._st(step).held.add(sender)
        elif kind == "meta?":
            sizes = self.steps[step].sizes if step in self.steps else {}
            self._send(
                sender, {"t": "meta", "step": step, "sizes": {str(k): v for k, v in sizes.items()}}
            )
        elif kind == "meta":
            self._meta[step] = {int(k): int(v) for k, v in dict(h["sizes"]).items()}
        elif kind == "fetch":
            self._serve_fetch(sender, step, h)
        elif kind == "fetched":
            if h.get("sums"):
                self._sums[(step, int(h["stripe"]))] = tuple(int(x) for x in h["sums"])
            self._fetched[(step, int(h["stripe"]), int(h["frag"]))] = bytes(msg.buffers[0])

    def _serve_fetch(self, sender: int, step: int, h: dict[str, Any]) -> None:
        st = self.steps.get(step)
        stripe, frag = int(h["stripe"]), int(h["frag"])
        reply = {"t": "fetched", "step": step, "stripe": stripe, "frag": frag}
        if st is None:
            log.warning("[%d] fetch of unknown step %d from %d", self.me, step, sender)
            return
        if h["kind"] == FragmentKind.DATA.value:
            assert st.data is not None
            off, n = int(h["offset"]), int(h["length"])
            self._send(sender, reply, [st.data[off : off + n]])
        else:
            sums = st.checksums.get(stripe)
            reply["sums"] = [str(c) for c in sums] if sums else []
            self._send(sender, reply, [st.parity[(stripe, frag)]])

    def _pump(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node {self.me}: {what()} after {self.timeout_s} s")
            msg = self.transport.recv(min(left, 0.5))
            if msg is not None:
                self._handle(msg)

    # -- public API ------------------------------------------------------------------------------
    def protect(self, step: int, data: memoryview) -> None:
        """Protect this node's snapshot ``data`` of ``step`` with the group; return when protected."""
        st = self._st(step)
        st.data = data
        st.sizes[self.me] = data.nbytes
        for n in self._peers():
            self._send(n, {"t": "size", "step": step, "nbytes": data.nbytes})
        self._plan_stripes(step)
        self._pump(
            lambda: st.held >= set(self.plan.nodes),
            lambda: (
                f"step {step} not protected (held by {sorted(st.held)}, sizes from {sorted(st.sizes)})"
            ),
        )

    def is_protected(self, step: int) -> bool:
        """True once every node of the group holds its parity of ``step``."""
        st = self.steps.get(step)
        return st is not None and st.held >= set(self.plan.nodes)

    def serve(self, until: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Answer peers (fetches, late protocol messages) until ``until()`` is true."""
        while not until():
            msg = self.transport.recv(poll_s)
            if msg is not None:
                self._handle(msg)

    def parity_bytes(self, step: int) -> int:
        """Parity bytes this node holds for ``step``."""
        st = self.steps.get(step)
        return sum(len(p) for p in st.parity.values()) if st else 0

    def forget(self, step: int) -> None:
        """Drop everything held for ``step`` (after a newer step is protected)."""
        self.steps.pop(step, None)

    def rebuild(self, step: int, lost: set[int], source: int) -> bytes:
        """Rebuild this (lost) node's snapshot of ``step`` and its parity, from the survivors.

        ``source`` is a survivor asked for the step's sizes. Returns the snapshot bytes; the
        rebuilt parity is held as if this node had protected the step itself.

        Raises:
            UnrecoverableError: more than m nodes of the group are lost.
            TimeoutError: a survivor did not answer in time.
        """
        self._send(source, {"t": "meta?", "step": step})
        self._pump(
            lambda: step in self._meta, lambda: f"no sizes of step {step} from node {source}"
        )
        sizes = self._meta[step]
        stripes = stripe_map(self.plan, sizes, self.stripe_bytes)
        mine = rebuild_plan(self.plan, stripes, lost).for_node(self.me)
        for sr in mine.stripes:
            for f in sr.fetch:
                self._send(
                    f.node,
                    {
                        "t": "fetch",
                        "step": step,
                        "stripe": sr.stripe.index,
                        "frag": f.fragment,
                        "kind": f.kind.value,
                        "offset": f.offset,
                        "length": f.length,
                    },
                )
        wanted = {(step, sr.stripe.index, f.fragment) for sr in mine.stripes for f in sr.fetch}
        self._pump(
            lambda: wanted <= set(self._fetched),
            lambda: f"{len(wanted - set(self._fetched))} fragments of step {step} missing",
        )
        out = bytearray(sizes.get(self.me, 0))
        st = self._st(step)
        st.sizes = dict(sizes)
        st.stripes = {s.index: s for s in stripes}
        for sr in mine.stripes:
            s = sr.stripe
            frags = {f.fragment: self._fetched.pop((step, s.index, f.fragment)) for f in sr.fetch}
            # The stripe's k+m checksums travel with any fetched parity fragment.
            sums = self._sums.pop((step, s.index), None)
            got = self.codec.reconstruct(
                frags, sr.rebuild, chunk_bytes=s.chunk_bytes, lengths=s.lengths, checksums=sums
            )
            for frag, payload in got.fragments.items():
                if frag < s.k:
                    c = s.columns[frag]
                    out[c.offset : c.offset + c.length] = payload[: c.length]
                else:
                    st.parity[(s.index, frag)] = payload
            if sums is not None:
                st.checksums[s.index] = sums
        st.data = memoryview(bytes(out))
        st.held = set(self.plan.nodes)
        st.held_sent = True
        return bytes(out)
