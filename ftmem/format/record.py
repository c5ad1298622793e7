"""Commit records: what a committed slot holds, as the SMP writes it next to the slot file.

The record is JSON with its own checksum (xxh64 of the body), so a torn or edited record is
refused. Its layout may lack checksums (committed, not yet verified when the SMP died): a
restarted SMP that adopts it hashes the slot before serving it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class CommitRecord:
    """What a committed slot holds."""

    rank: int
    slot: int
    gen: int
    capacity: int
    step: int
    seq: int
    layout: str


def encode_record(rec: CommitRecord) -> str:
    """The record's file text (body plus its checksum)."""
    body = json.dumps(
        {
            "version": RECORD_VERSION,
            "rank": rec.rank,
            "slot": rec.slot,
            "gen": rec.gen,
            "capacity": rec.capacity,
            "step": rec.step,
            "seq": rec.seq,
            "layout": rec.layout,
        },
        separators=(",", ":"),
    )
    return json.dumps({"record": body, "xxh64": xxhash.xxh64_hexdigest(body.encode())})


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed in a commit record")


def decode_record(text: str) -> CommitRecord:
    """Parse and check a record's file text.

    Raises:
        ValueError: malformed, corrupt, of another version, or fields of the wrong type.
    """
    if len(text) > MAX_RECORD_BYTES:
        raise ValueError("record too large")
    try:
        outer = json.loads(text, parse_constant=_no_constant)
        if not isinstance(outer, dict):
            raise ValueError("record is not an object")
        body = outer["record"]
        if not isinstance(body, str) or xxhash.xxh64_hexdigest(body.encode()) != outer["xxh64"]:
            raise ValueError("record checksum mismatch")
        d = json.loads(body, parse_constant=_no_constant)
        if not isinstance(d, dict):
            raise ValueError("record body is not an object")
        if d.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {d.get('version')!r} not supported")
        fields = {k: d[k] for k in ("rank", "slot", "gen", "capacity", "step", "seq")}
        layout = d["layout"]
    except (KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"malformed record: {exc!r}") from exc
    if not all(type(v) is int and 0 <= v < 1 << 62 for v in fields.values()):
        raise ValueError("record fields have the wrong types")
    if not isinstance(layout, str):
        raise ValueError("record layout is not a string")
    return CommitRecord(layout=layout, **fields)
