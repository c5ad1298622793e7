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

Every header carries the protector's *epoch* (the launcher's generation): after the group is
reconfigured (:meth:`reconfigure`), late messages of an earlier epoch are dropped. A node that
cannot take part in a step's protection sends ABORT; every node then gives the step up
(:class:`StepAborted`). A node also sends its *manifest* (what its snapshot bytes are: ranks and
layouts, opaque here) with its size; every peer keeps it, so a rebuilt node gets its own back.

One thread owns a protector and its transport. The snapshot bytes are the caller's: the
protector reads them (``memoryview`` or :class:`SegmentedBytes`) until :meth:`forget` of that
step. Messages of kinds the protector does not know go to ``on_other`` (the SMP's exchange
service uses this for its own agreement messages).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError, UnrecoverableError
from ftmem.exchange.codec import StripeCodec
from ftmem.exchange.placement import (
    Fetch,
    FragmentKind,
    GroupPlan,
    StripePlan,
    rebuild_plan,
    stripe_map,
)
from ftmem.exchange.segments import Buffer, SegmentedBytes
from ftmem.exchange.transport import PeerMessage, PeerTransport

log = get_logger(__name__)

_MAX_NODE_BYTES = 1 << 44


class StepAborted(FtmemError):
    """A node of the group gave up protecting this step (its data was gone, or it failed)."""


class ExchangeInterrupted(FtmemError):
    """The caller's ``interrupted()`` became true during a wait (e.g. the group changed)."""


@dataclass
class _Step:
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
        epoch: int = 0,
        on_other: Callable[[PeerMessage], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
        on_progress: Callable[[int, int, int], None] | None = None,
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
        self.epoch = epoch
        self.on_other = on_other
        self.interrupted = interrupted or (lambda: False)
        self.on_progress = on_progress
        """Called about once a second during a rebuild: (step, fragments in, fragments needed)."""
        self.dropped = 0
        self.sent_bytes = 0
        self._outbox: dict[int, deque[tuple[dict[str, Any], list[Any]]]] = {}

    # -- helpers -----------------------------------------------------------------------------
    def _peers(self) -> list[int]:
        return [n for n in self.plan.nodes if n != self.me]

    def _send(self, node: int, header: dict[str, Any], bufs: list[Any] | None = None) -> None:
        """Queue a message; :meth:`flush` (called by every wait) sends it without blocking, so
        a node never stalls on a busy peer while that peer stalls on it."""
        header["e"] = self.epoch
        self._outbox.setdefault(node, deque()).append((header, bufs or []))

    def send(self, node: int, header: dict[str, Any]) -> None:
        """Queue a small message of the owner's own (ordered with the protocol's messages)."""
        self._send(node, header)

    def flush(self) -> bool:
        """Send what peers can take now; True when nothing is left queued."""
        for node, box in list(self._outbox.items()):
            while box:
                header, bufs = box[0]
                try:
                    if not self.transport.try_send(str(node), header, bufs):
                        break
                except FtmemError as exc:
                    log.warning(
                        "[%d] dropping %d messages to node %d: %s", self.me, len(box), node, exc
                    )
                    box.clear()
                    break
                box.popleft()
                self.sent_bytes += sum(memoryview(b).nbytes for b in bufs)
            if not box:
                del self._outbox[node]
        return not self._outbox

    def drain(self) -> None:
        """Wait (bounded by ``timeout_s``, serving peers meanwhile) until every queued message
        is sent: a node that returns from :meth:`protect` may owe its peers their HELD."""
        self._pump(self.flush, lambda: f"{sum(map(len, self._outbox.values()))} messages unsent")

    def _wait_s(self, longest: float) -> float:
        return min(longest, 0.002) if self._outbox else longest

    def reconfigure(self, transport: PeerTransport, epoch: int) -> None:
        """Use ``transport`` from now on and drop messages of earlier epochs.

        Held steps (data, parity, checksums, manifests) are kept: they serve the rebuild.
        Steps not yet protected are given up, as are pending fetches.
        """
        self.transport = transport
        self.epoch = epoch
        self._outbox.clear()
        for step in [s for s, st in self.steps.items() if not st.held_sent]:
            del self.steps[step]
        self._fetched.clear()
        self._meta.clear()
        self._sums.clear()

    def _st(self, step: int) -> _Step:
        return self.steps.setdefault(step, _Step())

    def _plan_stripes(self, step: int) -> None:
        st = self.steps[step]
        if st.stripes is None and len(st.sizes) == len(self.plan.nodes):
            st.stripes = {s.index: s for s in stripe_map(self.plan, st.sizes, self.stripe_bytes)}
            assert st.data is not None
            # Bookkeeping per stripe, so each message costs O(1), not O(stripes).
            st.owed_left = {key for key in self._owed(step) if key not in st.parity}
            for s in st.stripes.values():
                if s.encoder == self.me:
                    st.missing[s.index] = sum(
                        1
                        for col, c in enumerate(s.columns)
                        if c.length and (s.index, col) not in st.columns
                    )
                for col, c in enumerate(s.columns):
                    if c.node == self.me and c.length:
                        piece = st.data.read(c.offset, c.length)
                        self._send(
                            s.encoder,
                            {"t": "data", "step": step, "stripe": s.index, "col": col},
                            [piece],
                        )
            for index in [i for i, n in st.missing.items() if n == 0]:
                self._progress(step, index)
            self._progress(step, None)

    def _owed(self, step: int) -> list[tuple[int, int]]:
        st = self.steps[step]
        assert st.stripes is not None
        return [
            (s.index, s.k + t)
            for s in st.stripes.values()
            for t, h in enumerate(s.holders)
            if h == self.me
        ]

    def _progress(self, step: int, stripe: int | None) -> None:
        """Encode ``stripe`` if all its columns are in; send HELD once all owed parity is held."""
        st = self.steps[step]
        if st.stripes is None or st.owed_left is None:
            return
        if stripe is not None and st.missing.get(stripe) == 0:
            del st.missing[stripe]
            if stripe not in st.encoded:
                self._encode(step, st.stripes[stripe])
        if not st.held_sent and not st.owed_left:
            st.held_sent = True
            st.held.add(self.me)
            for n in self._peers():
                self._send(n, {"t": "held", "step": step})

    def _encode(self, step: int, s: StripePlan) -> None:
        faults.maybe_inject(faults.Point.IN_ENCODE, self.me, step)
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
                if st.owed_left is not None:
                    st.owed_left.discard((s.index, frag))
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
    def handle(self, msg: PeerMessage) -> None:
        """Act on one peer message (the caller's loop received it)."""
        h = msg.header
        try:
            e = h.get("e")
            if isinstance(e, int) and e > self.epoch and self.on_other is not None:
                self.on_other(msg)  # a newer generation: the owner keeps it for later
                return
            if e != self.epoch:
                self.dropped += 1
                log.debug(
                    "[%d] dropped a message of epoch %s (now %d)", self.me, h.get("e"), self.epoch
                )
                return
            kind, step, sender = str(h["t"]), int(h["step"]), int(msg.sender)
        except (KeyError, TypeError, ValueError, AttributeError):
            if self.on_other is not None and isinstance(h, dict) and "step" not in h:
                self.on_other(msg)
                return
            self.dropped += 1
            log.warning("[%d] ignoring a malformed peer message %r", self.me, h)
            return
        if sender not in self.plan.nodes or sender == self.me:
            self.dropped += 1
            log.warning("[%d] ignoring a message from node %s outside the group", self.me, sender)
            return
        try:
            self._dispatch(kind, step, sender, msg)
        except (KeyError, TypeError, ValueError, IndexError, AssertionError) as exc:
            self.dropped += 1
            log.warning("[%d] ignoring a bad %r message from %d: %r", self.me, kind, sender, exc)

    def _dispatch(self, kind: str, step: int, sender: int, msg: PeerMessage) -> None:
        h = msg.header
        if kind == "size":
            nbytes = int(h["nbytes"])
            if not 0 <= nbytes <= _MAX_NODE_BYTES:
                raise ValueError(f"size {nbytes} out of range")
            st = self._st(step)
            st.sizes[sender] = nbytes
            st.manifests[sender] = bytes(msg.buffers[0]) if msg.buffers else b""
            if st.data is not None:
                self._plan_stripes(step)
        elif kind == "data":
            key = (int(h["stripe"]), int(h["col"]))
            st = self._st(step)
            new = key not in st.columns
            st.columns[key] = bytes(msg.buffers[0])
            if new and key[0] in st.missing:
                st.missing[key[0]] -= 1
                self._progress(step, key[0])
        elif kind == "parity":
            st = self._st(step)
            key = (int(h["stripe"]), int(h["frag"]))
            st.parity[key] = bytes(msg.buffers[0])
            st.checksums[int(h["stripe"])] = tuple(int(x) for x in h["sums"])
            if st.owed_left is not None:
                st.owed_left.discard(key)
            self._progress(step, None)
        elif kind == "held":
            self._st(step).held.add(sender)
        elif kind == "abort":
            if step in self.steps and not self.steps[step].held >= set(self.plan.nodes):
                self.steps[step].aborted = True
        elif kind == "meta?":
            st0 = self.steps.get(step)
            sizes = st0.sizes if st0 is not None and st0.held_sent else {}
            manifest = st0.manifests.get(sender, b"") if st0 is not None else b""
            self._send(
                sender,
                {"t": "meta", "step": step, "sizes": {str(k): v for k, v in sizes.items()}},
                [manifest],
            )
        elif kind == "meta":
            self._meta[step] = {int(k): int(v) for k, v in dict(h["sizes"]).items()}
            if msg.buffers:
                self._st(step).manifests[self.me] = bytes(msg.buffers[0])
        elif kind == "fetch":
            self._serve_fetch(sender, step, h)
        elif kind == "fetched":
            if not msg.buffers:  # the holder no longer has it
                self._fetched[(step, int(h["stripe"]), int(h["frag"]))] = b""
                return
            if h.get("sums"):
                self._sums[(step, int(h["stripe"]))] = tuple(int(x) for x in h["sums"])
            self._fetched[(step, int(h["stripe"]), int(h["frag"]))] = bytes(msg.buffers[0])
        elif self.on_other is not None:
            self.on_other(msg)
        else:
            raise ValueError(f"unknown kind {kind!r}")

    def _serve_fetch(self, sender: int, step: int, h: dict[str, Any]) -> None:
        st = self.steps.get(step)
        stripe, frag = int(h["stripe"]), int(h["frag"])
        reply = {"t": "fetched", "step": step, "stripe": stripe, "frag": frag}
        if h["kind"] == FragmentKind.DATA.value:
            if st is None or st.data is None:
                log.warning(
                    "[%d] fetch of data of step %d I do not hold, from %d", self.me, step, sender
                )
                self._send(sender, reply)
                return
            off, n = int(h["offset"]), int(h["length"])
            self._send(sender, reply, [st.data.read(off, n)])
        else:
            payload = st.parity.get((stripe, frag)) if st is not None else None
            if st is None or payload is None:
                log.warning(
                    "[%d] fetch of parity of step %d I do not hold, from %d", self.me, step, sender
                )
                self._send(sender, reply)
                return
            sums = st.checksums.get(stripe)
            reply["sums"] = [str(c) for c in sums] if sums else []
            self._send(sender, reply, [payload])

    def _pump(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self.interrupted():
                raise ExchangeInterrupted(f"node {self.me}: interrupted while {what()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node {self.me}: {what()} after {self.timeout_s} s")
            self.flush()
            msg = self.transport.recv(self._wait_s(min(left, 0.5)))
            if msg is not None:
                self.handle(msg)

    # -- public API ------------------------------------------------------------------------------
    def protect(self, step: int, data: SegmentedBytes | Buffer, manifest: bytes = b"") -> None:
        """Protect this node's snapshot ``data`` of ``step`` with the group; return when protected.

        Raises:
            StepAborted: a node gave the step up (the caller may :meth:`abort` it too).
            TimeoutError: the group did not finish within ``timeout_s``.
            ExchangeInterrupted: ``interrupted()`` became true.
        """
        st = self._st(step)
        st.data = SegmentedBytes.of(data)
        st.sizes[self.me] = st.data.nbytes
        st.manifests[self.me] = manifest
        for n in self._peers():
            self._send(n, {"t": "size", "step": step, "nbytes": st.data.nbytes}, [manifest])
        self._plan_stripes(step)

        def done() -> bool:
            if st.aborted:
                raise StepAborted(f"step {step} was given up by a node of the group")
            return st.held >= set(self.plan.nodes)

        self._pump(
            done,
            lambda: (
                f"step {step} not protected (held by {sorted(st.held)}, sizes from {sorted(st.sizes)})"
            ),
        )
        self.drain()

    def abort(self, step: int) -> None:
        """Give ``step`` up here and tell every peer to give it up too."""
        for n in self._peers():
            self._send(n, {"t": "abort", "step": step})
        self.forget(step)

    def held_steps(self) -> list[int]:
        """Steps whose own data and owed parity this node holds (it told the group HELD)."""
        return sorted(s for s, st in self.steps.items() if st.held_sent and st.data is not None)

    def manifest(self, step: int, node: int) -> bytes:
        """The manifest ``node`` sent with its size for ``step`` (b"" if unknown)."""
        st = self.steps.get(step)
        return st.manifests.get(node, b"") if st is not None else b""

    def is_protected(self, step: int) -> bool:
        """True once every node of the group holds its parity of ``step``."""
        st = self.steps.get(step)
        return st is not None and st.held >= set(self.plan.nodes)

    def serve(self, until: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Answer peers (fetches, late protocol messages) until ``until()`` is true."""
        while not until():
            self.flush()
            msg = self.transport.recv(self._wait_s(poll_s))
            if msg is not None:
                self.handle(msg)

    def parity_bytes(self, step: int) -> int:
        """Parity bytes this node holds for ``step``."""
        st = self.steps.get(step)
        return sum(len(p) for p in st.parity.values()) if st else 0

    def forget(self, step: int) -> None:
        """Drop everything held for ``step`` (after a newer step is protected)."""
        st = self.steps.pop(step, None)
        if st is not None and st.data is not None:
            st.data.release()

    def _fetch(self, step: int, stripe: StripePlan, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            self._send(
                f.node,
                {
                    "t": "fetch",
                    "step": step,
                    "stripe": stripe.index,
                    "frag": f.fragment,
                    "kind": f.kind.value,
                    "offset": f.offset,
                    "length": f.length,
                },
            )

    def _wait_fetched(
        self, step: int, wanted: set[tuple[int, int, int]], base: int = 0, overall: int = 0
    ) -> None:
        """Pump until every fragment of ``wanted`` is in; ``base`` of ``overall`` fragments
        were done before (progress is reported over the whole rebuild)."""
        total = len(wanted)
        overall = max(overall, base + total)
        last = [time.monotonic()]

        def done() -> bool:
            n = len(self._fetched)
            now = time.monotonic()
            if self.on_progress is not None and now - last[0] >= 1.0:
                last[0] = now
                self.on_progress(step, base + min(n, total), overall)
            return n >= total and wanted <= self._fetched.keys()

        self._pump(
            done, lambda: f"{len(wanted - set(self._fetched))} fragments of step {step} missing"
        )

    @staticmethod
    def _spares(stripe: StripePlan, lost: set[int] | frozenset[int], used: set[int]) -> list[Fetch]:
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

    def rebuild(self, step: int, lost: set[int] | frozenset[int], source: int) -> memoryview:
        """Rebuild this (lost) node's snapshot of ``step`` and its parity, from the survivors.

        ``source`` is a survivor asked for the step's sizes (and this node's manifest, then
        available from :meth:`manifest`). Returns the snapshot bytes; the rebuilt parity is
        held as if this node had protected the step itself. A fetched fragment that fails its
        checksum counts as lost: the stripe is retried with every other surviving fragment.

        Raises:
            UnrecoverableError: more than m nodes of the group are lost, the source does not
                hold the step, or too few fragments of a stripe are intact.
            TimeoutError: a survivor did not answer in time.
        """
        self._send(source, {"t": "meta?", "step": step})
        self._pump(
            lambda: step in self._meta, lambda: f"no sizes of step {step} from node {source}"
        )
        sizes = self._meta.pop(step)
        if set(sizes) != set(self.plan.nodes):
            raise UnrecoverableError(f"node {source} does not hold step {step}")
        stripes = stripe_map(self.plan, sizes, self.stripe_bytes)
        mine = rebuild_plan(self.plan, stripes, lost).for_node(self.me)
        out = bytearray(sizes.get(self.me, 0))
        st = self._st(step)
        st.sizes = dict(sizes)
        st.stripes = {s.index: s for s in stripes}
        # Fetch and rebuild a window of stripes at a time: at most ~64 MiB of fragments are held
        # besides the output (fetching everything first needed n times the node's snapshot).
        per = max(1, (64 << 20) // max(1, self.stripe_bytes))
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
                s = sr.stripe
                frags = {
                    f.fragment: self._fetched.pop((step, s.index, f.fragment)) for f in sr.fetch
                }
                # The stripe's k+m checksums travel with any fetched parity fragment.
                sums = self._sums.pop((step, s.index), None)
                try:
                    got = self.codec.reconstruct(
                        frags,
                        sr.rebuild,
                        chunk_bytes=s.chunk_bytes,
                        lengths=s.lengths,
                        checksums=sums,
                    )
                except UnrecoverableError as exc:
                    spares = self._spares(s, lost, set(frags) | set(sr.rebuild))
                    log.warning(
                        "[%d] step %d stripe %d: %s; retrying with %d more fragments",
                        self.me,
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
                    got = self.codec.reconstruct(
                        frags,
                        sr.rebuild,
                        chunk_bytes=s.chunk_bytes,
                        lengths=s.lengths,
                        checksums=sums,
                    )
                for frag, payload in got.fragments.items():
                    if frag < s.k:
                        c = s.columns[frag]
                        out[c.offset : c.offset + c.length] = payload[: c.length]
                    else:
                        st.parity[(s.index, frag)] = payload
                if sums is not None:
                    st.checksums[s.index] = sums
        st.data = SegmentedBytes([out])
        st.held = set(self.plan.nodes)
        st.held_sent = True
        self.drain()
        return memoryview(out)
