"""ftmem's failure detector: heartbeats between the agents, a lost machine declared on corroboration.

elastic notices a lost machine only when its rendezvous keep-alive expires, and restarts the
survivors only when a node waits to join; a machine lost *silently* (no FIN, no RST) leaves its
peers' ranks blocked in a collective. This detector notices such a loss in about ``suspect_s``
(``--ftmem-tune detect-timeout``) and makes every agent restart at once (docs/launcher.md,
"Failure detection").

**Who watches whom.** The nodes of a round, in slot order, form a ring; each node exchanges
heartbeats with the nodes up to :data:`RADIUS` places away on either side (:func:`neighbours`),
so what a node sends and receives is bounded whatever the job's size.

**A watched peer's states** (per round; :meth:`FailureDetector.watch` starts a round)::

    ALIVE --no heartbeat for suspect_s--> SUSPECTED --corroborated--> DECLARED --published--> LOST
      ^------------- a heartbeat -------------'                          |
      '--------------------- the store cannot be reached ----------------'
    any state --a "leaving" heartbeat (its agent exits)--> DEPARTED (never suspected again)

**Corroboration** (:func:`verdicts`). A node declares a peer only if another neighbour of that
peer, one it still hears, suspects it too (each heartbeat carries the peers its sender
suspects and declared): a node that is itself cut off declares nobody. A peer with no other
observer (a job of two nodes) is declared on one silence, and the store decides.

**Declaring is publishing.** The declarer marks the peer's keep-alive in the rendezvous state as
expired (``publish``, :func:`ftmem.launch.state_guard.expire_keep_alive`), elastic's own
verdict: every agent's next read drops it. Only once that write succeeded is the loss acted on
(``on_lost``); a declarer that cannot reach the store tries again at the next heartbeat.

**Observer stalls.** If the detector's own thread wakes up later than half the bound (its process
starved), the silence it measured meanwhile is forgiven.

**Wire.** One UDP datagram per heartbeat (:class:`Heartbeat`): a 32-byte HMAC-SHA256 tag under a
key derived from the job's key, then a JSON body; a sender's sequence number must grow. UDP
rather than the SMPs' ZeroMQ mesh: a heartbeat must not queue behind snapshot traffic or TCP's
retransmissions, nor wait for the SMP's GIL-bound erasure coding, and the agent is the process
that acts on the verdict.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated

from ftmem import typed_json
from ftmem.errors import ProtocolError
from ftmem.typed_json import Most, Pattern, Range

log = logging.getLogger(__name__)

RADIUS = 2
"""Ring neighbours watched on each side (fan-out ``2 * RADIUS``)."""
BEATS_PER_BOUND = 5
"""Heartbeats sent per ``suspect_s``: a peer is suspected after this many are missed in a row."""
MAX_DATAGRAM = 8192
"""The largest heartbeat (tag included; up to 13 names of a fully qualified host name's length);
larger datagrams are dropped unread."""
MAX_NAMES = 2 * RADIUS + 2
"""Most peer names one heartbeat may list as suspected or declared."""
MAX_DRAIN = 256
"""Most datagrams read between two rounds of heartbeats (a flood cannot starve the sending)."""
TAG = 32
WIRE_VERSION = 2

PeerName = Annotated[str, Most(512), Pattern(r"[^\x00-\x1f]+")]
"""A node's rendezvous name in a heartbeat (host, pid, index: up to a long host name's length)."""


def neighbours(order: list[str], me: str, radius: int = RADIUS) -> list[str]:
    """The peers ``me`` exchanges heartbeats with: those up to ``radius`` places away on either
    side of the ring ``order`` (the round's nodes in slot order), without ``me`` or repeats."""
    if me not in order:
        return []
    n, i = len(order), order.index(me)
    out: list[str] = []
    for d in range(1, radius + 1):
        for j in (i + d, i - d):
            name = order[j % n]
            if name != me and name not in out:
                out.append(name)
    return out


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One heartbeat: who sends it, its sequence number, the peers it suspects and declared."""

    run: PeerName
    sender: PeerName
    seq: Annotated[int, Range(0, 2**62 - 1)]
    generation: int
    suspects: Annotated[tuple[PeerName, ...], Most(MAX_NAMES)] = ()
    lost: Annotated[tuple[PeerName, ...], Most(MAX_NAMES)] = ()
    leaving: bool = False
    """The sender's agent exits: stop watching it."""

    def encode(self, key: bytes) -> bytes:
        """The datagram: tag, then the JSON body (this dataclass's fields and ``v``)."""
        doc = {"v": WIRE_VERSION, **{f: getattr(self, f) for f in self.__slots__}}
        body = json.dumps(doc, separators=(",", ":")).encode()
        return hmac.new(key, body, hashlib.sha256).digest() + body

    @classmethod
    def decode(cls, key: bytes, data: bytes) -> Heartbeat:
        """The heartbeat in datagram ``data`` once its size, tag and fields are checked (by
        the one JSON reader, against this dataclass's annotations).

        Raises:
            ValueError: the datagram is too large, fails its tag, or is malformed.
        """
        if not TAG < len(data) <= MAX_DATAGRAM:
            raise ValueError(f"a datagram of {len(data)} bytes")
        tag, body = data[:TAG], data[TAG:]
        if not hmac.compare_digest(tag, hmac.new(key, body, hashlib.sha256).digest()):
            raise ValueError("its tag is wrong (not sent with this job's key)")
        try:
            doc = json.loads(body)
            if type(doc) is not dict or doc.pop("v", None) != WIRE_VERSION:
                raise ProtocolError("not a heartbeat of this version")
            beat: Heartbeat = typed_json.build(cls, doc, what="heartbeat")
        except (ValueError, RecursionError, ProtocolError) as exc:
            raise ValueError(f"a malformed heartbeat: {exc}") from exc
        return beat


@dataclass(frozen=True, slots=True)
class WatchEntry:
    """A node's entry in the rendezvous store for one round: its slot, its rendezvous name
    and the address of its detector."""

    generation: int
    slot: Annotated[int, Range(0, 1 << 20)]
    node: PeerName
    addr: tuple[Annotated[str, Most(256)], Annotated[int, Range(0, 65535)]]


@dataclass(frozen=True, slots=True)
class _Signed:
    """A store entry: its body (JSON text) and the body's MAC."""

    entry: Annotated[str, Most(4096)]
    mac: Annotated[str, Most(64)]


def _watch_mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, b"watch-entry" + body, hashlib.sha256).hexdigest()


def watch_entry(key: bytes, generation: int, slot: int, node: str, addr: tuple[str, int]) -> str:
    """Node ``slot``'s entry (JSON) for round ``generation``, authenticated with ``key``."""
    doc = {"generation": generation, "slot": slot, "node": node, "addr": list(addr)}
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return json.dumps({"entry": body, "mac": _watch_mac(key, body.encode())})


def read_watch_entry(key: bytes, raw: bytes, generation: int, slot: int) -> WatchEntry:
    """The entry of node ``slot`` for round ``generation`` read back from the store, once its
    MAC, round and slot are checked.

    Raises:
        ValueError: the entry is malformed, fails its MAC, or is of another round or slot.
    """
    try:
        signed = typed_json.parse(_Signed, raw, what="detector entry")
        if not hmac.compare_digest(signed.mac, _watch_mac(key, signed.entry.encode())):
            raise ValueError(
                f"the store's detector entry of node {slot} fails its authentication (not "
                "written with this job's key)"
            )
        entry = typed_json.parse(WatchEntry, signed.entry.encode(), what="detector entry")
    except ProtocolError as exc:
        raise ValueError(f"the store's detector entry of node {slot} is malformed: {exc}") from exc
    if entry.generation != generation or entry.slot != slot:
        raise ValueError(
            f"the store's detector entry of node {slot} is of generation {entry.generation}, "
            f"node {entry.slot}, not generation {generation}: refusing it"
        )
    return entry


@dataclass(slots=True)
class WatchedRound:
    """The peers watched in one round and what is known of them."""

    generation: int
    me: str
    order: list[str]
    addrs: dict[str, tuple[str, int]]
    since: float
    """When the round began: a peer not heard from yet is silent since then."""
    suspected: set[str] = field(default_factory=set)
    declared: set[str] = field(default_factory=set)
    """Being published, or published (then also in ``lost``)."""
    lost: set[str] = field(default_factory=set)
    paused: bool = False


def silent_since(rnd: WatchedRound, heard: dict[str, float], peer: str) -> float:
    """When ``peer`` was last heard in round ``rnd`` (a peer not heard yet: since it began)."""
    return max(heard.get(peer, rnd.since), rnd.since)


def verdicts(
    rnd: WatchedRound,
    now: float,
    suspect_s: float,
    heard: dict[str, float],
    reports: dict[str, tuple[frozenset[str], frozenset[str]]],
    departed: set[str],
) -> tuple[set[str], dict[str, str]]:
    """What this node thinks of its neighbours at ``now``: the ones it suspects, and the ones to
    declare lost with why (module docstring, Corroboration). Pure: no clock, no socket.

    ``heard``: when each peer was last heard from; ``reports``: each peer's last heartbeat's
    (suspected, declared) names, of this round only (a verdict of an earlier round is about
    a node that may have re-joined since).
    """
    mine = neighbours(rnd.order, rnd.me)
    suspected = {
        p for p in mine if p not in departed and now - silent_since(rnd, heard, p) >= suspect_s
    }
    fresh = {p for p in mine if p not in suspected and p in heard and now - heard[p] < suspect_s}
    declare: dict[str, str] = {}
    for peer in sorted(suspected - rnd.declared):
        silent = now - silent_since(rnd, heard, peer)
        others = [k for k in neighbours(rnd.order, peer) if k not in (rnd.me, peer)]
        agree = sorted(k for k in others if k in fresh and peer in reports.get(k, ((), ()))[0])
        if not others:
            declare[peer] = f"no heartbeat for {silent:.1f} s (its only observer)"
        elif agree:
            declare[peer] = f"no heartbeat for {silent:.1f} s, suspected by {', '.join(agree)} too"
    for k in sorted(fresh):
        for peer in sorted(reports.get(k, ((), ()))[1]):
            if peer in rnd.order and peer != rnd.me and peer not in rnd.declared:
                declare.setdefault(peer, f"declared lost by {k}")
    return suspected, declare


class FailureDetector:
    """The agent's heartbeats and verdicts (module docstring).

    Args:
        node: this agent's name, for the logs.
        run_id: the job's run id (heartbeats of other runs are dropped).
        key: the heartbeats' HMAC key (derived from the job's key).
        host: the address to bind (the node's peer address).
        suspect: silence after which a peer is suspected.
        publish: marks a peer lost in the rendezvous; True once written (or already gone).
        on_lost: called with a peer and why once it is published lost.

    Resource handling: :meth:`start` binds the socket and starts the thread; :meth:`close`
    sends a "leaving" heartbeat, stops the thread (bounded join) and closes the socket. Each
    publication runs on a short-lived thread of its own, so a slow store never delays a
    heartbeat.
    """

    def __init__(
        self,
        node: str,
        run_id: str,
        key: bytes,
        host: str,
        suspect: timedelta,
        publish: Callable[[str], bool],
        on_lost: Callable[[str, str], None],
    ) -> None:
        self._node = node
        self._run = run_id
        self._key = key
        self._host = host
        self._suspect_s = suspect.total_seconds()
        self._interval = self._suspect_s / BEATS_PER_BOUND
        self._publish = publish
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._round: WatchedRound | None = None
        self._heard: dict[str, float] = {}
        self._seqs: dict[str, int] = {}
        self._reports: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self._departed: set[str] = set()
        self._seq = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Datagrams dropped: too large, a wrong tag, malformed, another run, or replayed."""

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) peers send heartbeats to (after :meth:`start`)."""
        assert self._sock is not None
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> tuple[str, int]:
        """Bind the socket and start the thread; return :attr:`address`."""
        if self._sock is None:
            family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.bind((self._host, 0))
            sock.setblocking(False)
            self._sock = sock
            self._thread = threading.Thread(
                target=self._run_loop, name="ftmem-detector", daemon=True
            )
            self._thread.start()
        return self.address

    def watch(
        self, generation: int, me: str, members: dict[str, tuple[str, int]], order: list[str]
    ) -> None:
        """Watch the round ``generation``: ``members`` (node -> heartbeat address) in slot
        ``order``; ``me`` is this node."""
        with self._lock:
            self._round = WatchedRound(generation, me, list(order), dict(members), time.monotonic())
            self._reports = {}  # earlier rounds' suspicions and verdicts are void
        mine = neighbours(order, me)
        log.info(
            "[%s] failure detector: generation %d, watching %s (lost after %.1f s of silence, "
            "corroborated)",
            self._node,
            generation,
            ", ".join(mine) or "nobody",
            self._suspect_s,
        )

    def pause(self) -> None:
        """Declare nothing until the next :meth:`watch` (a restart is under way); the
        heartbeats go on, so that no peer takes this node's restart for a loss."""
        with self._lock:
            if self._round is not None:
                self._round.paused = True

    def suspected(self) -> set[str]:
        """The peers suspected now."""
        with self._lock:
            return set(self._round.suspected) if self._round is not None else set()

    def why_gone(self, peer: str) -> str | None:
        """Why this detector holds ``peer`` lost, or about to be: a neighbour it hears declared
        it, or ``peer`` has been silent for ``suspect_s`` (then it is suspected); None while
        ``peer`` is heard. A node that leaves the rendezvous to re-join keeps sending
        heartbeats, so None tells a restart from a loss that another node published first."""
        with self._lock:
            rnd = self._round
            if rnd is None:
                return None
            by = sorted(k for k, (_, declared) in self._reports.items() if peer in declared)
            if by:
                return f"declared lost by {', '.join(by)}"
            if peer in rnd.suspected:
                silent = time.monotonic() - silent_since(rnd, self._heard, peer)
                return f"no heartbeat for {silent:.1f} s"
        return None

    def close(self, timeout: timedelta = timedelta(seconds=2), leaving: bool = True) -> None:
        """Tell the neighbours this agent leaves (unless not ``leaving``), stop the thread and
        close the socket. Idempotent."""
        if self._sock is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())
        try:
            if leaving:
                self._send(leaving=True)
        finally:
            self._sock.close()
            self._sock = None

    # -- the thread ---------------------------------------------------------------------------

    def _run_loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= due:
                if now - due > self._suspect_s / 2:
                    self._forgive(now, now - due)
                self._send()
                due = now + self._interval
                self._evaluate(now)  # a pending verdict is looked at again each heartbeat
            elif now >= self._next_crossing():
                self._evaluate(now)
            sock = self._sock
            if sock is None:
                return
            wake = min(due, max(self._next_crossing(), now + 0.01))
            try:
                ready, _, _ = select.select([sock], [], [], max(0.0, wake - time.monotonic()))
            except (OSError, ValueError):  # closed under us
                return
            if ready and self._drain(sock):
                self._evaluate(time.monotonic())  # a peer's suspicion may corroborate ours

    def _next_crossing(self) -> float:
        """When the next neighbour not yet suspected would become suspected (its silence
        reaches the bound), so that suspicion starts on time, not at the next heartbeat."""
        with self._lock:
            rnd = self._round
            if rnd is None:
                return float("inf")
            marks = [
                silent_since(rnd, self._heard, p) + self._suspect_s
                for p in neighbours(rnd.order, rnd.me)
                if p not in rnd.suspected and p not in self._departed
            ]
        return min(marks, default=float("inf"))

    def _forgive(self, now: float, late: float) -> None:
        log.warning(
            "[%s] failure detector: its thread woke %.1f s late (this process was starved): "
            "the silence measured meanwhile is forgiven",
            self._node,
            late,
        )
        with self._lock:
            for peer in self._heard:
                self._heard[peer] = now
            if self._round is not None:
                self._round.since = now

    def _send(self, leaving: bool = False) -> None:
        sock = self._sock
        with self._lock:
            rnd = self._round
            if rnd is None or sock is None:
                return
            self._seq += 1
            beat = Heartbeat(
                run=self._run,
                sender=rnd.me,
                seq=self._seq,
                generation=rnd.generation,
                suspects=tuple(sorted(rnd.suspected))[:MAX_NAMES],
                lost=tuple(sorted(rnd.lost))[:MAX_NAMES],
                leaving=leaving,
            )
            targets = [rnd.addrs[p] for p in neighbours(rnd.order, rnd.me) if p in rnd.addrs]
        data = beat.encode(self._key)
        for addr in targets:
            try:
                sock.sendto(data, addr)
            except OSError:  # a link that is down: that peer will notice
                pass

    def _drain(self, sock: socket.socket) -> bool:
        """Read the datagrams waiting (at most :data:`MAX_DRAIN`); True if a peer's
        suspicions or verdicts changed."""
        changed = False
        for _ in range(MAX_DRAIN):
            try:
                data = sock.recv(MAX_DATAGRAM + 1)
            except OSError:  # nothing more to read (BlockingIOError), or closed
                return changed
            try:
                beat = Heartbeat.decode(self._key, data)
            except ValueError as exc:
                self._drop(str(exc))
                continue
            if beat.run != self._run:
                self._drop(f"a heartbeat of run {beat.run!r}")
                continue
            with self._lock:
                if beat.seq <= self._seqs.get(beat.sender, -1):
                    self.dropped += 1
                    continue
                self._seqs[beat.sender] = beat.seq
                self._heard[beat.sender] = time.monotonic()
                if beat.leaving:
                    self._departed.add(beat.sender)
                if self._round is None or beat.generation != self._round.generation:
                    continue  # alive, but what it suspects is about another round
                report = (frozenset(beat.suspects), frozenset(beat.lost))
                changed |= report != self._reports.get(beat.sender) and bool(report[0] | report[1])
                self._reports[beat.sender] = report
        return changed

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped in (1, 10, 100) or self.dropped % 10000 == 0:
            log.warning(
                "[%s] failure detector: dropped a datagram (%s); %d so far",
                self._node,
                why,
                self.dropped,
            )

    def _evaluate(self, now: float) -> None:
        with self._lock:
            rnd = self._round
            if rnd is None:
                return
            suspected, declare = verdicts(
                rnd, now, self._suspect_s, self._heard, self._reports, self._departed
            )
            for peer in sorted(suspected - rnd.suspected):
                log.warning(
                    "[%s] SUSPECT: no heartbeat from %s for %.1f s",
                    self._node,
                    peer,
                    now - silent_since(rnd, self._heard, peer),
                )
            rnd.suspected = suspected
            if rnd.paused:
                return
            rnd.declared |= set(declare)
        for peer, why in declare.items():
            threading.Thread(
                target=self._declare, args=(rnd, peer, why), name="ftmem-declare", daemon=True
            ).start()

    def _declare(self, rnd: WatchedRound, peer: str, why: str) -> None:
        try:
            ok = self._publish(peer)
        except Exception as exc:  # any store error: not published, tried again later
            log.warning("[%s] could not publish %s as lost: %s", self._node, peer, exc)
            ok = False
        with self._lock:
            if not ok:
                rnd.declared.discard(peer)
                return
            rnd.lost.add(peer)
            current = self._round is rnd and not rnd.paused
        if current:
            self._on_lost(peer, why)
