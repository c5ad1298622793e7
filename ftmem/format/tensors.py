"""The torch side of the snapshot format: dtype names, the skeleton's tensor markers and its
codec with torch's extension types, and the check of a stored snapshot's bytes.

The SMP never imports this module (it imports no torch); the client, the disk tiers and the
export do. Everything here is pure: no process, socket or file is touched.
"""

from __future__ import annotations

from typing import Any

import torch

from ftmem.errors import CorruptSnapshotError
from ftmem.format import skeleton as codec
from ftmem.format.layout import DTYPE_SIZES, StoredSnapshot, digest

TENSOR_MARK = "__ftmem_tensor__"
GATHER_MARK = "__ftmem_gather__"
"""Skeleton marker of a replicated tensor whose rows are spread over its replicas."""
REPLICAS_KEY = "__ftmem_replicas__"
"""Skeleton key of the table that says which replica holds which rows (see shard_replicated)."""

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
"""Every dtype a snapshot may hold, by its layout name."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
"""The layout name of every dtype a snapshot may hold (the inverse of DTYPES)."""


def dtype_name(dtype: torch.dtype) -> str:
    """Return the layout name of ``dtype`` (``"float32"``).

    Raises:
        ValueError: a dtype no snapshot may hold.
    """
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} is not supported")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name (validated by parse_layout)."""
    return DTYPES[name]


def _ext_encode(obj: Any) -> tuple[str, Any] | None:
    if isinstance(obj, torch.Size):
        return "size", [int(d) for d in obj]
    if isinstance(obj, torch.dtype):
        return "dtype", str(obj).removeprefix("torch.")
    return None


def _ext_decode(tag: str, value: Any) -> Any:
    if tag == "size" and isinstance(value, list) and all(type(d) is int for d in value):
        return torch.Size(value)
    if (
        tag == "dtype"
        and isinstance(value, str)
        and isinstance(getattr(torch, value, None), torch.dtype)
    ):
        return getattr(torch, value)
    raise ValueError(f"bad {tag!r} value in a skeleton")


def encode_skeleton(skeleton: dict[str, Any]) -> bytes:
    """Serialize a skeleton (tagged JSON, see :mod:`ftmem.format.skeleton`).

    Raises:
        ValueError: a value the codec cannot hold.
    """
    return codec.encode_skeleton(skeleton, _ext_encode)


def decode_skeleton(data: bytes) -> dict[str, Any]:
    """Read a skeleton back; never unpickles.

    Raises:
        CorruptSnapshotError: the bytes are not a valid skeleton.
    """
    out: dict[str, Any] = codec.decode_skeleton(data, _ext_decode)
    return out


def read_objects(snap: StoredSnapshot, view: memoryview) -> bytes:
    """The snapshot's encoded skeleton, checked against its checksum.

    Raises:
        CorruptSnapshotError: the snapshot is not verified or its objects are corrupt.
    """
    if not snap.verified:
        raise CorruptSnapshotError(f"step {snap.step} has not been verified by the SMP")
    objects = bytes(view[snap.objects_offset : snap.objects_offset + snap.objects_nbytes])
    if digest(objects) != snap.objects_hash:
        raise CorruptSnapshotError(f"step {snap.step}: the snapshot's objects fail their checksum")
    return objects
