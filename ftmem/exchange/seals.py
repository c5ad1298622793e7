"""Seals: what a node commits about each step it protects, so that its replacement can check a
rebuilt snapshot against the lost node's own word rather than its peers'.

With its size and manifest (SIZE) a node sends its peers a *seal* of the step: ``digest``,
xxh3-128 of its snapshot bytes, and ``tag``, HMAC-SHA256 under a key derived from the job's
secret key and the node's index over (step, node, size, digest, manifest). Every peer keeps it
with the parity and hands it back (META) to the node that rebuilds the step, which recomputes
the tag with the job key of the key file (``--ftmem-key-file``) and refuses the rebuild if the
tag or the rebuilt bytes' digest do not match (rebuilder.py).

What this promises: a peer that changed the manifest, size, digest or data it serves, without
the job's secret key, is caught. The key is symmetric: a seal is no defence against a key
holder. Without a key file the job's pair is remade every round, so the replacement cannot
recompute the lost node's tag: only the digest is checked, which catches corruption, not a
peer that changes data and digest together. The digest is xxh3, not a cryptographic hash,
for the same reason (whoever could forge data to match it could forge the tag too), and it is
computed on every protected step beside training.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import xxhash

from ftmem.exchange.keys import CurveKeyPair
from ftmem.exchange.segments import SegmentedBytes

_PIECE = 64 << 20


@dataclass(frozen=True, slots=True)
class Seal:
    """A node's seal of one step: its bytes' digest and its tag (both hex; "" when unknown)."""

    digest: str = ""
    tag: str = ""


def digest_of(data: SegmentedBytes) -> str:
    """xxh3-128 of every byte of ``data`` (read piece by piece, no copy of the whole)."""
    h = xxhash.xxh3_128()
    for off in range(0, data.nbytes, _PIECE):
        h.update(data.read(off, min(_PIECE, data.nbytes - off)))
    return h.hexdigest()


def seal(
    job: CurveKeyPair, node: int, step: int, nbytes: int, digest: str, manifest: bytes
) -> Seal:
    """Node ``node``'s seal of ``step`` (``nbytes`` bytes of digest ``digest``, ``manifest``)."""
    msg = f"ftmem-seal-v1\0{step}\0{node}\0{nbytes}\0{digest}\0".encode()
    msg += hashlib.sha256(manifest).digest()
    key = job.derived_key(f"seal/{node}")
    return Seal(digest, hmac.new(key, msg, hashlib.sha256).hexdigest())


def check(job: CurveKeyPair, node: int, step: int, nbytes: int, manifest: bytes, got: Seal) -> bool:
    """True if ``got`` is node ``node``'s seal of ``step`` with this size and manifest
    (compared in constant time)."""
    want = seal(job, node, step, nbytes, got.digest, manifest)
    return bool(got.tag) and hmac.compare_digest(want.tag, got.tag)
