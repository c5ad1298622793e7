"""Rebuilder: both ends of a GroupProtector's rebuild of a lost node's snapshot.

A lost node (:meth:`Rebuilder.rebuild`) asks a survivor for the step's sizes (META), derives
the same stripe map and the rebuild plan, FETCHes k fragments per stripe it took part in (data
ranges from the column nodes, parity with its checksums from holders), and reconstructs its
own data and its parity, a window of stripes at a time. Survivors answer from the steps they
hold.

Who is served: snapshot bytes and manifests go only to a node that this generation's sync
decided is rebuilding, for the step being rebuilt, until it says it holds the step (HELD):
the owner calls :meth:`Rebuilder.hold` as a generation starts (requests then wait, bounded)
and :meth:`Rebuilder.serve_only` once the sync has decided. Every other request is refused:
dropped, counted in the protector's ``dropped`` and in ``refused``, logged once per node; no
reply. (A rebuilder whose owner never calls either serves every node of the group.)

What a rebuilt node checks before it allocates or keeps anything: the sizes are those of the
group's nodes, each at most the protector's ``max_node_bytes``; the manifest is bounded; the
lost node's seal (seals.py) matches its size and manifest (with a key file); and the owner's
``accept`` hook. After the rebuild, the bytes must match the sealed digest. Replies nobody
asked for are dropped.

The rebuilder belongs to its :class:`~ftmem.exchange.protector.GroupProtector` (same thread):
it sends and waits through the protector and keeps only what is in flight (sizes asked for,
fragments fetched, their checksums).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ftmem._logging import get_logger
from ftmem.errors import ProtocolError, UnrecoverableError
from ftmem.exchange import seals
from ftmem.exchange.placement import (
    Fetch,
    StripePlan,
    StripeRebuild,
    rebuild_plan,
    stripe_map,
    survivors,
)
from ftmem.exchange.segments import SegmentedBytes
from ftmem.exchange.steps import StepState
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import FragmentKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from ftmem.exchange.codec import StripeCodec
    from ftmem.exchange.placement import GroupPlan
    from ftmem.exchange.steps import StepTable
    from ftmem.exchange.transport import PeerTransport


class RebuildOwner(Protocol):
    """What a :class:`Rebuilder` uses of the GroupProtector it belongs to (protector.py):
    the group, the step table, sending and waiting."""

    me: int
    plan: GroupPlan
    transport: PeerTransport
    table: StepTable
    codec: StripeCodec
    stripe_bytes: int
    max_node_bytes: int
    dropped: int
    on_progress: Callable[[int, int, int], None] | None

    def queued_for(self, node: int) -> tuple[int, int]: ...
    def send(self, node: int, body: pm.PeerBody, bufs: list[Any] | None = None) -> None: ...
    def tell_peers(self, body: pm.PeerBody, bufs: list[Any] | None = None) -> None: ...
    def drain(self) -> None: ...
    def pump(self, done: Callable[[], bool], what: Callable[[], str]) -> None: ...
    def forget(self, step: int) -> None: ...


log = get_logger(__name__)

WINDOW_BYTES = 64 << 20
"""Fragments held at once during a rebuild, besides the output."""

REPLY_MAX_BYTES = 256 << 20
"""Most buffer bytes of replies queued for one peer (a rebuild asks for WINDOW_BYTES)."""

REPLY_MAX_MESSAGES = 65536
"""Most replies queued for one peer."""

MAX_MANIFEST_BYTES = 4 << 20
"""Largest manifest a peer may send (JSON of a node's ranks' layouts)."""

MAX_HELD_REQUESTS = 1024
"""Most requests kept while the generation's sync has not decided who rebuilds."""

ASK_AGAIN_S = 15.0
"""A fetch or sizes request unanswered this long is sent to the same node again (a reply is
lost with a data-channel connection that broke); a reply that then comes twice is ignored.
The rebuild as a whole stays bounded by the protector's timeout."""

_HOLD = "hold"


def manifest_of(bufs: tuple[memoryview, ...]) -> bytes:
    """The manifest a SIZE or META reply carries (b""; ProtocolError over MAX_MANIFEST_BYTES)."""
    if bufs and bufs[0].nbytes > MAX_MANIFEST_BYTES:
        raise ProtocolError(f"a manifest of {bufs[0].nbytes} bytes")
    return bytes(bufs[0]) if bufs else b""


@dataclass(frozen=True, slots=True)
class RebuildMeta:
    """What a survivor said of a step a node rebuilds: every node's size, the rebuilt node's
    manifest and the seal it made of the step (checked before anything is allocated)."""

    step: int
    sizes: dict[int, int]
    manifest: bytes
    seal: seals.Seal


class Rebuilder:
    """Fetches a lost node's fragments and answers other nodes' fetches (module docstring).

    Error handling: waits are the protector's (bounded by its ``timeout_s``); a fetch of
    something this node does not hold is answered empty, which the asking node counts as lost.
    """

    def __init__(self, protector: RebuildOwner) -> None:
        self.p = protector
        self.refused = 0
        """Requests refused: from a node not being rebuilt, or outside a rebuild."""
        self._gate: dict[int, int] | str | None = None
        """None: serve the group; _HOLD: keep requests; else node -> the step it rebuilds."""
        self._reset()

    def _reset(self) -> None:
        self._fetched: dict[tuple[int, int, int], bytes] = {}
        self._asked: dict[tuple[int, int, int], tuple[int, pm.FetchRequest, float]] = {}
        """Fragment awaited -> the node asked for it, the request and when it was last sent
        (asked again once if refused, and whenever unanswered for ``ASK_AGAIN_S``)."""
        self._asked_again: set[tuple[int, int, int]] = set()
        self._answered: set[tuple[int, int, int]] = set()
        """Fragments whose reply came (a second reply to a repeated request is ignored)."""
        self._refused_lost: set[tuple[int, int, int]] = set()
        self._meta: dict[int, tuple[pm.MetaReply, bytes] | None] = {}
        """Step whose sizes were asked for -> the reply (None until it comes; a second
        reply, to a request asked again, is ignored)."""
        self._sums: dict[tuple[int, int], tuple[int, ...]] = {}
        self._held: list[tuple[int, pm.MetaRequest | pm.FetchRequest]] = []
        self._refused_from: set[int] = set()

    def clear(self) -> None:
        """Forget pending fetches and sizes (the group was reconfigured); a restricted
        rebuilder holds requests again until the new generation's sync decides."""
        self._reset()
        if self._gate is not None:
            self._gate = _HOLD

    # -- survivor side: who is served --------------------------------------------------------
    def hold(self) -> None:
        """Keep requests (bounded) until :meth:`serve_only` (see the module docstring)."""
        self._gate = _HOLD

    def serve_only(self, step: int | None, nodes: frozenset[int] | set[int]) -> None:
        """Serve ``step`` to ``nodes`` only (None or no nodes: nobody); answer or refuse the
        requests kept meanwhile."""
        self._gate = {n: step for n in nodes if n != self.p.me} if step is not None else {}
        held, self._held = self._held, []
        for sender, body in held:
            self.request(sender, body)

    def serving(self) -> dict[int, int]:
        """The nodes served a rebuild now, each with the step it rebuilds (empty while
        requests are held, or while the whole group is served)."""
        return dict(self._gate) if isinstance(self._gate, dict) else {}

    def rebuilt(self, sender: int, step: int) -> None:
        """``sender`` holds ``step`` again (its HELD): it is served no more."""
        if isinstance(self._gate, dict) and self._gate.get(sender) == step:
            del self._gate[sender]

    def request(self, sender: int, body: pm.MetaRequest | pm.FetchRequest) -> None:
        """A peer's META or FETCH: answered, kept for later, or refused (module docstring)."""
        gate = self._gate
        if gate == _HOLD:
            if len(self._held) >= MAX_HELD_REQUESTS:
                self._refuse(sender, body, "too many requests before the sync decided")
            else:
                self._held.append((sender, body))
            return
        if isinstance(gate, dict) and gate.get(sender) != body.step:
            self._refuse(sender, body, "it is not rebuilding that step")
            return
        queued, nbytes = self.p.queued_for(sender)
        if queued >= REPLY_MAX_MESSAGES or nbytes >= REPLY_MAX_BYTES:
            self._refuse(sender, body, f"{queued} replies ({nbytes} bytes) already queued")
            return
        if isinstance(body, pm.MetaRequest):
            self.serve_meta(sender, body.step)
        else:
            self.serve_fetch(sender, body)

    def _refuse(self, sender: int, body: pm.MetaRequest | pm.FetchRequest, why: str) -> None:
        self.refused += 1
        self.p.dropped += 1
        if sender not in self._refused_from:
            self._refused_from.add(sender)
            log.warning(
                "[%d] refused a %r of step %d from node %d: %s (further ones not logged)",
                self.p.me,
                body.KIND.value,
                body.step,
                sender,
                why,
            )

    def serve_meta(self, sender: int, step: int) -> None:
        """Answer META: the step's sizes (if protected here), the asker's own manifest and
        the seal it made of the step."""
        st = self.p.table.steps.get(step) or StepState()
        sizes = dict(st.sizes) if st.held_sent else {}
        mark = st.seals.get(sender, seals.Seal())
        reply = pm.MetaReply(step, sizes, mark.digest, mark.tag)
        self.p.send(sender, reply, [st.manifests.get(sender, b"")])

    def serve_fetch(self, sender: int, b: pm.FetchRequest) -> None:
        """Answer FETCH with the data range or parity fragment (empty if not held here)."""
        st = self.p.table.steps.get(b.step)
        reply = pm.FetchReply(b.step, b.stripe, b.frag)
        payload: Any = None
        if st is not None and b.kind is FragmentKind.DATA and st.data is not None:
            try:
                payload = st.data.read(b.offset, b.length)
            except ValueError as exc:
                raise ProtocolError(f"fetch of step {b.step}: {exc}") from exc
        elif st is not None and b.kind is not FragmentKind.DATA:
            payload = st.parity.get((b.stripe, b.frag))
            sums = st.checksums.get(b.stripe) or ()
            reply = pm.FetchReply(b.step, b.stripe, b.frag, tuple(sums))
        if payload is None:
            log.warning(
                "[%d] fetch of %s of step %d I do not hold, from %d",
                self.p.me,
                "data" if b.kind is FragmentKind.DATA else "parity",
                b.step,
                sender,
            )
            self.p.send(sender, pm.FetchReply(b.step, b.stripe, b.frag))
            return
        self.p.send(sender, reply, [payload])

    # -- lost node side: replies ---------------------------------------------------------------
    def on_meta(self, b: pm.MetaReply, bufs: tuple[memoryview, ...]) -> None:
        """A survivor's sizes of a step, this node's manifest and seal (only if asked for)."""
        if b.step not in self._meta:
            raise ProtocolError(f"sizes of step {b.step} nobody asked for")
        if self._meta[b.step] is None:
            self._meta[b.step] = (b, manifest_of(bufs))

    def on_fetched(self, b: pm.FetchReply, bufs: tuple[memoryview, ...]) -> None:
        """A fetched fragment (empty: the holder no longer has it); only one asked for."""
        key = (b.step, b.stripe, b.frag)
        if key not in self._asked:
            if key in self._answered:  # the reply to a request asked again
                log.debug("[%d] fragment %s came twice: ignored", self.p.me, key)
                return
            raise ProtocolError(f"fragment {key} nobody asked for")
        self._answered.add(key)
        del self._asked[key]
        self._asked_again.discard(key)
        if not bufs:  # the holder no longer has it
            self._fetched[key] = b""
            return
        if b.sums:
            self._sums[(b.step, b.stripe)] = b.sums
        self._fetched[key] = bytes(bufs[0])

    def on_refused(self, sender: int, b: pm.FetchReply) -> None:
        """A reply to one of this node's fetches was refused for a wrong tag (altered on the
        data channel, or forged): the holder is asked once more; refused again, the fragment
        counts as lost, so the stripe is retried with spare fragments (or, with none, the
        rebuild fails naming the stripe). What the refused message claimed is not trusted
        beyond that: at worst a forger makes a rebuild use spares or fail, never take its
        bytes."""
        key = (b.step, b.stripe, b.frag)
        asked = self._asked.get(key)
        if asked is None or asked[0] != sender:
            return
        if key not in self._asked_again:
            self._asked_again.add(key)
            log.warning(
                "[%d] fragment %s from node %d was refused (wrong tag): asking again",
                self.p.me,
                key,
                sender,
            )
            self._asked[key] = (sender, asked[1], time.monotonic())
            self.p.send(sender, asked[1])
            return
        log.warning(
            "[%d] fragment %s from node %d was refused twice (wrong tag): counted lost",
            self.p.me,
            key,
            sender,
        )
        del self._asked[key]
        self._fetched[key] = b""
        self._refused_lost.add(key)

    # -- lost node side: the rebuild -----------------------------------------------------------
    def rebuild(
        self,
        step: int,
        lost: set[int] | frozenset[int],
        source: int,
        accept: Callable[[RebuildMeta], None] | None = None,
    ) -> memoryview:
        """Rebuild this (lost) node's snapshot of ``step`` and its parity, from the survivors.

        ``source`` is a survivor asked for the step's sizes and this node's manifest. Before
        anything is allocated the sizes are bounded, the lost node's seal of the step is
        checked (with a key file: seals.py) and ``accept`` (if given) may refuse what the
        survivor sent by raising. Returns the snapshot bytes, which matched the sealed digest;
        the rebuilt parity is held as if this node had protected the step itself (and its
        peers are told: HELD). A fetched fragment that fails its checksum counts as lost: the
        stripe is retried with every other surviving fragment.

        Raises:
            UnrecoverableError: more than m nodes of the group are lost, the source does not
                hold the step, its sizes are out of range, the seal or the digest does not
                match, or too few fragments of a stripe are intact.
            TimeoutError: a survivor did not answer in time.
            Whatever ``accept`` raises.
        """
        p = self.p
        meta = self._sizes(step, source)
        if accept is not None:
            accept(meta)
        sizes = meta.sizes
        stripes = stripe_map(p.plan, sizes, p.stripe_bytes)
        mine = rebuild_plan(p.plan, stripes, lost).for_node(p.me)
        out = bytearray(sizes.get(p.me, 0))
        st = p.table.get(step)
        st.sizes = dict(sizes)
        st.manifests[p.me] = meta.manifest
        st.seals[p.me] = meta.seal
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
        if meta.seal.digest and seals.digest_of(SegmentedBytes([out])) != meta.seal.digest:
            p.forget(step)
            raise UnrecoverableError(
                f"the rebuilt bytes of step {step} do not match the digest node {p.me} "
                "committed when it protected the step: refusing them"
            )
        st.data = SegmentedBytes([out])
        st.held = set(p.plan.nodes)
        st.held_sent = True
        p.tell_peers(pm.Held(step))  # done: the survivors stop serving this node
        p.drain()
        return memoryview(out)

    def _sizes(self, step: int, source: int) -> RebuildMeta:
        """Every node's snapshot size of ``step``, this node's manifest and seal, asked of
        ``source`` and checked (module docstring) before anything is allocated."""
        p = self.p
        self._meta[step] = None
        p.send(source, pm.MetaRequest(step))
        asked = time.monotonic()

        def done() -> bool:
            nonlocal asked
            if self._meta.get(step) is not None:
                return True
            if time.monotonic() - asked >= ASK_AGAIN_S:
                log.warning(
                    "[%d] no sizes of step %d from node %d: asking again", p.me, step, source
                )
                asked = time.monotonic()
                p.send(source, pm.MetaRequest(step))
            return False

        p.pump(done, lambda: f"no sizes of step {step} from node {source}")
        got = self._meta[step]
        assert got is not None  # done() saw it
        reply, manifest = got
        sizes = reply.sizes
        if set(sizes) != set(p.plan.nodes):
            raise UnrecoverableError(f"node {source} does not hold step {step}")
        big = {n: v for n, v in sizes.items() if v > p.max_node_bytes}
        if big:
            raise UnrecoverableError(
                f"node {source} says step {step} has sizes {big} over the bound of "
                f"{p.max_node_bytes} bytes per node: refusing to rebuild from it"
            )
        seal = seals.Seal(reply.digest, reply.tag)
        job = p.transport.job_keys
        if job is None or not job.from_file:  # with a key file, the seal must be its own
            log.warning(
                "[%d] step %d: no key file, so the seal this node made of it cannot be "
                "checked; the rebuilt bytes are checked against the digest its peers kept",
                p.me,
                step,
            )
        elif not seals.check(job, p.me, step, sizes[p.me], manifest, seal):
            raise UnrecoverableError(
                f"the manifest, size or digest of step {step} that node {source} kept for "
                f"node {p.me} do not carry node {p.me}'s seal: refusing to rebuild from them"
            )
        return RebuildMeta(step, sizes, manifest, seal)

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

        def reconstruct() -> dict[int, bytes]:
            return self.p.codec.reconstruct(
                frags, sr.rebuild, chunk_bytes=s.chunk_bytes, lengths=s.lengths, checksums=sums
            ).fragments

        try:
            got = reconstruct()
        except UnrecoverableError as exc:
            used = set(frags) | set(sr.rebuild)
            spares = [f for f in survivors(s, lost) if f.fragment not in used]
            log.warning(
                "[%d] step %d stripe %d: %s; retrying with %d more fragments",
                self.p.me,
                step,
                s.index,
                exc,
                len(spares),
            )
            if not spares:
                refused = sorted(k[2] for k in self._refused_lost if k[:2] == (step, s.index))
                if refused:
                    raise UnrecoverableError(
                        f"{exc}; fragments {refused} of stripe {s.index} of step {step} were "
                        "refused twice for a wrong tag (altered on the data channel, or forged)"
                    ) from exc
                raise
            self._fetch(step, s, spares)
            self._wait_fetched(step, {(step, s.index, f.fragment) for f in spares})
            frags.update(
                {f.fragment: self._fetched.pop((step, s.index, f.fragment)) for f in spares}
            )
            sums = self._sums.pop((step, s.index), sums)
            got = reconstruct()
        for frag, payload in got.items():
            if frag < s.k:
                c = s.columns[frag]
                out[c.offset : c.offset + c.length] = payload[: c.length]
            else:
                st.parity[(s.index, frag)] = payload
        if sums is not None:
            st.checksums[s.index] = sums

    def _fetch(self, step: int, stripe: StripePlan, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            key = (step, stripe.index, f.fragment)
            body = pm.FetchRequest(step, stripe.index, f.fragment, f.kind, f.offset, f.length)
            self._asked[key] = (f.node, body, time.monotonic())
            self._asked_again.discard(key)
            self._answered.discard(key)
            self.p.send(f.node, body)

    def _ask_again(self) -> None:
        """Send again each fetch unanswered for ``ASK_AGAIN_S`` (to the node asked before)."""
        now = time.monotonic()
        for key, (node, body, at) in list(self._asked.items()):
            if now - at < ASK_AGAIN_S:
                continue
            log.warning(
                "[%d] fragment %s from node %d unanswered for %.0f s: asking again",
                self.p.me,
                key,
                node,
                now - at,
            )
            self._asked[key] = (node, body, now)
            self.p.send(node, body)

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
            self._ask_again()
            n = len(self._fetched)
            now = time.monotonic()
            if on_progress is not None and now - last[0] >= 1.0:
                last[0] = now
                on_progress(step, base + min(n, total), overall)
            return n >= total and wanted <= self._fetched.keys()

        self.p.pump(
            done, lambda: f"{len(wanted - set(self._fetched))} fragments of step {step} missing"
        )
