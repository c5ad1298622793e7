"""GroupProtector: the erasure-coding protocol of one node of a group, over a PeerTransport.

Protect (every node of the group calls :meth:`GroupProtector.protect` for the same step):

1. SIZE: each node tells every peer its snapshot's size, its *manifest* (what the bytes are:
   ranks and layouts, opaque here; every peer keeps it for a rebuild) and its seal
   (seals.py); with all sizes known every node derives the same stripe map.
2. DATA: for each stripe where it is a data column with real bytes, a node sends that byte
   range to the stripe's encoder (its first parity holder).
3. PARITY: an encoder with all real columns of a stripe encodes it (in this thread, or in
   worker processes with ``encode_workers``: encode_pool.py), keeps its own parity fragment
   and sends the others, with the stripe's k+m checksums, to their holders.
4. HELD: a node that holds every parity fragment it owes for the step tells every peer; the
   step is *protected* on a node once it has seen HELD from the whole group.

Rebuild (rebuilder.py): a node that lost its memory calls ``rebuilder.rebuild``; survivors
keep calling :meth:`serve`, which answers its requests.

Every header carries the protector's *epoch* (the launcher's generation): after
:meth:`reconfigure`, late messages of an earlier epoch are dropped. A node that cannot take
part in a step's protection sends ABORT; every node then gives the step up
(:class:`StepAborted`).

One thread owns a protector and its transport. The snapshot bytes are the caller's: the
protector reads them until :meth:`forget` of that step. Messages are the typed dataclasses of
:mod:`ftmem.protocol.peer`; kinds the protector does not know go to ``on_other`` (the SMP's
own agreement messages).

Bounds: no peer can grow this node's memory without limit: a peer's size is at most
``max_node_bytes``, its manifest at most ``MAX_MANIFEST_BYTES``, replies queued for a peer at
most ``REPLY_MAX_BYTES`` (rebuilder.py), and the steps, columns and parity kept are bounded by
the step table (steps.py). Anything beyond is dropped and counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ftmem import faults
from ftmem._logging import get_logger
from ftmem.errors import FtmemError, ProtocolError
from ftmem.exchange.codec import EncodedStripe, StripeCodec
from ftmem.exchange.encode_pool import EncodePool, StripeEncoder
from ftmem.exchange.placement import GroupPlan, StripePlan, chunk_bytes_for, stripe_map
from ftmem.exchange.rebuilder import Rebuilder, manifest_of
from ftmem.exchange.seals import Seal, digest_of, seal
from ftmem.exchange.segments import Buffer, SegmentedBytes
from ftmem.exchange.steps import (
    MAX_UNPLANNED_BYTES,
    StepState,
    StepTable,
    physical_memory,
)
from ftmem.exchange.transport import PeerTransport
from ftmem.protocol import peer as pm
from ftmem.protocol.peer import Envelope, PeerMessage

log = get_logger(__name__)

REFUSED_GRACE_S = 3.0
"""How long a step being protected waits, after one of its messages was refused for a wrong
tag, for something valid to come before it is given up (see ``_give_up_refused``)."""


class StepAborted(FtmemError):
    """A node of the group gave up protecting this step (its data was gone, or it failed)."""


class ExchangeInterrupted(FtmemError):
    """The caller's ``interrupted()`` became true during a wait (e.g. the group changed)."""


class GroupProtector:
    """Protects this node's snapshots with its group (see the module docstring).

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
        on_other: Callable[[Envelope], None] | None = None,
        interrupted: Callable[[], bool] | None = None,
        on_progress: Callable[[int, int, int], None] | None = None,
        max_node_bytes: int | None = None,
        max_unplanned_bytes: int = MAX_UNPLANNED_BYTES,
        encode_workers: int = 0,
    ) -> None:
        if me not in plan.nodes:
            raise ValueError(f"node {me} is not in group {plan.nodes}")
        self.me = me
        self.plan = plan
        self.transport = transport
        self.stripe_bytes = stripe_bytes
        self.timeout_s = timeout_s
        self.codec = StripeCodec(plan.k, plan.m)
        self.table = StepTable(me, max_unplanned_bytes, self.codec.header_bytes)
        self.steps: dict[int, StepState] = self.table.steps
        """Every step tracked, by step (the table's dict)."""
        self.epoch = epoch
        self.on_other = on_other
        self.interrupted = interrupted or (lambda: False)
        self.on_progress = on_progress
        """Called about once a second during a rebuild: (step, fragments in, fragments needed)."""
        self.max_node_bytes = (
            max_node_bytes
            if max_node_bytes is not None
            else min(pm.MAX_NODE_BYTES, physical_memory())
        )
        """Largest snapshot of a node accepted from a peer (SIZE, META): by default this
        machine's memory, beyond which it could not hold the node's parity nor a rebuild."""
        self.dropped = 0
        self.sent_bytes = 0
        """Buffer bytes handed to the transport so far (headers not counted)."""
        self._outbox: dict[int, deque[tuple[dict[str, Any], list[Any]]]] = {}
        """Per-peer FIFO of (header, buffers) not sent yet (:meth:`send`)."""
        self._outbox_bytes: dict[int, int] = {}
        self.rebuilder = Rebuilder(self)
        """Both ends of a lost node's rebuild (rebuilder.py)."""
        self._encoder = StripeEncoder(
            self.codec, encode_workers, chunk_bytes_for(plan.k, stripe_bytes)
        )

    def queued_for(self, node: int) -> tuple[int, int]:
        """(messages, buffer bytes) queued for ``node`` and not sent yet: what answering a
        peer's requests may add to is bounded by the caller on these."""
        box = self._outbox.get(node)
        return (len(box), self._outbox_bytes.get(node, 0)) if box else (0, 0)

    def tell_peers(self, body: pm.PeerBody, bufs: list[Any] | None = None) -> None:
        """:meth:`send` ``body`` to every other node of the group."""
        for n in self.plan.nodes:
            if n != self.me:
                self.send(n, body, bufs)

    def send(self, node: int, body: pm.PeerBody, bufs: list[Any] | None = None) -> None:
        """Queue a message (the protocol's, or a small one of the owner's own, ordered with
        them); :meth:`flush` (called by every wait) sends it without blocking, so a node never
        stalls on a busy peer while that peer stalls on it."""
        bufs = bufs or []
        self._outbox.setdefault(node, deque()).append((body.to_header(self.epoch), bufs))
        nbytes = sum(memoryview(b).nbytes for b in bufs)
        self._outbox_bytes[node] = self._outbox_bytes.get(node, 0) + nbytes

    def flush(self) -> bool:
        """Send, in order, what each peer can take now; True when nothing is left queued.
        A peer the transport refuses (FtmemError) loses its queued messages (logged)."""
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
                n = sum(memoryview(b).nbytes for b in bufs)
                self.sent_bytes += n
                self._outbox_bytes[node] -= n
            if not box:
                del self._outbox[node]
                self._outbox_bytes.pop(node, None)
        return not self._outbox

    def drain(self) -> None:
        """Wait (bounded by ``timeout_s``, serving peers meanwhile) until every queued message
        is sent: a node that returns from :meth:`protect` may owe its peers their HELD."""
        self.pump(self.flush, lambda: f"{sum(map(len, self._outbox.values()))} messages unsent")

    @property
    def encode_pool(self) -> EncodePool | None:
        """The encode pool (None without ``encode_workers``)."""
        return self._encoder.pool

    def close(self) -> None:
        """Stop the encode workers (bounded); the protector is not used afterwards."""
        self._encoder.close()

    def reconfigure(self, transport: PeerTransport, epoch: int) -> None:
        """Use ``transport`` from now on and drop messages of earlier epochs.

        Held steps (data, parity, checksums, manifests) are kept: they serve the rebuild.
        Steps not yet protected are given up, as are pending fetches.
        """
        self.transport = transport
        self.epoch = epoch
        self._outbox.clear()  # stale
        self._outbox_bytes.clear()
        self._encoder.drop_queued()  # their steps are given up below; late results are dropped
        for step in [s for s, st in self.steps.items() if not st.held_sent]:
            self.forget(step)
        self.rebuilder.clear()

    def _plan_stripes(self, step: int) -> None:
        st = self.steps[step]
        if st.stripes is None and len(st.sizes) == len(self.plan.nodes):
            st.stripes = {s.index: s for s in stripe_map(self.plan, st.sizes, self.stripe_bytes)}
            assert st.data is not None
            self.table.keep_planned(st)
            # Bookkeeping per stripe, so each message costs O(1), not O(stripes).
            st.owed_left = {
                (s.index, s.k + t)
                for s in st.stripes.values()
                for t, h in enumerate(s.holders)
                if h == self.me and (s.index, s.k + t) not in st.parity
            }
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
                        self.send(s.encoder, pm.Data(step, s.index, col), [piece])
            for index in [i for i, n in st.missing.items() if n == 0]:
                self._progress(step, index)
            self._progress(step, None)

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
            self.tell_peers(pm.Held(step))

    def _encode(self, step: int, s: StripePlan) -> None:
        """Encode stripe ``s`` now, or hand it to the encode workers (its parity is then kept
        and sent when it comes back: :meth:`_collect_encoded`)."""
        faults.maybe_inject(faults.Point.IN_ENCODE, self.me, step)
        st = self.steps[step]
        st.encoded.add(s.index)
        enc = self._encoder.encode(
            (self.epoch, step, s.index),
            s,
            lambda buf: self._gather(st, s, buf),
            lambda: self.steps.get(step) is st and not st.aborted,
        )
        if enc is not None:
            self._encoded(step, s, enc)

    @staticmethod
    def _gather(st: StepState, s: StripePlan, buf: memoryview) -> None:
        """Move stripe ``s``'s received columns into ``buf``, zero-padded."""
        zero = bytes(s.chunk_bytes)
        for col in range(s.k):
            piece = st.columns.pop((s.index, col), b"")
            start = col * s.chunk_bytes
            buf[start : start + s.chunk_bytes] = zero
            buf[start : start + len(piece)] = piece

    def _encoded(self, step: int, s: StripePlan, enc: EncodedStripe) -> None:
        """Keep this node's parity of ``s`` and send the others to their holders."""
        st = self.steps[step]
        st.checksums[s.index] = enc.checksums
        for t, holder in enumerate(s.holders):
            frag = s.k + t
            if holder == self.me:
                st.parity[(s.index, frag)] = enc.parity[t]
                if st.owed_left is not None:
                    st.owed_left.discard((s.index, frag))
            else:
                body = pm.Parity(step, s.index, frag, tuple(enc.checksums))
                self.send(holder, body, [enc.parity[t]])

    def _collect_encoded(self) -> None:
        """Keep and send the parity of the stripes the workers finished."""
        for (epoch, step, index), enc in self._encoder.ready():
            st = self.steps.get(step)
            if epoch != self.epoch or st is None or st.stripes is None:
                continue  # its step was forgotten or the generation changed
            self._encoded(step, st.stripes[index], enc)
            self._progress(step, None)

    def handle(self, msg: PeerMessage | Envelope) -> None:
        """Act on one peer message (the caller's loop received it).

        A raw :class:`PeerMessage` is validated first. Malformed messages, messages of an
        earlier epoch, from outside the group or that do not fit this node's state are logged,
        counted in ``dropped`` and ignored; a message of a newer epoch, and the service's own
        kinds, go to ``on_other``. Never raises for anything a peer sent.
        """
        if isinstance(msg, PeerMessage):
            try:
                env = Envelope.parse(msg)
            except ProtocolError as exc:
                self.dropped += 1
                log.warning(
                    "[%d] ignoring a malformed peer message from %r: %s", self.me, msg.sender, exc
                )
                return
        else:
            env = msg
        if env.epoch > self.epoch and self.on_other is not None:
            self.on_other(env)  # a newer generation: the owner keeps it for later
            return
        if env.epoch != self.epoch:
            self.dropped += 1
            log.debug("[%d] dropped a message of epoch %d (now %d)", self.me, env.epoch, self.epoch)
            return
        if env.sender not in self.plan.nodes or env.sender == self.me:
            self.dropped += 1
            log.warning(
                "[%d] ignoring a message from node %d outside the group", self.me, env.sender
            )
            return
        try:
            self._dispatch(env)
        except (ProtocolError, KeyError, TypeError, ValueError, IndexError, AssertionError) as exc:
            self.dropped += 1
            log.warning(
                "[%d] ignoring a bad %r message from %d: %r",
                self.me,
                env.kind.value,
                env.sender,
                exc,
            )

    def _dispatch(self, env: Envelope) -> None:
        sender, bufs = env.sender, env.buffers
        match env.body:
            case pm.Size() as b:
                self._on_size(sender, b, bufs)
            case pm.Data() as b:
                self._on_data(b, bufs[0])
            case pm.Parity() as b:
                self._on_parity(b, bufs[0])
            case pm.Held() as b:
                self.table.for_peer(b.step).held.add(sender)
                self.rebuilder.rebuilt(sender, b.step)
            case pm.Abort() as b:
                if b.step in self.steps and not self.steps[b.step].held >= set(self.plan.nodes):
                    self.steps[b.step].aborted = True
            case pm.MetaRequest() | pm.FetchRequest() as b:
                self.rebuilder.request(sender, b)
            case pm.MetaReply() as b:
                self.rebuilder.on_meta(b, bufs)
            case pm.FetchReply() as b:
                self.rebuilder.on_fetched(b, bufs)
            case _:  # the service's own kinds
                if self.on_other is None:
                    raise ProtocolError(f"unexpected kind {env.kind.value!r}")
                self.on_other(env)

    def _on_size(self, sender: int, b: pm.Size, bufs: tuple[memoryview, ...]) -> None:
        if b.nbytes > self.max_node_bytes:
            raise ProtocolError(f"a size of {b.nbytes} bytes, over {self.max_node_bytes}")
        manifest = manifest_of(bufs)
        st = self.table.for_peer(b.step)
        if st.stripes is not None and st.sizes.get(sender) != b.nbytes:
            raise ProtocolError(f"a new size of step {b.step} after its stripe map was made")
        st.sizes[sender] = b.nbytes
        st.manifests[sender] = manifest
        st.seals[sender] = Seal(b.digest, b.tag)
        st.progress_at = time.monotonic()
        if st.data is not None:
            self._plan_stripes(b.step)

    def _on_data(self, b: pm.Data, piece: memoryview) -> None:
        key = (b.stripe, b.col)
        st = self.table.for_peer(b.step)
        if key in st.columns:
            raise ProtocolError(f"column {key} of step {b.step} again")
        if st.stripes is None:
            self.table.keep_unplanned(st, piece.nbytes)
        elif self.table.column_len(st, *key) != piece.nbytes:
            raise ProtocolError(f"column {key} of step {b.step} is not one this node encodes")
        st.columns[key] = bytes(piece)
        st.progress_at = time.monotonic()
        if b.stripe in st.missing:
            st.missing[b.stripe] -= 1
            self._progress(b.step, b.stripe)

    def _on_parity(self, b: pm.Parity, fragment: memoryview) -> None:
        st = self.table.for_peer(b.step)
        key = (b.stripe, b.frag)
        if key in st.parity:
            raise ProtocolError(f"parity {key} of step {b.step} again")
        if st.stripes is None:
            self.table.keep_unplanned(st, fragment.nbytes)
        elif self.table.parity_len(st, *key) != fragment.nbytes or (
            st.owed_left is not None and key not in st.owed_left
        ):
            raise ProtocolError(f"parity {key} of step {b.step} is not one this node holds")
        st.parity[key] = bytes(fragment)
        st.progress_at = time.monotonic()
        st.checksums[b.stripe] = b.sums
        if st.owed_left is not None:
            st.owed_left.discard(key)
        self._progress(b.step, None)

    def pump(self, done: Callable[[], bool], what: Callable[[], str]) -> None:
        """Send, receive and handle peer messages until ``done()``; ``what()`` says what is
        missing in the error.

        Raises:
            ExchangeInterrupted: ``interrupted()`` became true.
            TimeoutError: not done within ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if self.interrupted():
                raise ExchangeInterrupted(f"node {self.me}: interrupted while {what()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"node {self.me}: {what()} after {self.timeout_s} s")
            self._turn(min(left, 0.5))
            for notice in self.transport.take_refused():
                self._on_refused(notice)
            self._give_up_refused()

    def _give_up_refused(self) -> None:
        """Give up (here and, with ABORT, at every peer) each step being protected that had a
        message refused and has received nothing valid for ``REFUSED_GRACE_S`` since: the
        refused one was then most likely the real one, altered on the way. A forged message
        (anyone can reach the data channel) aborts nothing while the real ones keep coming."""
        now = time.monotonic()
        for step, st in list(self.steps.items()):
            if st.refused_at is None or st.held_sent or st.aborted:
                continue
            if not _waits_for_peers(st):
                st.refused_at = None  # it has what it needs: the refused one was not needed
                continue
            if now - max(st.refused_at, st.progress_at) < REFUSED_GRACE_S:
                continue
            log.warning(
                "[%d] step %d had a message refused (wrong tag) and nothing valid came for "
                "%.0f s: giving the step up",
                self.me,
                step,
                REFUSED_GRACE_S,
            )
            st.aborted = True
            self.tell_peers(pm.Abort(step))
            self.flush()  # now: protect() raises StepAborted next, its caller may not pump

    def _on_refused(self, notice: PeerMessage) -> None:
        """A message the transport refused (wrong tag): a fetched fragment is asked for
        again, then counted lost (Rebuilder.on_refused); a size, column or parity fragment of
        a step being protected starts the step's grace (``_give_up_refused``). Anything else
        was only counted by the transport."""
        try:  # the header only: a refused message's buffers were not kept
            sender = pm.parse_sender(notice.sender)
            epoch, body = pm.parse_header(notice.header)
        except ProtocolError:
            return
        if epoch != self.epoch:
            return
        if isinstance(body, pm.FetchReply):
            self.rebuilder.on_refused(sender, body)
        elif isinstance(body, pm.Size | pm.Data | pm.Parity):
            st = self.steps.get(body.step)
            if st is None or st.held_sent or st.aborted or st.refused_at is not None:
                return
            st.refused_at = time.monotonic()
            log.warning(
                "[%d] a %r of step %d claiming node %d was refused (wrong tag): the step is "
                "given up if nothing valid comes within %.0f s",
                self.me,
                body.KIND.value,
                body.step,
                sender,
                REFUSED_GRACE_S,
            )

    def protect(self, step: int, data: SegmentedBytes | Buffer, manifest: bytes = b"") -> None:
        """Protect this node's snapshot ``data`` of ``step`` with the group; return when protected.

        Raises:
            StepAborted: a node gave the step up (the caller may :meth:`abort` it too).
            TimeoutError: the group did not finish within ``timeout_s``.
            ExchangeInterrupted: ``interrupted()`` became true.
        """
        st = self.table.get(step)
        st.data = SegmentedBytes.of(data)
        st.sizes[self.me] = st.data.nbytes
        st.manifests[self.me] = manifest
        job = self.transport.job_keys
        mine = (
            seal(job, self.me, step, st.data.nbytes, digest_of(st.data), manifest)
            if job is not None
            else Seal()
        )
        st.seals[self.me] = mine
        self.tell_peers(pm.Size(step, st.data.nbytes, mine.digest, mine.tag), [manifest])
        self._plan_stripes(step)

        def done() -> bool:
            if st.aborted:
                raise StepAborted(f"step {step} was given up by a node of the group")
            return st.held >= set(self.plan.nodes)

        self.pump(
            done,
            lambda: (
                f"step {step} not protected (held by {sorted(st.held)}, sizes from {sorted(st.sizes)})"
            ),
        )
        self.drain()

    def abort(self, step: int) -> None:
        """Give ``step`` up here and tell every peer to give it up too."""
        self.tell_peers(pm.Abort(step))
        self.forget(step)

    def held_steps(self) -> list[int]:
        """Steps whose own data and owed parity this node holds (it told the group HELD)."""
        return sorted(s for s, st in self.steps.items() if st.held_sent and st.data is not None)

    def is_protected(self, step: int) -> bool:
        """True once every node of the group holds its parity of ``step``."""
        st = self.steps.get(step)
        return st is not None and st.held >= set(self.plan.nodes)

    def serve(self, until: Callable[[], bool], poll_s: float = 0.2) -> None:
        """Answer peers (fetches, late protocol messages) until ``until()`` is true."""
        while not until():
            self._turn(poll_s)

    def _turn(self, longest: float) -> None:
        """Send what peers take, handle one message (waiting at most ``longest``) and keep
        the stripes the encode workers finished."""
        self.flush()
        wait = longest
        if self._encoder.busy:
            wait = min(longest, 0.0005)
        elif self._outbox:
            wait = min(longest, 0.002)
        msg = self.transport.recv(wait)
        if msg is not None:
            self.handle(msg)
        self._collect_encoded()

    def parity_bytes(self, step: int) -> int:
        """Parity bytes this node holds for ``step``."""
        st = self.steps.get(step)
        return sum(len(p) for p in st.parity.values()) if st else 0

    def forget(self, step: int) -> None:
        """Drop everything held for ``step`` (after a newer step is protected)."""
        self.table.forget(step)


def _waits_for_peers(st: StepState) -> bool:
    """Whether the step still needs something a peer sends: the sizes (before the stripes
    are known), data columns of a stripe this node encodes, or parity it must hold."""
    if st.stripes is None:
        return True
    return any(v > 0 for v in st.missing.values()) or bool(st.owed_left)
