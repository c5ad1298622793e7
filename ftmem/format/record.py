"""What a node's slots hold, as JSON: the commit record the SMP writes next to each committed
slot file, and the manifest of a node's protected step that a rebuilt node receives.

The record carries its own checksum (xxh64 of the body), so a torn or edited record is
refused. Its layout may lack checksums (committed, not yet verified when the SMP died): a
restarted SMP that adopts it hashes the slot before serving it. The manifest travels sealed
with the step's data (exchange/seals.py); it lists the node's ranks in the order their bytes
follow each other. Both are read by :func:`ftmem.typed_json.build` from these annotations.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import xxhash

from ftmem.config import MAX_SLOT_BYTES
from ftmem.errors import ProtocolError
from ftmem.typed_json import Most, Range, parse

RECORD_VERSION = 2
MAX_RECORD_BYTES = 64 << 20
_Count = Annotated[int, Range(0, (1 << 62) - 1)]
_Bytes = Annotated[int, Range(0, MAX_SLOT_BYTES)]
_Layout = Annotated[str, Most(MAX_RECORD_BYTES)]


@dataclass(frozen=True, slots=True)
class _SlotIdentity:
    """Which slot a record is of, and what it holds (every field of a record but the layout)."""

    rank: _Count
    slot: _Count
    gen: _Count
    capacity: _Count
    step: _Count
    seq: _Count


@dataclass(frozen=True, slots=True)
class CommitRecord(_SlotIdentity):
    """What a committed slot holds."""

    layout: _Layout


@dataclass(frozen=True, slots=True)
class _RecordHead(_SlotIdentity):
    """A record's first line: its identity and the format's version."""

    version: Annotated[int, Range(RECORD_VERSION, RECORD_VERSION)]


def record_text(fields: Mapping[str, Any]) -> str:
    """``fields`` as a record's file text: the fields but ``layout`` as one line of JSON, the
    layout as it is (JSON itself: never escaped, a large layout is written at every commit),
    and the xxh64 of the two, each part after a newline."""
    head = {k: v for k, v in fields.items() if k != "layout"}
    layout = str(fields.get("layout", ""))
    body = f"{json.dumps(head, separators=(',', ':'))}\n{layout}"
    return f"{body}\n{xxhash.xxh64_hexdigest(body.encode())}"


def encode_record(rec: CommitRecord) -> str:
    """The record's file text (:func:`record_text` of its fields and the version)."""
    head = (
        f'{{"version":{RECORD_VERSION},"rank":{int(rec.rank)},"slot":{int(rec.slot)},'
        f'"gen":{int(rec.gen)},"capacity":{int(rec.capacity)},"step":{int(rec.step)},'
        f'"seq":{int(rec.seq)}}}'
    )
    body = f"{head}\n{rec.layout}"  # as record_text writes it, without a dict and json.dumps
    return f"{body}\n{xxhash.xxh64_hexdigest(body.encode())}"


def decode_record(text: str) -> CommitRecord:
    """Parse and check a record's file text.

    Raises:
        ValueError: malformed, corrupt, of another version, or fields of the wrong type.
    """
    if len(text) > MAX_RECORD_BYTES:
        raise ValueError("record too large")
    first, last = text.find("\n"), text.rfind("\n")
    if first < 0 or last == first:
        raise ValueError("malformed record: not its fields, a layout and a checksum")
    try:
        if xxhash.xxh64_hexdigest(text[:last].encode()) != text[last + 1 :]:
            raise ValueError("record checksum mismatch")
        h = parse(_RecordHead, text[:first], what="commit record")
    except (ProtocolError, UnicodeEncodeError) as exc:
        raise ValueError(f"malformed record: {exc}") from exc
    return CommitRecord(h.rank, h.slot, h.gen, h.capacity, h.step, h.seq, text[first + 1 : last])


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One rank's part of a node's bytes."""

    rank: Annotated[int, Range(0, 1 << 31)]
    nbytes: _Bytes
    capacity: _Bytes
    """The rank's slot size (a rebuilt slot is made this large)."""
    layout: _Layout


@dataclass(frozen=True, slots=True)
class NodeManifest:
    """What a node's bytes of a protected step are: its ranks' parts, in order."""

    step: _Count
    ranks: Annotated[list[ManifestEntry], Most(1 << 16)]


def encode_manifest(manifest: NodeManifest) -> bytes:
    """The manifest as sent with the step (JSON)."""
    return json.dumps(dataclasses.asdict(manifest)).encode()


def decode_manifest(raw: bytes, step: int) -> NodeManifest:
    """Read a manifest of ``step``.

    Raises:
        ValueError: not a manifest, or one of another step.
    """
    try:
        got = parse(NodeManifest, raw or b"null", what="manifest")
    except ProtocolError as exc:
        raise ValueError(f"the manifest of step {step} is malformed: {exc}") from exc
    if got.step != step:
        raise ValueError(f"the manifest is of step {got.step}, not {step}")
    return got
