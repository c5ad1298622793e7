"""Typed messages between the SMPs of a group (the peer protocol), and their validation.

A peer message is a small JSON header plus raw buffers (transport.py moves both). The header
is ``{"t": kind, "e": epoch, <fields>}``: :class:`PeerKind` names the kind, the epoch is the
launcher's generation, and the fields are those of the kind's frozen dataclass. Sending: build
the dataclass, then :meth:`to_header`. Receiving: :meth:`Envelope.parse` checks the sender,
the kind, the epoch, every field (:func:`ftmem.typed_json.build`, from the bounds in the
fields' annotations) and the buffer count; anything else raises
:class:`~ftmem.errors.ProtocolError`, whose message names fields, never values.

Kinds of the group protocol (protector.py): SIZE, DATA, PARITY, HELD, ABORT, META_REQUEST,
META, FETCH, FETCHED. Kinds of the protection service (smp/protection.py; wire names start
with ``x:``): STATE, AVAIL, PROTECT, HEARTBEAT.
"""

from __future__ import annotations

import enum
import re
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from ftmem.errors import ProtocolError
from ftmem.typed_json import MAX_INT, Digits, Most, Pattern, Range, build, read, to_fields

MAX_NODE_BYTES = 1 << 44
"""Largest snapshot of one node (bytes) that the protocol accepts."""

MAX_NODE = (1 << 20) - 1
"""Largest node index."""

MAX_NODES = 4096
"""Most entries of a map keyed by node (a group's sizes)."""

MAX_SUMS = 1024
"""Most checksums of one stripe (its k + m fragments)."""

MAX_STEPS = 1024
"""Most steps in one list (held or available steps)."""


class FragmentKind(enum.Enum):
    """What a fetched fragment is: a byte range of a node's snapshot, or a stored parity fragment."""

    DATA = "data"
    PARITY = "parity"


@dataclass(frozen=True, slots=True)
class PeerMessage:
    """One message from a peer: who sent it, a small JSON header, and raw buffers (what a
    :class:`~ftmem.exchange.transport.PeerTransport` delivers)."""

    sender: str
    header: dict[str, Any]
    buffers: list[memoryview]


class PeerKind(enum.Enum):
    """Message kinds; the values are the wire names (both ends run the same ftmem version)."""

    SIZE = "size"
    DATA = "data"
    PARITY = "parity"
    HELD = "held"
    ABORT = "abort"
    META_REQUEST = "meta?"
    META = "meta"
    FETCH = "fetch"
    FETCHED = "fetched"
    STATE = "x:state"
    AVAIL = "x:avail"
    PROTECT = "x:protect"
    HEARTBEAT = "x:hb"

    @property
    def is_service(self) -> bool:
        """True for the protection service's own kinds (not the group protocol's)."""
        return self.value.startswith("x:")


DIGEST_HEX = 32
"""Hex digits of a snapshot's digest (xxh3-128, seals.py)."""

TAG_HEX = 64
"""Hex digits of a seal's tag (HMAC-SHA256, seals.py)."""

# The fields' grammar (read by typed_json.build, the one JSON reader):
Count = Annotated[int, Range(0, MAX_INT)]
"""A step, epoch, stripe or fragment index."""
NodeBytes = Annotated[int, Range(0, MAX_NODE_BYTES)]
"""A size or offset within one node's snapshot."""
NodeKey = Annotated[int, Digits(7), Range(0, MAX_NODE)]
"""A node index as a JSON object's key."""
Sender = Annotated[int, Digits(9), Range(0, MAX_NODE)]
"""A node index as a transport's sender name."""
Checksum = Annotated[int, Digits(20), Range(0, (1 << 64) - 1)]
"""A 64-bit checksum, as a decimal string on the wire."""
Sums = Annotated[tuple[Checksum, ...], Most(MAX_SUMS)]
Steps = Annotated[tuple[Count, ...], Most(MAX_STEPS)]
Digest = Annotated[str, Pattern(f"(?:[0-9a-f]{{{DIGEST_HEX}}})?")]
"""A seal's digest, or "" (absent)."""
Tag = Annotated[str, Pattern(f"(?:[0-9a-f]{{{TAG_HEX}}})?")]
"""A seal's tag, or "" (absent)."""


_ENDPOINT = re.compile(
    r"tcp://(?P<host>[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>\d{1,5})"
)
_Z85_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {c: i for i, c in enumerate(_Z85_CHARS)}


def _is_curve_key(text: str) -> bool:
    """40 Z85 characters that decode to 32 bytes (every 5-character group below 2**32)."""
    if len(text) != 40 or not all(c in _Z85_VALUE for c in text):
        return False
    for i in range(0, 40, 5):
        v = 0
        for c in text[i : i + 5]:
            v = v * 85 + _Z85_VALUE[c]
        if v >= 1 << 32:
            return False
    return True


_ADDRESS_KEY = " key="
_ADDRESS_DATA = " data="


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where a node listens, the CURVE public key it serves with (this generation's own) and,
    with the plain data channel, where it takes the messages that carry buffers. On the wire
    (the rendezvous store, PEER_START) it is one string,
    ``tcp://<host>:<port> key=<40 Z85 characters>[ data=tcp://<host>:<port>]``: connections
    to the endpoint are authenticated against exactly that key (zmq_transport.py); messages to
    the data endpoint carry a keyed tag instead (data_mac.py).
    """

    endpoint: str
    key: bytes
    data: str = ""
    """The plain data channel's endpoint ("": none, every message goes over CURVE)."""

    def __str__(self) -> str:
        data = f"{_ADDRESS_DATA}{self.data}" if self.data else ""
        return f"{self.endpoint}{_ADDRESS_KEY}{self.key.decode()}{data}"

    @classmethod
    def parse(cls, value: Any) -> PeerAddress:
        """Validate ``tcp://<host or IP>:<port> key=<Z85 key>`` with an optional
        `` data=tcp://<host or IP>:<port>`` (IPv6 in brackets, ports 1..65535). Raises
        ProtocolError for anything else, where it arrives rather than at a ``connect``."""
        if type(value) is not str or len(value) > 400:
            raise ProtocolError("a peer address must be a short string")
        endpoint, sep, rest = value.partition(_ADDRESS_KEY)
        key, has_data, data = rest.partition(_ADDRESS_DATA)
        for ep in (endpoint, data) if has_data else (endpoint,):
            match = _ENDPOINT.fullmatch(ep)
            if match is None or not 0 < int(match["port"]) < 65536:
                raise ProtocolError("a peer endpoint must look like tcp://<host>:<port>")
        if not sep or not _is_curve_key(key):
            raise ProtocolError("a peer address must have key=<its 40-character CURVE key>")
        return cls(endpoint, key.encode(), data)


def parse_endpoint(value: Any) -> str:
    """A peer address as the rendezvous store hands it out (:class:`PeerAddress`), checked and
    returned as the same string. Raises ProtocolError for anything else."""
    return str(PeerAddress.parse(value))


def parse_node_index(key: Any) -> int:
    """A node index sent as a JSON object key (a short decimal string). Raises ProtocolError."""
    index: int = read(NodeKey, key, "a node index")
    return index


def parse_sender(sender: Any) -> int:
    """The node index a transport's sender name stands for. Raises ProtocolError."""
    index: int = read(Sender, sender, "the sender")
    return index


# -- messages ---------------------------------------------------------------------------------------


class _Body:
    """What every message has: its kind, how many buffers it carries, its header encoding."""

    __slots__ = ()
    __dataclass_fields__: ClassVar[dict[str, Any]]
    KIND: ClassVar[PeerKind]
    BUFFERS: ClassVar[tuple[int, int]] = (0, 0)
    """Fewest and most buffers a message of this kind carries."""

    def _wire(self) -> dict[str, Any]:
        return to_fields(self)

    def to_header(self, epoch: int) -> dict[str, Any]:
        """The JSON header of this message in generation ``epoch``."""
        return {"t": self.KIND.value, "e": epoch, **self._wire()}


@dataclass(frozen=True, slots=True)
class _StepBody(_Body):
    """A message that carries nothing but its ``step``."""

    step: Count


@dataclass(frozen=True, slots=True)
class Size(_Body):
    """SIZE: the sender's snapshot of ``step`` has ``nbytes`` bytes; its manifest is the buffer;
    ``digest`` and ``tag`` are its seal (seals.py: the bytes' digest and the sender's tag over
    step, node, size, digest and manifest; "" when the sender has no job key)."""

    KIND: ClassVar[PeerKind] = PeerKind.SIZE
    BUFFERS: ClassVar[tuple[int, int]] = (0, 1)
    step: Count
    nbytes: NodeBytes
    digest: Digest = ""
    tag: Tag = ""


@dataclass(frozen=True, slots=True)
class Data(_Body):
    """DATA: the buffer is column ``col`` of stripe ``stripe`` of ``step``, for its encoder."""

    KIND: ClassVar[PeerKind] = PeerKind.DATA
    BUFFERS: ClassVar[tuple[int, int]] = (1, 1)
    step: Count
    stripe: Count
    col: Count


@dataclass(frozen=True, slots=True)
class Parity(_Body):
    """PARITY: the buffer is fragment ``frag`` of stripe ``stripe``; ``sums`` are the stripe's
    k + m checksums (decimal strings on the wire)."""

    KIND: ClassVar[PeerKind] = PeerKind.PARITY
    BUFFERS: ClassVar[tuple[int, int]] = (1, 1)
    step: Count
    stripe: Count
    frag: Count
    sums: Sums

    def _wire(self) -> dict[str, Any]:
        return {**_Body._wire(self), "sums": [str(c) for c in self.sums]}


@dataclass(frozen=True, slots=True)
class Held(_StepBody):
    """HELD: the sender holds every parity fragment it owes for ``step``."""

    KIND: ClassVar[PeerKind] = PeerKind.HELD


@dataclass(frozen=True, slots=True)
class Abort(_StepBody):
    """ABORT: the sender gives ``step`` up; every node does the same."""

    KIND: ClassVar[PeerKind] = PeerKind.ABORT


@dataclass(frozen=True, slots=True)
class MetaRequest(_StepBody):
    """META?: a rebuilding node asks for every node's size of ``step`` (and its manifest)."""

    KIND: ClassVar[PeerKind] = PeerKind.META_REQUEST


@dataclass(frozen=True, slots=True)
class MetaReply(_Body):
    """META: node -> snapshot size of ``step`` (empty: not held); the buffer is the asker's
    manifest, ``digest`` and ``tag`` the seal the asker sent with it when it protected the
    step (see :class:`Size`)."""

    KIND: ClassVar[PeerKind] = PeerKind.META
    BUFFERS: ClassVar[tuple[int, int]] = (0, 1)
    step: Count
    sizes: Annotated[dict[NodeKey, NodeBytes], Most(MAX_NODES)]
    digest: Digest = ""
    tag: Tag = ""

    def _wire(self) -> dict[str, Any]:
        return {**_Body._wire(self), "sizes": {str(k): v for k, v in self.sizes.items()}}


@dataclass(frozen=True, slots=True)
class FetchRequest(_Body):
    """FETCH: send fragment ``frag`` of stripe ``stripe`` of ``step``: for DATA the byte range
    ``[offset, offset + length)`` of the holder's snapshot, for PARITY the stored fragment."""

    KIND: ClassVar[PeerKind] = PeerKind.FETCH
    step: Count
    stripe: Count
    frag: Count
    kind: FragmentKind
    offset: NodeBytes
    length: NodeBytes


@dataclass(frozen=True, slots=True)
class FetchReply(_Body):
    """FETCHED: the fragment asked for is the buffer (no buffer: the holder does not have it);
    ``sums`` (parity only; empty: none, and absent on the wire) are the stripe's checksums."""

    KIND: ClassVar[PeerKind] = PeerKind.FETCHED
    BUFFERS: ClassVar[tuple[int, int]] = (0, 1)
    step: Count
    stripe: Count
    frag: Count
    sums: Sums = ()

    def _wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "stripe": self.stripe, "frag": self.frag}
        if self.sums:
            out["sums"] = [str(c) for c in self.sums]
        return out


@dataclass(frozen=True, slots=True)
class HeldSteps(_Body):
    """x:state: the steps the sender holds (own data plus owed parity), for the sync."""

    KIND: ClassVar[PeerKind] = PeerKind.STATE
    held: Steps


@dataclass(frozen=True, slots=True)
class Avail(_Body):
    """x:avail: steps every rank of the sender has committed, newer than the protected one."""

    KIND: ClassVar[PeerKind] = PeerKind.AVAIL
    steps: Steps


@dataclass(frozen=True, slots=True)
class ProtectOrder(_StepBody):
    """x:protect: the coordinator orders a protection round of ``step``."""

    KIND: ClassVar[PeerKind] = PeerKind.PROTECT


@dataclass(frozen=True, slots=True)
class Heartbeat(_Body):
    """x:hb: the sender is alive (peer health)."""

    KIND: ClassVar[PeerKind] = PeerKind.HEARTBEAT


PeerBody = (
    Size
    | Data
    | Parity
    | Held
    | Abort
    | MetaRequest
    | MetaReply
    | FetchRequest
    | FetchReply
    | HeldSteps
    | Avail
    | ProtectOrder
    | Heartbeat
)

BODY_TYPES: dict[PeerKind, type[PeerBody]] = {cls.KIND: cls for cls in typing.get_args(PeerBody)}
_KINDS = {k.value: k for k in PeerKind}


def parse_kind(header: Any) -> PeerKind:
    """The kind a header names. Raises ProtocolError (not a JSON object, unknown kind)."""
    if type(header) is not dict:
        raise ProtocolError(f"a peer header must be an object, not {type(header).__name__}")
    t = header.get("t")
    kind = _KINDS.get(t) if type(t) is str else None
    if kind is None:
        raise ProtocolError("a peer header without a known kind")
    return kind


def parse_header(header: Any) -> tuple[int, PeerBody]:
    """(epoch, message) of a header, every field checked. Raises ProtocolError."""
    kind = parse_kind(header)
    if "e" not in header:
        raise ProtocolError("missing field 'e'")
    epoch: int = read(Count, header["e"], "e")
    cls = BODY_TYPES[kind]
    fields_ = {k: v for k, v in header.items() if k != "t" and k != "e"}
    body: PeerBody = build(cls, fields_, what=f"a {kind.value!r} message")
    return epoch, body


@dataclass(frozen=True, slots=True)
class Envelope:
    """One validated peer message: sender node, epoch, typed body and its raw buffers."""

    sender: int
    epoch: int
    body: PeerBody
    buffers: tuple[memoryview, ...]

    @property
    def kind(self) -> PeerKind:
        """The message's kind."""
        return self.body.KIND

    @classmethod
    def parse(cls, msg: PeerMessage) -> Envelope:
        """Validate a received message (sender, header, buffer count). Raises ProtocolError."""
        sender = parse_sender(msg.sender)
        epoch, body = parse_header(msg.header)
        lo, hi = body.BUFFERS
        if not lo <= len(msg.buffers) <= hi:
            raise ProtocolError(
                f"a {body.KIND.value!r} message carries {len(msg.buffers)} buffers, not {lo}..{hi}"
            )
        return cls(sender, epoch, body, tuple(msg.buffers))
