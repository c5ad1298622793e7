"""ZmqPeerTransport: the SMP mesh over ZeroMQ TCP, authenticated and encrypted with CURVE.

Every node serves and connects with its own key pair of the generation (keys.py; fresh each
round), and its address is its endpoint plus that public key (:class:`PeerAddress`). At
:meth:`~ZmqPeerTransport.connect` the transport learns the generation's members: each
node's address. Its ZAP handler then admits exactly those nodes' keys and names each
connection after the node its key belongs to (the ZAP user id, which ZeroMQ attaches to every
message as ``User-Id``); a client presenting any other key (no member, a member of an earlier
generation, the job's own pair) fails the handshake. A connection that arrives before the
members are known waits in its handshake (up to ``admit_wait_s``) instead of being refused,
because ZeroMQ does not retry a client that a ZAP handler refused.

A message's sender is the node its connection's key belongs to; nodes do not name
themselves (their DEALERs set no routing id, so the ROUTER gives each connection a unique
one, and no connection can take another's over: no ``ROUTER_HANDOVER``). A message that
claims a name anyway (a routing id a client chose) that is not its key's node is dropped and
counted (``impostors``), so a member cannot speak as another.
Each message is one header frame (wire.py, kind PEER: sizes and xxh3 checksums of the
buffers) plus raw buffer frames sent without copies.

The plain data channel (unless ``encrypt_data``): CURVE costs ~3.7 CPU-s per GiB on these
machines, so the messages that carry buffers (snapshot columns, parity and fetched fragments,
manifests) go to a second, plain ROUTER of the receiver instead, each with two more frames in
front: the sender's name and a keyed BLAKE3 tag (data_mac.py) over the sender's and the
receiver's public keys, the name, the header and the buffers. The receiver checks the tag
before anything else and drops (and counts: ``forged``) a message whose tag is wrong: one
altered on the way, or sent by anyone without the job's key. Messages without buffers stay on
CURVE. The two channels do not keep order between each other; the group protocol does not
need them to (a column or a fragment arriving before its SIZE is kept until the stripes are
planned, and replies follow their requests).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import deque
from typing import Any

import xxhash
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ftmem.errors import FtmemError, ProtocolError
from ftmem.exchange import data_mac
from ftmem.exchange import keys as _keys
from ftmem.exchange.keys import CurveKeyPair
from ftmem.exchange.messages import PeerAddress
from ftmem.exchange.transport import PeerMessage, PeerTransport
from ftmem.protocol import messages as m
from ftmem.protocol.wire import decode, encode

log = logging.getLogger(__name__)

MAX_FRAMES = 8
"""Most frames in one peer message: an identity, a header and (today) at most one buffer."""
_HEADER_ROOM = 2 << 20  # an identity and a header (at most 1 MiB) beside the largest buffer

ZAP_DOMAIN = "ftmem"


class PeerUnavailableError(FtmemError):
    """A message could not be queued to a peer in time (dead, slow or unknown)."""


class _Members:
    """ZAP credentials provider and user ids: admit exactly the generation's node keys.

    The exchange thread replaces :attr:`keys` (one assignment, read by the authenticator's
    thread); until the first assignment a handshake waits (bounded) instead of failing.
    """

    def __init__(self, wait_s: float) -> None:
        self.keys: dict[bytes, str] | None = None
        """Z85 public key -> node name; None until the generation's members are known."""
        self.wait_s = wait_s
        self.closing = False

    async def callback(self, domain: str, key: bytes) -> bool:
        deadline = time.monotonic() + self.wait_s
        while self.keys is None and not self.closing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        ok = self.keys is not None and key in self.keys
        if not ok:
            log.warning("refused a peer presenting a CURVE key of no member of this generation")
        return ok


class _MeshAuthenticator(ThreadAuthenticator):
    """The ZAP handler thread; a connection's user id is the name of the node its key is."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], members: _Members) -> None:
        super().__init__(ctx)
        self.members = members

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The node the admitted ``client_public_key`` belongs to."""
        return (self.members.keys or {}).get(z85.encode(client_public_key), "")


class ZmqPeerTransport(PeerTransport):
    """PeerTransport over TCP + CURVE (see the module docstring).

    Resource handling: owns a context, the ZAP authenticator thread, a ROUTER (incoming) and
    one DEALER per peer (outgoing), and as many plain ones for the data channel unless
    ``encrypt_data``; :meth:`close` releases all with linger 0.

    ``keys`` is the job's pair; the node's own pair is ``keys.node``, or a fresh one.
    ``encrypt_data``: every message goes over CURVE (``--ftmem-ec-encrypt``); else those with
    buffers go over the plain data channel with a keyed tag (module docstring).

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
        self._members = _Members(admit_wait_s)
        self.host = host
        self.port = port
        self.max_message_bytes = max_message_bytes
        self.send_timeout_s = send_timeout_s
        self.send_hwm = send_hwm
        self.dropped = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._endpoints: dict[str, str] = {}
        self._poller = zmq.Poller()
        self._ids = 0
        self.forged = 0
        """Data-channel messages dropped because their tag was wrong (altered, or no key)."""
        self.data_sent = 0
        """Messages sent over the plain data channel."""
        self._data_key = data_mac.data_key(keys)
        self._data_router: zmq.Socket[bytes] | None = None
        self._data_port = 0
        self._data_peers: dict[str, zmq.Socket[bytes]] = {}
        self._peer_keys: dict[str, bytes] = {}
        """Node name -> its public key of the generation (the tags bind it)."""
        self._refused: deque[PeerMessage] = deque(maxlen=64)

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
        if self.port == 0:
            self.port = r.bind_to_random_port(f"tcp://{self.host}")
        else:
            r.bind(f"tcp://{self.host}:{self.port}")
        self._router = r
        self._poller.register(r, zmq.POLLIN)
        if not self.encrypt_data:
            d = self._ctx.socket(zmq.ROUTER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._data_port = d.bind_to_random_port(f"tcp://{self.host}")
            self._data_router = d
            self._poller.register(d, zmq.POLLIN)
        return self.endpoint

    @property
    def endpoint(self) -> str:
        """This node's address for its peers (its endpoint, public key and data endpoint)."""
        data = f"tcp://{self.host}:{self._data_port}" if self._data_router is not None else ""
        return str(PeerAddress(f"tcp://{self.host}:{self.port}", self.node_keys.public, data))

    def connect(self, peers: dict[str, str]) -> None:
        """Make ``peers`` (node name -> address, :class:`PeerAddress`) the generation's
        members: admit exactly their keys, each as its node, and connect a DEALER to each
        (except ourselves) authenticated against its key; drop peers no longer listed.

        Raises:
            ProtocolError: an address is malformed (nothing is changed then).
        """
        parsed = {node: PeerAddress.parse(addr) for node, addr in peers.items()}
        members = {a.key: node for node, a in parsed.items() if node != self.node}
        if len(members) != len([n for n in parsed if n != self.node]):
            raise ProtocolError("two nodes of the generation have the same key")
        self._members.keys = members
        self._peer_keys = {node: a.key for node, a in parsed.items() if node != self.node}
        for node in list(self._peers):
            if peers.get(node) != self._endpoints.get(node):
                self._peers.pop(node).close(linger=0)
                self._endpoints.pop(node, None)
                data = self._data_peers.pop(node, None)
                if data is not None:
                    data.close(linger=0)
        for node, addr in parsed.items():
            if node == self.node or node in self._peers:
                continue
            if addr.data and not self.encrypt_data:
                p = self._ctx.socket(zmq.DEALER)
                p.setsockopt(zmq.LINGER, 0)
                p.setsockopt(zmq.SNDHWM, self.send_hwm)
                p.connect(addr.data)
                self._data_peers[node] = p
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, self.send_hwm)
            d.curve_serverkey = addr.key
            d.curve_publickey = self.node_keys.public
            d.curve_secretkey = self.node_keys.secret
            d.connect(addr.endpoint)
            ep = peers[node]
            self._peers[node] = d
            self._endpoints[node] = ep

    def _frames(self, header: dict[str, Any], buffers: list[memoryview | bytes]) -> list[Any]:
        views = [memoryview(b) for b in buffers]
        env = m.Peer(
            header=header,
            sizes=[v.nbytes for v in views],
            hashes=[xxhash.xxh3_64_hexdigest(v) for v in views],
        )
        self._ids += 1
        return [encode(env, self._ids, None), *views]

    def _socket_for(self, node: str, buffers: list[memoryview | bytes]) -> zmq.Socket[bytes]:
        """The socket a message to ``node`` goes on (module docstring)."""
        sock = self._peers.get(node)
        if sock is None:
            raise PeerUnavailableError(f"no connection to node {node!r}")
        data = self._data_peers.get(node) if buffers else None
        return sock if data is None else data

    def _frames_for(
        self,
        sock: zmq.Socket[bytes],
        node: str,
        header: dict[str, Any],
        buffers: list[memoryview | bytes],
    ) -> list[Any]:
        """The frames of a message on ``sock``: tagged on the data channel. Made only once
        the socket can take them (a full queue costs no hashing)."""
        frames = self._frames(header, buffers)
        if sock is self._peers[node]:
            return frames
        mac = data_mac.tag(
            self._data_key,
            self.node_keys.public,
            self._peer_keys[node],
            self.node,
            frames[0],
            frames[1:],
        )
        return [self.node.encode(), mac, *frames]

    def send(self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]) -> None:
        """Queue ``header`` + ``buffers`` to ``node`` (buffers are sent without copying)."""
        sock = self._socket_for(node, buffers)
        if not sock.poll(int(self.send_timeout_s * 1000), zmq.POLLOUT):
            raise PeerUnavailableError(
                f"node {node!r} did not take a message within {self.send_timeout_s} s"
            )
        frames = self._frames_for(sock, node, header, buffers)
        sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        self.data_sent += sock is not self._peers[node]

    def try_send(
        self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]
    ) -> bool:
        """Queue the message if ``node``'s queue has room now; never blocks."""
        sock = self._socket_for(node, buffers)
        if not sock.poll(0, zmq.POLLOUT):
            return False
        frames = self._frames_for(sock, node, header, buffers)
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # POLLOUT said there was room: only if another thread took it
            return False
        self.data_sent += sock is not self._peers[node]
        return True

    def recv(self, timeout_s: float) -> PeerMessage | None:
        """Return the next valid message within ``timeout_s``, or None."""
        assert self._router is not None, "start() first"
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._router in ready:  # CURVE first: control messages are not held up by bulk
            frames = self._router.recv_multipart(copy=False)
            data = False
        elif self._data_router is not None and self._data_router in ready:
            frames = self._data_router.recv_multipart(copy=False)
            data = True
        else:
            return None
        try:
            self._check_total(frames)
            if data:
                sender = self._check_tag(frames)
                msg = self._parse(frames[2:])
                return PeerMessage(sender, msg.header, msg.buffers)
            msg = self._parse(frames)
            return PeerMessage(self._check_sender(frames), msg.header, msg.buffers)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("[%s] dropped a peer message: %s", self.node, exc)
            return None

    def _check_tag(self, frames: list[zmq.Frame]) -> str:
        """The node a data-channel message comes from, once its tag is right (identity,
        name, tag, header, buffers...)."""
        if len(frames) < 4:
            raise ProtocolError("a data-channel message without a name, a tag or a header")
        name = bytes(frames[1].buffer)
        sender = name.decode("ascii", "replace")
        public = self._peer_keys.get(sender) if name.isascii() else None
        mac = bytes(frames[2].buffer)
        want = (
            data_mac.tag(
                self._data_key,
                public,
                self.node_keys.public,
                sender,
                frames[3].buffer,
                [f.buffer for f in frames[4:]],
            )
            if public is not None and len(mac) == data_mac.TAG_BYTES
            else b""
        )
        if not want or not hmac.compare_digest(mac, want):
            self.forged += 1
            if public is not None:
                self._note_refused(sender, frames[3])
            raise ProtocolError(
                f"a data-channel message naming node {name[:16]!r} does not carry its tag "
                "(altered on the way, or sent without the job's key)"
            )
        return sender

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

    def _note_refused(self, sender: str, header: zmq.Frame) -> None:
        """Keep what a refused message claimed to be, if its header reads (take_refused)."""
        try:
            _, kind, env = decode(bytes(header.buffer), None, 1 << 20)
        except (ProtocolError, ValueError):
            return
        if kind is m.Kind.PEER and isinstance(env.header, dict):
            self._refused.append(PeerMessage(sender, env.header, []))

    def take_refused(self) -> list[PeerMessage]:
        """See :meth:`PeerTransport.take_refused` (at most the newest 64 are kept)."""
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

    def _parse(self, frames: list[zmq.Frame]) -> PeerMessage:
        if len(frames) < 2:
            raise ProtocolError("peer message without a header")
        sender = ""  # filled in by _check_sender
        try:
            _, kind, env = decode(bytes(frames[1].buffer), None, 1 << 20)
        except (ValueError, RecursionError) as exc:  # json.loads: ValueError for 4300+ digits
            raise ProtocolError(f"peer header is not valid JSON: {exc}") from exc
        if kind is not m.Kind.PEER:
            raise ProtocolError(f"unexpected {kind.name} from a peer")
        bufs = [f.buffer for f in frames[2:]]
        if len(bufs) != len(env.sizes) or len(env.hashes) != len(env.sizes):
            raise ProtocolError("buffer count does not match the header")
        for b, size, h in zip(bufs, env.sizes, env.hashes, strict=True):
            if b.nbytes != size or xxhash.xxh3_64_hexdigest(b) != h:
                raise ProtocolError("buffer size or checksum mismatch")
        return PeerMessage(sender=sender, header=env.header, buffers=bufs)

    def close(self) -> None:
        """Close every socket, stop the authenticator, terminate the context (idempotent)."""
        for s in [*self._peers.values(), *self._data_peers.values()]:
            s.close(linger=0)
        self._peers.clear()
        self._data_peers.clear()
        for r in (self._router, self._data_router):
            if r is not None:
                r.close(linger=0)
        self._router = self._data_router = None
        self._members.closing = True  # a handshake waiting for the members gives up
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._ctx.closed:
            self._ctx.term()
