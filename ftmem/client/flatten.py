"""State dict <-> (tensors, skeleton, layout) as pure functions.

A *state* follows torch.distributed.checkpoint's conventions: a dict whose values are
tensors, nested dicts/lists/tuples, plain Python values, or ``Stateful`` objects (with
``state_dict()`` and ``load_state_dict()``). Flattening yields the tensors (with a name
each) and a *skeleton*: the same structure with every tensor replaced by a marker. The
skeleton is stored with ``torch.save`` and read back with ``torch.load(weights_only=True)``,
so nothing in a snapshot is ever unpickled beyond that allow-list.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ftmem.errors import CorruptSnapshotError
from ftmem.shm import ALIGN

TENSOR_MARK = "__ftmem_tensor__"
LAYOUT_VERSION = 1
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype)

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


def is_stateful(obj: Any) -> bool:
    """True if ``obj`` follows the Stateful protocol (state_dict and load_state_dict)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


@dataclass(frozen=True, slots=True)
class Flat:
    """A flattened state: tensors in discovery order, their names, and the skeleton."""

    tensors: list[torch.Tensor]
    names: list[str]
    skeleton: dict[str, Any]


def flatten_state(state: Mapping[str, Any]) -> Flat:
    """Flatten ``state`` (calling ``state_dict()`` on Stateful values).

    Raises:
        ValueError: a value that cannot be snapshotted (e.g. an arbitrary object, a sparse
            or meta tensor, a non-string top-level key).
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []

    def walk(obj: Any, name: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.is_sparse or obj.is_meta or obj.is_quantized or type(obj) is not torch.Tensor:
                raise ValueError(f"{name}: {type(obj).__name__} tensors are not supported yet")
            tensors.append(obj.detach())
            names.append(name)
            return (TENSOR_MARK, len(tensors) - 1)
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, (str, int)):
                    raise ValueError(f"{name}: key {k!r} must be str or int")
                out[k] = walk(v, f"{name}.{k}")
            return out
        if isinstance(obj, list):
            return [walk(v, f"{name}.{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return tuple(walk(v, f"{name}.{i}") for i, v in enumerate(obj))
        if isinstance(obj, _PLAIN):
            return obj
        raise ValueError(
            f"{name}: cannot snapshot a {type(obj).__name__}; use tensors, plain Python "
            "values, or an object with state_dict()/load_state_dict()"
        )

    skeleton: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise ValueError(f"top-level key {key!r} must be a string")
        sd = (
            value.state_dict()
            if is_stateful(value) and not isinstance(value, torch.Tensor)
            else value
        )
        skeleton[key] = walk(sd, key)
    return Flat(tensors, names, skeleton)


def encode_skeleton(skeleton: dict[str, Any]) -> bytes:
    """Serialize a skeleton with torch.save (readable by torch.load(weights_only=True))."""
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return buf.getvalue()


def decode_skeleton(data: bytes) -> dict[str, Any]:
    """Read a skeleton back with torch.load(weights_only=True).

    Raises:
        CorruptSnapshotError: the bytes are not a valid skeleton.
    """
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CorruptSnapshotError(f"snapshot objects cannot be decoded: {exc}") from exc
    if not isinstance(obj, dict):
        raise CorruptSnapshotError("snapshot objects are not a dict")
    return obj


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, slots=True)
class TensorExtent:
    """Where one tensor lives in a slot."""

    index: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    """Tensor placement in a slot (reused while names, dtypes and shapes stay the same)."""

    extents: tuple[TensorExtent, ...]
    tensors_end: int

    def signature(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """What must stay equal for the layout to be reused."""
        return tuple((e.name, e.dtype, e.shape) for e in self.extents)


def dtype_name(dtype: torch.dtype) -> str:
    """Return the layout name of ``dtype`` (``"float32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype} is not supported")
    return name


def signature_of(flat: Flat) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """The layout signature of a flattened state."""
    return tuple(
        (n, dtype_name(t.dtype), tuple(t.shape))
        for n, t in zip(flat.names, flat.tensors, strict=True)
    )


def plan_layout(flat: Flat) -> Layout:
    """Place every tensor of ``flat`` in a slot, largest first, each aligned to ALIGN bytes."""
    order = sorted(range(len(flat.tensors)), key=lambda i: -flat.tensors[i].nbytes)
    offset = 0
    extents = []
    for i in order:
        t = flat.tensors[i]
        extents.append(
            TensorExtent(i, flat.names[i], dtype_name(t.dtype), tuple(t.shape), offset, t.nbytes)
        )
        offset = _align(offset + t.nbytes)
    return Layout(tuple(sorted(extents, key=lambda e: e.index)), offset)


def layout_json(layout: Layout, step: int, hashes: list[str], objects: tuple[int, int, str]) -> str:
    """Return the committed description of a snapshot (JSON text, sent to the SMP)."""
    doc = {
        "version": LAYOUT_VERSION,
        "step": step,
        "tensors": [
            {
                "i": e.index,
                "name": e.name,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "offset": e.offset,
                "nbytes": e.nbytes,
                "hash": h,
            }
            for e, h in zip(layout.extents, hashes, strict=True)
        ],
        "objects": {"offset": objects[0], "nbytes": objects[1], "hash": objects[2]},
    }
    return json.dumps(doc, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor as described by a committed layout."""

    index: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    hash: str


@dataclass(frozen=True, slots=True)
class StoredSnapshot:
    """A committed snapshot's parsed, validated layout."""

    step: int
    tensors: tuple[StoredTensor, ...]
    objects_offset: int
    objects_nbytes: int
    objects_hash: str


def parse_layout(text: str, capacity: int) -> StoredSnapshot:
    """Parse and validate a committed layout against a slot of ``capacity`` bytes.

    Raises:
        CorruptSnapshotError: anything malformed, out of bounds or inconsistent.
    """
    try:
        doc = json.loads(text)
        if doc["version"] != LAYOUT_VERSION:
            raise CorruptSnapshotError(f"layout version {doc['version']} is not supported")
        step = int(doc["step"])
        tensors = []
        for n, e in enumerate(doc["tensors"]):
            dtype = DTYPES[e["dtype"]]
            shape = tuple(int(s) for s in e["shape"])
            if any(s < 0 for s in shape):
                raise CorruptSnapshotError("negative dimension")
            numel = 1
            for s in shape:
                numel *= s
            nbytes = int(e["nbytes"])
            off = int(e["offset"])
            if nbytes != numel * dtype.itemsize or off < 0 or off + nbytes > capacity:
                raise CorruptSnapshotError(f"tensor {e['name']!r} has an inconsistent extent")
            if int(e["i"]) != n:
                raise CorruptSnapshotError("tensor indices are out of order")
            tensors.append(
                StoredTensor(n, str(e["name"]), dtype, shape, off, nbytes, str(e["hash"]))
            )
        obj = doc["objects"]
        ooff, on = int(obj["offset"]), int(obj["nbytes"])
        if ooff < 0 or on < 0 or ooff + on > capacity:
            raise CorruptSnapshotError("objects extent is outside the slot")
        return StoredSnapshot(step, tuple(tensors), ooff, on, str(obj["hash"]))
    except CorruptSnapshotError:
        raise
    except (KeyError, TypeError, ValueError, json.JSONDecodeError, RecursionError) as exc:
        raise CorruptSnapshotError(f"malformed snapshot layout: {exc!r}") from exc
