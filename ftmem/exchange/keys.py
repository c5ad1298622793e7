"""CURVE key pairs for the SMP-to-SMP mesh: make them, write them (0600), read them back.

A job uses one key pair: every SMP of the job serves with it and connects with it, and only
clients presenting its public key are admitted, so a peer must hold the secret key (from the
key file the user provides, or handed out per job through the rendezvous store).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import zmq

from ftmem.errors import FtmemError, ProtocolError
from ftmem.typed_json import Most, parse


class KeyFileError(FtmemError):
    """A key file is missing, malformed, or readable by others."""


_Key = Annotated[str, Most(64)]
"""A CURVE key as Z85 text (40 characters)."""


@dataclass(frozen=True, slots=True)
class _NodeDoc:
    public: _Key
    secret: _Key


@dataclass(frozen=True, slots=True)
class _PairDoc(_NodeDoc):
    from_file: bool = False
    node: _NodeDoc | None = None


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """A CURVE key pair, each key 40 bytes of Z85 text (see the module docstring)."""

    public: bytes
    secret: bytes
    from_file: bool = field(default=False, compare=False)
    """The pair comes from a key file, so it is the same in every round of the job (a node's
    seal can then be checked by its replacement); False: made for this round."""
    node: CurveKeyPair | None = field(default=None, compare=False)
    """(The job's pair, on its way to an SMP) this node's own pair for the generation."""

    def __post_init__(self) -> None:
        for name, k in (("public", self.public), ("secret", self.secret)):
            if len(k) != 40:
                raise KeyFileError(f"{name} key must be 40 Z85 characters")
        try:
            public = zmq.curve_public(self.secret)
        except (zmq.ZMQError, ValueError) as exc:
            raise KeyFileError(f"malformed secret key: {exc}") from exc
        if public != self.public:
            raise KeyFileError("public key does not belong to the secret key")

    def to_json(self) -> str:
        """The key pair as JSON text (with ``from_file`` and the node's pair when set)."""
        doc: dict[str, object] = {"public": self.public.decode(), "secret": self.secret.decode()}
        if self.from_file:
            doc["from_file"] = True
        if self.node is not None:
            doc["node"] = {"public": self.node.public.decode(), "secret": self.node.secret.decode()}
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str | bytes) -> CurveKeyPair:
        """Parse :meth:`to_json`'s output. Raises KeyFileError."""
        try:
            doc = parse(_PairDoc, text, what="key pair", strict=False)
        except ProtocolError as exc:
            raise KeyFileError(f"malformed key pair: {exc}") from exc
        node = doc.node
        return cls(
            doc.public.encode(),
            doc.secret.encode(),
            doc.from_file,
            None if node is None else cls(node.public.encode(), node.secret.encode()),
        )

    def derived_key(self, purpose: str) -> bytes:
        """A 32-byte key for ``purpose`` derived from this pair's secret key (HMAC-SHA256), so
        one secret serves several uses without one use revealing another's key."""
        return hmac.new(self.secret, f"ftmem/{purpose}".encode(), hashlib.sha256).digest()

    def with_node(self, node: CurveKeyPair) -> CurveKeyPair:
        """This pair carrying ``node`` as the node's own pair (for PEER_BIND)."""
        return CurveKeyPair(self.public, self.secret, self.from_file, node)


def generate() -> CurveKeyPair:
    """Return a new random key pair."""
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public=public, secret=secret)


def write_key_file(path: Path, pair: CurveKeyPair) -> None:
    """Write ``pair`` (its two keys only) to a new file ``path`` with mode 0600 (never
    overwrites)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(CurveKeyPair(pair.public, pair.secret).to_json() + "\n")


def read_key_file(path: Path) -> CurveKeyPair:
    """Read a key file: a regular file (not a symlink: it is opened with ``O_NOFOLLOW``) of
    this user or root that group and others can neither read nor write. The checks are made
    on the opened file (``fstat``), so a file swapped in between cannot pass them.

    Raises:
        KeyFileError: missing, a symlink, not a regular file, another user's, too open, too
            large, or malformed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise KeyFileError(f"cannot read key file {path}: {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {path} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise KeyFileError(
                f"key file {path} belongs to uid {st.st_uid}, not to this user "
                f"({os.geteuid()}) or root: another user may have planted it"
            )
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"key file {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it"
            )
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        raise KeyFileError(f"key file {path} is too large")
    pair = CurveKeyPair.from_json(data)
    return CurveKeyPair(pair.public, pair.secret, from_file=True)
