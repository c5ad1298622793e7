"""Wire format of rank <-> SMP messages: one ZeroMQ frame, never pickled.

Layout of the frame::

    header   struct "<4sHHQIQ": magic b"FTMQ", version, kind, request id,
             payload length, xxh64 of the payload
    payload  UTF-8 JSON object (the message's fields)
    mac      32 bytes HMAC-SHA256 over header + payload, when a key is configured

Sizes are bounded and the checksum and MAC verified before the JSON is parsed; then every
field is checked (messages.from_fields).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from typing import Any

import xxhash

from ftmem.errors import ProtocolError
from ftmem.protocol.messages import KIND_OF, PROTOCOL_VERSION, Kind, from_fields, to_fields
from ftmem.typed_json import loads

MAGIC = b"FTMQ"
_HEADER = struct.Struct("<4sHHQIQ")
MAC_BYTES = 32
DEFAULT_MAX_BYTES = 16 << 20


def encode(payload: Any, req_id: int, key: bytes | None = None) -> bytes:
    """Return the frame carrying ``payload`` (a messages dataclass) with request id ``req_id``."""
    kind = KIND_OF[type(payload)]
    body = json.dumps(to_fields(payload), separators=(",", ":")).encode()
    head = _HEADER.pack(
        MAGIC, PROTOCOL_VERSION, int(kind), req_id, len(body), xxhash.xxh64_intdigest(body)
    )
    frame = head + body
    if key is not None:
        frame += hmac.new(key, frame, hashlib.sha256).digest()
    return frame


def peek_request_id(frame: bytes) -> int | None:
    """Return the request id of a frame if its header is readable, else None (for error replies)."""
    if len(frame) < _HEADER.size or frame[:4] != MAGIC:
        return None
    return int(_HEADER.unpack_from(frame)[3])


def decode(
    frame: bytes, key: bytes | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> tuple[int, Kind, Any]:
    """Parse and verify one frame; return (request id, kind, payload dataclass).

    Raises:
        ProtocolError: bad magic, version, kind, size, checksum, MAC, JSON or fields.
    """
    if len(frame) > max_bytes:
        raise ProtocolError(f"message of {len(frame)} bytes exceeds the limit of {max_bytes}")
    if len(frame) < _HEADER.size:
        raise ProtocolError("message shorter than its header")
    magic, version, kind_v, req_id, length, digest = _HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError("bad magic: not an ftmem message")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (want {PROTOCOL_VERSION})"
        )
    try:
        kind = Kind(kind_v)
    except ValueError as exc:
        raise ProtocolError(f"unknown message kind {kind_v}") from exc
    mac_len = MAC_BYTES if key is not None else 0
    if len(frame) != _HEADER.size + length + mac_len:
        raise ProtocolError(
            "message length does not match its header (truncated or unauthenticated?)"
        )
    body_end = _HEADER.size + length
    if key is not None:
        expect = hmac.new(key, frame[:body_end], hashlib.sha256).digest()
        if not hmac.compare_digest(expect, frame[body_end:]):
            raise ProtocolError("message failed authentication")
    body = frame[_HEADER.size : body_end]
    if xxhash.xxh64_intdigest(body) != digest:
        raise ProtocolError("message checksum mismatch")
    return int(req_id), kind, from_fields(kind, loads(body, "message payload"))
