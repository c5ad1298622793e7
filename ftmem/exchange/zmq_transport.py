"""ZmqPeerTransport: the SMP mesh over ZeroMQ TCP, authenticated and encrypted with CURVE.

Every SMP of a job serves and connects with the job's key pair; a ZAP handler admits only
clients that present the job's public key, so a peer without the secret key is refused
during the handshake. Each message is one header frame (wire.py, kind PEER: sizes and xxh3
checksums of the buffers) plus raw buffer frames sent without copies.
"""

from __future__ import annotations

import logging
from typing import Any

import xxhash
import zmq
from zmq.auth.thread import ThreadAuthenticator

from ftmem.errors import FtmemError, ProtocolError
from ftmem.exchange.keys import CurveKeyPair
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


class _OnlyJobKey:
    """ZAP credentials provider: admit exactly the job's public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key == self.public
        if not ok:
            log.warning("refused a peer presenting an unknown CURVE key")
        return ok


class ZmqPeerTransport(PeerTransport):
    """PeerTransport over TCP + CURVE (see the module docstring).

    Resource handling: owns a context, the ZAP authenticator thread, a ROUTER (incoming) and
    one DEALER per peer (outgoing); :meth:`close` releases all with linger 0.

    Error handling: :meth:`send` raises PeerUnavailableError when the peer's queue stays full
    for ``send_timeout_s``; :meth:`recv` drops (and counts) malformed messages.
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
    ) -> None:
        self.node = node
        self.keys = keys
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

    def start(self) -> str:
        """Start the authenticator, bind the ROUTER; return ``tcp://host:port``."""
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(
            ZAP_DOMAIN, credentials_provider=_OnlyJobKey(self.keys.public)
        )
        r = self._ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.curve_server = True
        r.curve_secretkey = self.keys.secret
        r.curve_publickey = self.keys.public
        r.zap_domain = ZAP_DOMAIN.encode()
        r.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        # A replacement node reconnects under the lost node's name: it takes the name over.
        r.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self.port == 0:
            self.port = r.bind_to_random_port(f"tcp://{self.host}")
        else:
            r.bind(f"tcp://{self.host}:{self.port}")
        self._router = r
        self._poller.register(r, zmq.POLLIN)
        return self.endpoint

    @property
    def endpoint(self) -> str:
        """This node's address for its peers."""
        return f"tcp://{self.host}:{self.port}"

    def connect(self, peers: dict[str, str]) -> None:
        """Connect a DEALER to each peer (except ourselves); drop peers no longer listed."""
        for node in list(self._peers):
            if peers.get(node) != self._endpoints.get(node):
                self._peers.pop(node).close(linger=0)
                self._endpoints.pop(node, None)
        for node, ep in peers.items():
            if node == self.node or node in self._peers:
                continue
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.SNDHWM, self.send_hwm)
            d.setsockopt(zmq.ROUTING_ID, self.node.encode())
            d.curve_serverkey = self.keys.public
            d.curve_publickey = self.keys.public
            d.curve_secretkey = self.keys.secret
            d.connect(ep)
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

    def _socket(self, node: str) -> zmq.Socket[bytes]:
        sock = self._peers.get(node)
        if sock is None:
            raise PeerUnavailableError(f"no connection to node {node!r}")
        return sock

    def send(self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]) -> None:
        """Queue ``header`` + ``buffers`` to ``node`` (buffers are sent without copying)."""
        sock = self._socket(node)
        if not sock.poll(int(self.send_timeout_s * 1000), zmq.POLLOUT):
            raise PeerUnavailableError(
                f"node {node!r} did not take a message within {self.send_timeout_s} s"
            )
        sock.send_multipart(self._frames(header, buffers), copy=False, flags=zmq.NOBLOCK)

    def try_send(
        self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]
    ) -> bool:
        """Queue the message if ``node``'s queue has room now; never blocks."""
        sock = self._socket(node)
        if not sock.poll(0, zmq.POLLOUT):
            return False
        try:
            sock.send_multipart(self._frames(header, buffers), copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_s: float) -> PeerMessage | None:
        """Return the next valid message within ``timeout_s``, or None."""
        assert self._router is not None, "start() first"
        if not self._router.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self._router.recv_multipart(copy=False)
        try:
            self._check_total(frames)
            return self._parse(frames)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("[%s] dropped a peer message: %s", self.node, exc)
            return None

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
        sender = bytes(frames[0].buffer).decode(errors="replace")
        try:
            _, kind, env = decode(bytes(frames[1].buffer), None, 1 << 20)
        except ValueError as exc:  # json.loads: a bare ValueError for an int of 4300+ digits
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
        for s in self._peers.values():
            s.close(linger=0)
        self._peers.clear()
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if not self._ctx.closed:
            self._ctx.term()
