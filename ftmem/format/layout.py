"""Slot layouts: where each tensor of a snapshot lives, its checksum, and the objects extent.

A layout is JSON text. The client commits it without checksums; the SMP hashes the slot and
fills them in: the snapshot is then *verified*. Every reader parses it with
:func:`parse_layout`, the one validator, against the capacity of the slot it describes.

Document (version 2)::

    {"version": 2, "step": 12,
     "tensors": [{"i": 0, "name": "model.w", "dtype": "float32", "shape": [4, 4],
                  "offset": 0, "nbytes": 64, "hash": "<xxh3-64 hex or empty>",
                  "chunk": {"shape": [8, 4], "offset": [4, 0]}}, ...],
     "objects": {"offset": 128, "nbytes": 300, "hash": "..."},
     "unsharded_nbytes": 0}

An extent's checksum is its *digest* (:func:`digest`): the xxh3-64 (which releases the GIL)
of each piece of ``HASH_PIECE`` bytes, in hex, joined by ``.``. Pieces let the SMP hash one
large tensor on several threads, and let a restore check each piece just before it copies it,
so no corrupt byte is ever written into a live tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

import xxhash

from ftmem.errors import CorruptSnapshotError, ProtocolError
from ftmem.typed_json import Most, Range, build

LAYOUT_VERSION = 2
MAX_TENSORS = 1 << 20
HASH_PIECE = 4 << 20
"""Bytes per checksummed piece of an extent."""
_HEX = 16  # characters of one xxh3-64 hex digest

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Every dtype a snapshot may hold (torch's name without ``torch.``) and its item size."""


def hash_bytes(view: memoryview | bytes) -> str:
    """Return the checksum (xxh3-64, hex) of ``view``; releases the GIL for large buffers."""
    return xxhash.xxh3_64_hexdigest(view)


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """The (start, end) of each checksummed piece of an extent of ``nbytes`` (at least one)."""
    if nbytes <= HASH_PIECE:
        return [(0, nbytes)]
    return [(i, min(nbytes, i + HASH_PIECE)) for i in range(0, nbytes, HASH_PIECE)]


def digest(view: memoryview | bytes) -> str:
    """The checksum of an extent: each piece's xxh3-64 (hex), joined by ``.``."""
    return ".".join(hash_bytes(view[a:b]) for a, b in pieces(len(view)))


def piece_hashes(text: str, nbytes: int) -> list[str]:
    """Split a digest into its pieces' hashes (empty list: not verified yet).

    Raises:
        CorruptSnapshotError: the digest does not have one hash per piece.
    """
    if not text:
        return []
    parts = text.split(".")
    if len(parts) != len(pieces(nbytes)) or any(len(p) != _HEX for p in parts):
        raise CorruptSnapshotError("a checksum does not match its extent's pieces")
    return parts


@dataclass(frozen=True, slots=True)
class ChunkOf:
    """A stored tensor that is one chunk of a larger (global) tensor: a DTensor's local shard,
    or the rows of a replicated tensor that this replica keeps."""

    shape: tuple[int, ...]
    """The global tensor's shape."""
    offset: tuple[int, ...]
    """Where the chunk starts in the global tensor (one entry per dimension)."""


@dataclass(frozen=True, slots=True)
class TensorExtent:
    """Where one tensor lives in a slot (what the client plans; no checksum)."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    chunk: ChunkOf | None = None


@dataclass(frozen=True, slots=True)
class StoredTensor(TensorExtent):
    """A tensor as described by a committed layout (``hash`` empty until verified)."""

    hash: str = ""


@dataclass(frozen=True, slots=True)
class StoredSnapshot:
    """A committed snapshot's parsed, validated layout."""

    step: int
    tensors: tuple[StoredTensor, ...]
    objects_offset: int
    objects_nbytes: int
    objects_hash: str
    unsharded_nbytes: int = 0

    @property
    def verified(self) -> bool:
        """Every extent carries its checksum (the SMP has hashed the slot)."""
        return bool(self.objects_hash) and all(t.hash for t in self.tensors)

    @property
    def used_bytes(self) -> int:
        """The end of the last extent: the bytes of the slot the snapshot uses."""
        ends = [t.offset + t.nbytes for t in self.tensors]
        return max([self.objects_offset + self.objects_nbytes, *ends])

    def extents(self) -> list[tuple[str, int, int, str]]:
        """(name, offset, nbytes, hash) of the objects and of every tensor, objects first."""
        out = [("objects", self.objects_offset, self.objects_nbytes, self.objects_hash)]
        out += [(t.name, t.offset, t.nbytes, t.hash) for t in self.tensors]
        return out


def tensors_json(extents: tuple[TensorExtent, ...] | list[TensorExtent]) -> str:
    """The ``tensors`` array of a layout without checksums (the client caches it per layout)."""
    out = []
    for e in extents:
        entry: dict[str, Any] = {
            "i": e.index,
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "offset": e.offset,
            "nbytes": e.nbytes,
            "hash": "",
        }
        if e.chunk is not None:
            entry["chunk"] = {"shape": list(e.chunk.shape), "offset": list(e.chunk.offset)}
        out.append(entry)
    return json.dumps(out, separators=(",", ":"))


def layout_json(
    tensors: str,
    step: int,
    objects: tuple[int, int],
    unsharded_nbytes: int = 0,
    objects_hash: str = "",
) -> str:
    """The layout of one snapshot: ``tensors`` from :func:`tensors_json` (or with checksums),
    ``objects`` the (offset, nbytes) of the encoded skeleton and ``objects_hash`` its digest
    ("" as the client commits it)."""
    head = (
        f'{{"version":{LAYOUT_VERSION},"step":{int(step)},'
        f'"objects":{{"offset":{int(objects[0])},"nbytes":{int(objects[1])},'
        f'"hash":"{objects_hash}"}},"unsharded_nbytes":{int(unsharded_nbytes)},"tensors":'
    )
    return head + tensors + "}"


def with_hashes(text: str, hashes: list[str], objects_hash: str) -> str:
    """Return layout ``text`` with every tensor's checksum and the objects' filled in.

    Raises:
        CorruptSnapshotError: ``text`` is not a layout or the hash count differs.
    """
    doc = _load(text)
    tensors = doc.get("tensors")
    if not isinstance(tensors, list) or len(tensors) != len(hashes):
        raise CorruptSnapshotError("layout and checksums do not match")
    for entry, h in zip(tensors, hashes, strict=True):
        entry["hash"] = h
    doc["objects"]["hash"] = objects_hash
    return json.dumps(doc, separators=(",", ":"))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a layout")


def _load(text: str) -> dict[str, Any]:
    try:
        doc = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise CorruptSnapshotError(f"layout is not JSON: {exc!r}") from exc
    if not isinstance(doc, dict):
        raise CorruptSnapshotError("layout is not an object")
    return doc


# The document's grammar (typed_json.build; unknown fields are ignored):
Size = Annotated[int, Range(0, 1 << 62)]
Dims = Annotated[tuple[Size, ...], Most(64)]


@dataclass(slots=True)
class _ChunkDoc:  # read once, never kept
    shape: Dims
    offset: Dims


@dataclass(slots=True)
class _TensorDoc:  # read once, never kept
    i: Size
    name: Annotated[str, Most(4096)]
    dtype: Annotated[str, Most(32)]
    shape: Dims
    offset: Size
    nbytes: Size
    hash: str = ""  # its length is checked against the extent's pieces (_checked_hash)
    chunk: _ChunkDoc | None = None


@dataclass(slots=True)
class _ObjectsDoc:  # read once, never kept
    offset: Size
    nbytes: Size
    hash: str = ""  # its length is checked against the extent's pieces (_checked_hash)


@dataclass(slots=True)
class _LayoutDoc:  # read once, never kept
    version: int
    step: Size
    tensors: Annotated[list[_TensorDoc], Most(MAX_TENSORS)]
    objects: _ObjectsDoc
    unsharded_nbytes: Size = 0


def _checked_hash(h: str, nbytes: int) -> str:
    if len(h) > len(pieces(nbytes)) * (_HEX + 1):
        raise CorruptSnapshotError("a checksum is longer than its extent's pieces")
    piece_hashes(h, nbytes)
    return h


def _tensor(n: int, e: _TensorDoc, capacity: int) -> StoredTensor:
    if e.dtype not in DTYPE_SIZES:
        raise CorruptSnapshotError(f"tensor {e.name!r} has unknown dtype {e.dtype!r}")
    numel = 1
    for d in e.shape:
        numel *= d
    if e.nbytes != numel * DTYPE_SIZES[e.dtype] or e.offset + e.nbytes > capacity:
        raise CorruptSnapshotError(f"tensor {e.name!r} has an inconsistent extent")
    if e.i != n:
        raise CorruptSnapshotError("tensor indices are out of order")
    chunk = None
    if e.chunk is not None:
        shape, offset = e.chunk.shape, e.chunk.offset
        if len(shape) != len(e.shape) or len(offset) != len(e.shape):
            raise CorruptSnapshotError("chunk rank differs from the tensor's")
        if any(o + k > g for o, k, g in zip(offset, e.shape, shape, strict=True)):
            raise CorruptSnapshotError("chunk lies outside its global tensor")
        chunk = ChunkOf(shape, offset)
    h = _checked_hash(e.hash, e.nbytes)
    return StoredTensor(n, e.name, e.dtype, e.shape, e.offset, e.nbytes, chunk, h)


def parse_layout(text: str, capacity: int) -> StoredSnapshot:
    """Parse and validate a layout against a slot of ``capacity`` bytes.

    Checksums may be empty (committed, not yet verified): see :attr:`StoredSnapshot.verified`.

    Raises:
        CorruptSnapshotError: anything malformed, out of bounds or inconsistent.
    """
    raw = _load(text)
    if raw.get("version") != LAYOUT_VERSION:
        raise CorruptSnapshotError(f"layout version {raw.get('version')!r} is not supported")
    try:
        doc: _LayoutDoc = build(_LayoutDoc, raw, what="the layout", strict=False)
    except ProtocolError as exc:
        raise CorruptSnapshotError(f"malformed layout: {exc}") from None
    tensors = tuple(_tensor(n, e, capacity) for n, e in enumerate(doc.tensors))
    obj = doc.objects
    if obj.offset + obj.nbytes > capacity:
        raise CorruptSnapshotError("objects extent is outside the slot")
    oh = _checked_hash(obj.hash, obj.nbytes)
    return StoredSnapshot(doc.step, tensors, obj.offset, obj.nbytes, oh, doc.unsharded_nbytes)


_NO_HASH = '"hash":""'


@dataclass(frozen=True, slots=True)
class RegisteredLayout:
    """A layout's ``tensors`` array, validated once when a rank registers it with the SMP
    (each COMMIT then names it by id)."""

    tensors: tuple[StoredTensor, ...]
    end: int
    """The end of the last tensor extent: a slot must be at least this big."""
    parts: tuple[str, ...]
    """The registered ``tensors`` array split at each tensor's empty checksum."""

    def snapshot(
        self, step: int, objects: tuple[int, int], unsharded_nbytes: int, capacity: int
    ) -> StoredSnapshot:
        """The snapshot of ``step`` committed with this layout into a slot of ``capacity``.

        Raises:
            CorruptSnapshotError: the tensors or the objects extent do not fit the slot.
        """
        if self.end > capacity or objects[0] + objects[1] > capacity:
            raise CorruptSnapshotError("the layout does not fit its slot")
        return StoredSnapshot(step, self.tensors, *objects, "", unsharded_nbytes)

    def render(self, snap: StoredSnapshot, digests: list[str]) -> str:
        """The layout document of ``snap`` with every checksum filled in (``digests`` ordered as
        :meth:`StoredSnapshot.extents`), built by joining strings: nothing is parsed again.

        Raises:
            CorruptSnapshotError: the number of digests does not match.
        """
        if len(digests) != len(self.tensors) + 1:
            raise CorruptSnapshotError("layout and checksums do not match")
        filled = [self.parts[0]]
        for part, h in zip(self.parts[1:], digests[1:], strict=True):
            filled.append(f'"hash":"{h}"')
            filled.append(part)
        return self._document("".join(filled), snap, digests[0])

    def render_unverified(self, snap: StoredSnapshot) -> str:
        """The layout document of ``snap`` as committed: every checksum empty (the registered
        text as it is)."""
        return self._document(_NO_HASH.join(self.parts), snap, "")

    @staticmethod
    def _document(tensors: str, snap: StoredSnapshot, objects_hash: str) -> str:
        objects = (snap.objects_offset, snap.objects_nbytes)
        return layout_json(tensors, snap.step, objects, snap.unsharded_nbytes, objects_hash)


def register_layout(text: str, max_bytes: int) -> RegisteredLayout:
    """Validate a layout's ``tensors`` array (as :func:`tensors_json` makes it: no
    checksums) for slots of at most ``max_bytes``.

    Raises:
        CorruptSnapshotError: anything malformed, out of bounds, or carrying checksums.
    """
    snap = parse_layout(layout_json(text, 0, (0, 0)), max_bytes)
    parts = tuple(text.split(_NO_HASH))
    if any(t.hash for t in snap.tensors) or len(parts) != len(snap.tensors) + 1:
        raise CorruptSnapshotError("a registered layout must carry no checksums")
    end = max((t.offset + t.nbytes for t in snap.tensors), default=0)
    return RegisteredLayout(snap.tensors, end, parts)
