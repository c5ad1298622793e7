"""Keyed BLAKE3 tags of the peer messages that travel on the plain data channel.

With the data channel (zmq_transport.py; the default unless ``--ftmem-ec-encrypt``), the
messages that carry buffers go over plain TCP instead of CURVE. Each carries a 32-byte tag:
BLAKE3 in keyed mode, under a key derived from the job's secret key, over the sender's and the
receiver's public keys of the generation, the sender's name, the header frame and every
buffer, each length-prefixed. A message altered on the way, or made without the job's key, is
refused; binding both public keys refuses one replayed into another generation or to another
node. A connection opens with a tagged hello, and each head also binds the receiver's nonce
of the connection and the message's sequence number on it, so a sniffed head is refused on
any other connection and in any other place. BLAKE3 is fast and releases the GIL.

What it does not give: secrecy (the bytes are in the clear on the wire), and a distinction
between the job's own nodes (they share the key; CURVE, which still carries every message
without buffers, names the sender of those). docs/security.md says what each mode protects.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3

from ftmem.exchange.keys import CurveKeyPair

TAG_BYTES = 32
"""Bytes of a tag."""

_DOMAIN = b"ftmem/peer-data/1\0"


def data_key(job: CurveKeyPair) -> bytes:
    """The 32-byte tag key of the job (the same on every node that holds the job's pair)."""
    return job.derived_key("peer-data-mac")


def _framed(h: blake3.blake3, part: bytes | memoryview) -> None:
    h.update(len(part).to_bytes(8, "little"))
    h.update(part)


def _started(domain: bytes, key: bytes, *parts: bytes | memoryview) -> blake3.blake3:
    """A keyed hash of ``domain`` and ``parts``, each length-prefixed."""
    h = blake3.blake3(key=key)
    h.update(domain)
    for part in parts:
        _framed(h, part)
    return h


def tag(
    key: bytes,
    sender_public: bytes,
    receiver_public: bytes,
    sender: str,
    header: bytes | memoryview,
    buffers: Sequence[bytes | memoryview],
) -> bytes:
    """The tag of one message (see the module docstring); ``key`` is :func:`data_key`'s."""
    h = _started(_DOMAIN, key, sender_public, receiver_public, sender.encode(), header)
    h.update(len(buffers).to_bytes(8, "little"))
    for b in buffers:
        _framed(h, b)
    return h.digest()


_HEAD_DOMAIN = b"ftmem/peer-data-head/2\0"
_HELLO_DOMAIN = b"ftmem/peer-data-hello/1\0"
NONCE_BYTES = 16
"""Bytes of a connection's nonces (the sender's in its hello, the receiver's in reply)."""


def head_tag(
    key: bytes,
    sender_public: bytes,
    receiver_public: bytes,
    sender: str,
    header: bytes | memoryview,
    sizes: Sequence[int],
    nonce: bytes,
    seq: int,
) -> bytes:
    """The tag of a message's head: what a receiver checks before it makes room for the
    buffers (data_channel.py), over both public keys, the sender's name, the header, the
    buffers' sizes, the receiver's ``nonce`` of the connection and the message's ``seq`` on it
    (0, 1, ...), so a head is good once, on one connection; a domain of its own, so it is never
    mistaken for a message's :func:`tag`."""
    h = _started(_HEAD_DOMAIN, key, sender_public, receiver_public, sender.encode(), header)
    h.update(len(sizes).to_bytes(8, "little"))
    for n in sizes:
        h.update(int(n).to_bytes(8, "little"))
    _framed(h, nonce)
    h.update(seq.to_bytes(8, "little"))
    return h.digest()


def hello_tag(key: bytes, sender_public: bytes, receiver_public: bytes, nonce: bytes) -> bytes:
    """The tag of a connection's hello (data_channel.py): the sender, whose public key of the
    generation it names, holds the job's key; ``nonce`` is the sender's, fresh per connection
    (the receiver refuses one it has seen in the generation)."""
    return _started(_HELLO_DOMAIN, key, sender_public, receiver_public, nonce).digest()
