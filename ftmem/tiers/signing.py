"""The tier key and the signatures on checkpoint manifests.

A disk tier may sit where others can write (a shared file system, a directory someone else
made). A checkpoint there is trusted only if its manifest carries an HMAC-SHA256, made with
the tier key, over the manifest's canonical JSON; the manifest lists every file's size and
hash, so a checked signature covers every byte of the checkpoint. The signature is checked
before any other file of the checkpoint is opened.

The tier key is 32 random bytes (hex text) in a file only its owner can read:
``$FTMEM_TIER_KEY_FILE`` if set, else ``$XDG_CONFIG_HOME/ftmem/tier.key`` (default
``~/.config/ftmem/tier.key``). The first writer of a checkpoint creates it. Every process that
writes or reads the job's tiers (the SMPs and their flush workers, the ranks' disk fallback,
``ftmem`` commands) must see the same file: on several hosts without a shared home, copy it
(mode 0600) and point ``FTMEM_TIER_KEY_FILE`` at it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

from ftmem.config import ENV_TIER_KEY_FILE
from ftmem.errors import CorruptSnapshotError, UnsafePathError
from ftmem.secure_fs import create_private_file, ensure_private_dir, read_private_file

SIGNATURE_FIELD = "hmac"
_KEY_HEX_LEN = 64


def key_path() -> Path:
    """Where the tier key lives (see the module docstring)."""
    env = os.environ.get(ENV_TIER_KEY_FILE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "ftmem" / "tier.key"


def _parse(data: bytes, path: Path) -> bytes:
    text = data.strip()
    try:
        if len(text) != _KEY_HEX_LEN:
            raise ValueError(f"{len(text)} characters")
        return bytes.fromhex(text.decode("ascii"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UnsafePathError(
            f"tier key {path} is malformed ({exc}); it must hold 64 hex digits"
        ) from exc


def tier_key(create: bool) -> bytes:
    """The tier key; with ``create``, make it first if it does not exist (mode 0600; its
    directory 0700).

    Raises:
        UnsafePathError: the key is missing (and not ``create``), malformed, not this
            user's, or readable by others.
    """
    path = key_path()
    if create and not os.path.lexists(path):
        if not os.environ.get(ENV_TIER_KEY_FILE):
            path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            ensure_private_dir(path.parent, "ftmem's configuration directory")
        create_private_file(path, secrets.token_hex(32).encode() + b"\n")
    try:
        return _parse(read_private_file(path, "tier key", max_bytes=256), path)
    except UnsafePathError as exc:
        if not os.path.lexists(path):
            raise UnsafePathError(
                f"no tier key at {path}: checkpoints cannot be checked (set "
                f"{ENV_TIER_KEY_FILE} to the key file the job's checkpoints were written with)"
            ) from exc
        raise


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SIGNATURE_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(doc: dict[str, Any], key: bytes) -> dict[str, Any]:
    """A copy of the manifest ``doc`` with its signature field set."""
    mac = hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()
    return {**doc, SIGNATURE_FIELD: mac}


def verify(doc: dict[str, Any], where: Path, key: bytes | None = None) -> None:
    """Check the signature of the manifest ``doc`` (of checkpoint ``where``) with ``key``
    (default: the tier key, read only when the manifest carries a signature).

    Raises:
        CorruptSnapshotError: no signature, or one not made with the key.
        UnsafePathError: there is no usable tier key (see :func:`tier_key`).
    """
    mac = doc.get(SIGNATURE_FIELD)
    if not isinstance(mac, str):
        raise CorruptSnapshotError(f"{where}: the manifest is not signed (not written by ftmem)")
    if key is None:
        key = tier_key(create=False)
    try:
        want = hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()
    except (TypeError, ValueError) as exc:
        raise CorruptSnapshotError(f"{where}: the manifest cannot be checked ({exc})") from exc
    if not hmac.compare_digest(mac, want):
        raise CorruptSnapshotError(
            f"{where}: the manifest's signature does not match the tier key {key_path()} "
            "(written with another key, or altered)"
        )
