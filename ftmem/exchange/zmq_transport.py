"""ZmqPeerTransport: the SMP mesh over ZeroMQ TCP, authenticated and encrypted with CURVE.

Every node serves and connects with its own key pair of the generation (keys.py; fresh each
round), and its address is its endpoint plus that public key (:class:`PeerAddress`). At
:meth:`~ZmqPeerTransport.connect` the transport learns the generation's members. Its ZAP
handler then admits exactly those nodes' keys, from those nodes' hosts, and names each
connection after the node its key belongs to (the ZAP user id, attached to every message as
``User-Id``); any other key (no member, an earlier generation's, the job's own pair) fails the
handshake. A connection that has not finished its handshake within :data:`HANDSHAKE_MS` is
closed. One that arrives before the members are known waits in its handshake (up to
``admit_wait_s``) instead of being refused, because ZeroMQ does not retry a client that a ZAP
handler refused.

A message's sender is the node its connection's key belongs to: DEALERs set no routing id and
there is no ``ROUTER_HANDOVER``, so no connection can take another's over; a message claiming
a routing id that is not its key's node is dropped and counted (``impostors``). Each message
is one header frame (wire.py, kind PEER: sizes and xxh3 checksums of the buffers) plus raw
buffer frames sent without copies.

The plain data channel (unless ``encrypt_data``): CURVE encrypts every byte, at a CPU cost, so
the messages that carry buffers (columns, parity, fetched fragments, manifests) go to the
receiver's data channel instead (data_channel.py), each with keyed tags (data_mac.py); a
message whose tag is wrong is dropped and counted (``forged``). Messages without buffers stay
on CURVE. The two channels do not keep order between each other; the group protocol does not
need them to (a column or fragment arriving before its SIZE is kept until the stripes are
planned, and replies follow their requests).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import time
from collections import deque
from typing import Any

import xxhash
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ftmem.errors import FtmemError, ProtocolError
from ftmem.exchange import admission, data_channel, data_mac
from ftmem.exchange import keys as _keys
from ftmem.exchange.keys import CurveKeyPair
from ftmem.exchange.transport import PeerTransport
from ftmem.protocol import messages as m
from ftmem.protocol.peer import PeerAddress, PeerMessage
from ftmem.protocol.wire import decode, encode

log = logging.getLogger(__name__)

MAX_FRAMES = 8
"""Most frames in one CURVE message: an identity, a header and a few buffers."""
_HEADER_ROOM = 2 << 20  # an identity and a header (at most 1 MiB) beside the largest buffer

ZAP_DOMAIN = "ftmem"
HANDSHAKE_MS = 2000
"""A connection to the ROUTER that has not finished its handshake (greeting, CURVE, ZAP) in
this long is closed (ZeroMQ's default, 30 s, let idle connections pile up)."""


class PeerUnavailableError(FtmemError):
    """A message could not be queued to a peer in time (dead, slow or unknown)."""


class _Members:
    """ZAP credentials provider and user ids: admit exactly the generation's node keys, from
    the generation's hosts.

    The protection thread replaces :attr:`keys` and :attr:`hosts` (one assignment each, read by
    the authenticator's thread); until the first a handshake waits (bounded) instead of
    failing. Refusals are logged as counts (:class:`~ftmem.exchange.admission.DropLog`).
    """

    def __init__(self, wait_s: float, node: str) -> None:
        self.keys: dict[bytes, str] | None = None
        """Z85 public key -> node name; None until the generation's members are known."""
        self.hosts: frozenset[str] | None = None
        """The members' host addresses; None: any address (unknown, or one did not resolve)."""
        self.wait_s = wait_s
        self.closing = False
        self.drops = admission.DropLog(log, f"[{node}] CURVE port")

    async def callback(self, domain: str, key: bytes) -> bool:
        deadline = time.monotonic() + self.wait_s
        while self.keys is None and not self.closing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        ok = self.keys is not None and key in self.keys
        if not ok:
            self.drops.count("a peer", "a CURVE key of no member of this generation")
            self.drops.flush()
        return ok


class _MeshAuthenticator(ThreadAuthenticator):
    """The ZAP handler thread; a connection's user id is the name of the node its key is. A
    handshake from an address that is no member's host is refused before its key is looked at."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], members: _Members) -> None:
        super().__init__(ctx)
        self.members = members

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """Refuse a request from no member's host; else the usual handling (the key)."""
        hosts = self.members.hosts
        if hosts is not None and len(msg) >= 6 and _ip(msg[3]) not in hosts:
            self.members.drops.count(_ip(msg[3]), "no peer host of this generation")
            self.members.drops.flush()
            self._send_zap_reply(msg[1], b"400", b"Address not allowed")
            return
        await super().handle_zap_message(msg)

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The node the admitted ``client_public_key`` belongs to."""
        return (self.members.keys or {}).get(z85.encode(client_public_key), "")


def _ip(address: bytes) -> str:
    """A ZAP request's address, normalized as ``data_channel`` resolves hosts ("" if none)."""
    try:
        return str(ipaddress.ip_address(address.decode("ascii").strip("[]").split("%")[0]))
    except (UnicodeDecodeError, ValueError):
        return ""


def _bindable(host: str) -> bool:
    """Whether ``host`` is a local address that outgoing connections can come from."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as s:
            s.bind((str(ip), 0))
    except (OSError, ValueError):
        return False
    return not ip.is_unspecified


class ZmqPeerTransport(PeerTransport):
    """PeerTransport over TCP + CURVE (see the module docstring).

    Resource handling: owns a context, the ZAP authenticator thread, a ROUTER (incoming) and
    one DEALER per peer (outgoing), and the data channel unless ``encrypt_data``
    (``--ftmem-ec-encrypt``); :meth:`close` releases all with linger 0. ``keys`` is the job's
    pair; the node's own pair is ``keys.node``, or a fresh one.

    Error handling: :meth:`send` raises PeerUnavailableError when the peer's queue stays full
    for ``send_timeout_s``; :meth:`recv` drops (and counts) malformed messages and messages
    whose claimed sender is not their authenticated node; :meth:`connect` raises ProtocolError
    for a malformed address.
    """

    def __init__(
        self,
        node: str,
        keys: CurveKeyPair,
        host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = 64 << 20,
        send_timeout_s: float = 10.0,
        send_hwm: int = 64,
        admit_wait_s: float = 20.0,
        encrypt_data: bool = False,
    ) -> None:
        self.node = node
        self.encrypt_data = encrypt_data
        self.keys = keys
        self.node_keys = keys.node if keys.node is not None else _keys.generate()
        """This node's own pair for the generation (its peers know it by its public key)."""
        self.impostors = 0
        """Messages dropped because their claimed sender was not their authenticated node."""
        self._members = _Members(admit_wait_s, node)
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.send_timeout_s = send_timeout_s
        self.send_hwm = send_hwm
        self.admit_wait_s = admit_wait_s
        self._dropped = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._endpoints: dict[str, str] = {}
        self._poller = zmq.Poller()
        self._ids = 0
        self._forged = 0
        self.data_sent = 0
        """Messages sent over the plain data channel."""
        self._data_key = data_mac.data_key(keys)
        self._data: data_channel.DataChannel | None = None
        self._peer_keys: dict[str, bytes] = {}
        """Node name -> its public key of the generation (the tags bind it)."""
        self._refused: deque[PeerMessage] = deque(maxlen=64)
        self._source = "tcp://"

    @property
    def dropped(self) -> int:
        """Messages (and data-channel connections) dropped as malformed, forged or cut."""
        return self._dropped + (self._data.dropped if self._data is not None else 0)

    @property
    def forged(self) -> int:
        """Data-channel messages dropped because a tag was wrong (altered, or no key)."""
        return self._forged + (self._data.forged if self._data is not None else 0)

    @property
    def job_keys(self) -> CurveKeyPair:
        """The job's key pair (seals are made and checked with it)."""
        return self.keys

    def start(self) -> str:
        """Start the authenticator, bind the ROUTER; return this node's address
        (``tcp://host:port key=<its public key>``, :class:`PeerAddress`)."""
        self._auth = _MeshAuthenticator(self._ctx, self._members)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self._members)
        r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.curve_server = True
        r.curve_secretkey = self.node_keys.secret
        r.curve_publickey = self.node_keys.public
        r.zap_domain = ZAP_DOMAIN.encode()
        r.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        r.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        if self.port == 0:
            self.port = r.bind_to_random_port(f"tcp://{self.host}")
        else:
            r.bind(f"tcp://{self.host}:{self.port}")
        self._router = r
        self._poller.register(r, zmq.POLLIN)
        # connections come from the advertised host (peers allow only their members' hosts)
        self._source = f"tcp://{self.host}:0;" if _bindable(self.host) else "tcp://"
        if not self.encrypt_data:
            d = data_channel.DataChannel(
                self.node,
                self._data_key,
                self.node_keys.public,
                self.host,
                self.max_message_bytes,
                self.send_hwm,
                self.admit_wait_s,
            )
            d.start()
            self._data = d
            self._poller.register(d.wake_fd, zmq.POLLIN)
        return self.endpoint

    @property
    def endpoint(self) -> str:
        """This node's address for its peers (its endpoint, public key and data endpoint)."""
        data = self._data.endpoint if self._data is not None else ""
        return str(PeerAddress(f"tcp://{self.host}:{self.port}", self.node_keys.public, data))

    def connect(self, peers: dict[str, str]) -> None:
        """Make ``peers`` (node name -> address, :class:`PeerAddress`) the generation's
        members: admit exactly their keys, each as its node, and connect a DEALER to each
        (except ourselves) authenticated against its key; drop peers no longer listed.

        Raises:
            ProtocolError: an address is malformed (nothing is changed then).
        """
        parsed = {node: PeerAddress.parse(addr) for node, addr in peers.items()}
        others = {n: a for n, a in parsed.items() if n != self.node}
        keys = {n: a.key for n, a in others.items()}
        if len(set(keys.values())) != len(keys):
            raise ProtocolError("two nodes of the generation have the same key")
        self._peer_keys = keys
        self._members.keys = {key: n for n, key in keys.items()}
        self._members.hosts = data_channel.peer_hosts(
            [a.endpoint for a in others.values()], f"[{self.node}] CURVE port"
        )
        if self._data is not None:
            self._data.set_members(keys, {n: a.data for n, a in others.items() if a.data})
        for node in list(self._peers):
            if peers.get(node) != self._endpoints.get(node):
                self._peers.pop(node).close(linger=0)
                self._endpoints.pop(node, None)
        for node, addr in others.items():
            if node in self._peers:
                continue
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, self.send_hwm)
            d.curve_serverkey = addr.key
            d.curve_publickey = self.node_keys.public
            d.curve_secretkey = self.node_keys.secret
            d.connect(self._source + addr.endpoint.removeprefix("tcp://"))
            self._peers[node] = d
            self._endpoints[node] = peers[node]

    def _frames(self, header: dict[str, Any], buffers: list[memoryview | bytes]) -> list[Any]:
        views = [memoryview(b) for b in buffers]
        env = m.Peer(
            header=header,
            sizes=[v.nbytes for v in views],
            hashes=[xxhash.xxh3_64_hexdigest(v) for v in views],
        )
        self._ids += 1
        return [encode(env, self._ids, None), *views]

    def send(self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]) -> None:
        """Queue ``header`` + ``buffers`` to ``node`` (buffers are sent without copying)."""
        if not self._put(node, header, buffers, self.send_timeout_s):
            raise PeerUnavailableError(
                f"node {node!r} did not take a message within {self.send_timeout_s} s"
            )

    def try_send(
        self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]
    ) -> bool:
        """Queue the message if ``node``'s queue has room now; never blocks."""
        return self._put(node, header, buffers, 0.0)

    def _put(
        self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes], wait_s: float
    ) -> bool:
        """Queue a message once ``node``'s queue has room (waiting at most ``wait_s``): on the
        data channel if it has buffers and the peer one (framed and tagged only then, so a
        full queue costs no hashing), else over CURVE."""
        if node not in self._peers:
            raise PeerUnavailableError(f"no connection to node {node!r}")
        d = self._data
        if buffers and d is not None and d.has_peer(node):
            if not d.wait_room(node, wait_s):
                return False
            head, *views = self._frames(header, buffers)
            pub = self.node_keys.public
            d.put(
                node,
                data_channel.frame(
                    self._data_key, pub, self._peer_keys[node], self.node, head, views
                ),
            )
            self.data_sent += 1
            return True
        sock = self._peers[node]
        if not sock.poll(int(wait_s * 1000), zmq.POLLOUT):
            return False
        try:
            sock.send_multipart(self._frames(header, buffers), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # POLLOUT said there was room: only if another thread took it
            return False
        return True

    def recv(self, timeout_s: float) -> PeerMessage | None:
        """Return the next valid message within ``timeout_s``, or None."""
        assert self._router is not None, "start() first"
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        try:
            if self._router in ready:  # CURVE first: control messages are not held up by bulk
                frames = self._router.recv_multipart(copy=False)
                self._check_total(frames)
                sender = self._check_sender(frames)
                return self._parse(sender, bytes(frames[1].buffer), [f.buffer for f in frames[2:]])
            if self._data is not None and self._data.wake_fd in ready:
                got = self._data.take()
                if got is None:
                    return None
                self._check_tag(got)
                return self._parse(got.sender, got.header, got.buffers)
        except ProtocolError as exc:
            self._dropped += 1
            log.warning("[%s] dropped a peer message: %s", self.node, exc)
        return None

    def _check_tag(self, got: data_channel.Received) -> None:
        """Check a data-channel message's tag (its head's was checked as it arrived)."""
        public = self._peer_keys.get(got.sender)
        if public is not None:
            mine = self.node_keys.public
            want = data_mac.tag(self._data_key, public, mine, got.sender, got.header, got.buffers)
            if hmac.compare_digest(got.tag, want):
                return
            self._note_refused(got.sender, got.header)
        self._forged += 1
        raise ProtocolError(
            f"a data-channel message from node {got.sender[:16]!r} does not carry its tag "
            "(altered on the way, or sent without the job's key)"
        )

    def _check_sender(self, frames: list[zmq.Frame]) -> str:
        """The node a message comes from: its connection's key's. A routing id the client
        chose (ROUTER-made ones start with a zero byte) must name that same node."""
        if len(frames) < 2:
            raise ProtocolError("peer message without a header")
        claimed = bytes(frames[0].buffer)
        try:
            user = str(frames[1].get("User-Id"))
        except zmq.ZMQError:
            user = ""
        if not user or (claimed[:1] != b"\0" and claimed != user.encode()):
            self.impostors += 1
            raise ProtocolError(
                f"a message claiming to be from node {claimed[:16]!r} came over the "
                f"connection of node {user[:16]!r}"
            )
        return user

    def _note_refused(self, sender: str, header: bytes) -> None:
        """Keep what a refused message claimed to be, if its header reads (take_refused)."""
        try:
            _, kind, env = decode(header, None, 1 << 20)
        except (ProtocolError, ValueError):
            return
        if kind is m.Kind.PEER and isinstance(env.header, dict):
            self._refused.append(PeerMessage(sender, env.header, []))

    def take_refused(self) -> list[PeerMessage]:
        """See :meth:`PeerTransport.take_refused` (at most the newest 64 are kept)."""
        if self._data is not None:
            while self._data.refused:
                r = self._data.refused.popleft()
                self._note_refused(r.sender, r.header)
        out = list(self._refused)
        self._refused.clear()
        return out

    def _check_total(self, frames: list[zmq.Frame]) -> None:
        """ZeroMQ's MAXMSGSIZE bounds each frame, not a multipart message: bound the whole."""
        if len(frames) > MAX_FRAMES:
            raise ProtocolError(f"a message of {len(frames)} frames (at most {MAX_FRAMES})")
        total = sum(len(f) for f in frames)
        if total > self.max_message_bytes + _HEADER_ROOM:
            raise ProtocolError(
                f"a message of {total} bytes, larger than {self.max_message_bytes} in all"
            )

    def _parse(self, sender: str, header: bytes, bufs: list[memoryview]) -> PeerMessage:
        """The message ``sender`` sent, its header and buffers checked against each other."""
        try:
            _, kind, env = decode(header, None, 1 << 20)
        except (ValueError, RecursionError) as exc:  # json.loads: ValueError for 4300+ digits
            raise ProtocolError(f"peer header is not valid JSON: {exc}") from exc
        if kind is not m.Kind.PEER:
            raise ProtocolError(f"unexpected {kind.name} from a peer")
        if len(bufs) != len(env.sizes) or len(env.hashes) != len(env.sizes):
            raise ProtocolError("buffer count does not match the header")
        for b, size, h in zip(bufs, env.sizes, env.hashes, strict=True):
            if b.nbytes != size or xxhash.xxh3_64_hexdigest(b) != h:
                raise ProtocolError("buffer size or checksum mismatch")
        return PeerMessage(sender=sender, header=env.header, buffers=bufs)

    def close(self) -> None:
        """Close every socket, stop the authenticator, terminate the context (idempotent)."""
        for s in self._peers.values():
            s.close(linger=0)
        self._peers.clear()
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._router is not None:
            self._router.close(linger=0)
        self._router = None
        self._members.closing = True  # a handshake waiting for the members gives up
        self._members.drops.flush(force=True)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._ctx.closed:
            self._ctx.term()
