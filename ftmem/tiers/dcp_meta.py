"""DCP checkpoint metadata as JSON, and the global ``.metadata`` of a multi-node checkpoint.

A part's DCP ``Metadata`` is stored a second time as JSON in its manifest, so the coordinator
never unpickles a file another process wrote: it rebuilds ``Metadata`` from checked JSON
(:func:`metadata_from_json`) and pickles it itself, as DCP's ``FileSystemWriter.finish`` does
(:func:`write_metadata`). :func:`rebase` puts a part's relative paths under its sub-directory
(stock ``FileSystemReader`` joins ``relative_path`` to the checkpoint directory).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch

from ftmem.errors import CorruptSnapshotError

_MAX_DIMS = 64


def metadata_to_json(md: Any) -> dict[str, Any]:
    """A JSON-ready description of a DCP ``Metadata`` (tensors, byte entries, storage)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors: dict[str, Any] = {}
    byte_keys: list[str] = []
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": str(entry.properties.dtype).removeprefix("torch."),
                "size": list(entry.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks],
            }
        else:
            byte_keys.append(fqn)
    storage = [
        [
            idx.fqn,
            None if idx.offset is None else list(idx.offset),
            idx.index,
            info.relative_path,
            int(info.offset),
            int(info.length),
            None if info.transform_descriptors is None else list(info.transform_descriptors),
        ]
        for idx, info in (md.storage_data or {}).items()
    ]
    planner = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {
        "version": md.version,
        "tensors": tensors,
        "bytes": byte_keys,
        "planner": planner,
        "storage": storage,
    }


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS or not all(map(_count, value)):
        raise CorruptSnapshotError(f"bad {what} in part metadata")
    return value


def _count(v: Any) -> bool:
    """A non-negative integer that fits int64."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _relative(path: Any) -> str:
    """A storage path inside the checkpoint: relative, no ``..``, at most one sub-directory."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path:
        raise CorruptSnapshotError(f"bad storage path {path!r} in part metadata")
    parts = path.split("/")
    if len(parts) > 2 or any(p in ("", ".", "..") for p in parts):
        raise CorruptSnapshotError(f"storage path {path!r} leaves the checkpoint")
    return path


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptSnapshotError(f"bad dtype {name!r} in part metadata")
    return dtype


def metadata_from_json(doc: Any) -> Any:
    """Rebuild a DCP ``Metadata`` from :func:`metadata_to_json`'s output, checking every field.

    Raises:
        CorruptSnapshotError: a field is missing or of the wrong type.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    try:
        sdm: dict[str, Any] = {}
        for fqn, t in dict(doc["tensors"]).items():
            chunks = []
            for c in list(t["chunks"]):
                if not isinstance(c, list) or len(c) != 2:
                    raise CorruptSnapshotError("bad chunk in part metadata")
                chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(_ints(c[0], "offsets")),
                        sizes=torch.Size(_ints(c[1], "sizes")),
                    )
                )
            sdm[str(fqn)] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(t["dtype"])),
                size=torch.Size(_ints(t["size"], "size")),
                chunks=chunks,
            )
        for fqn in list(doc["bytes"]):
            sdm[str(fqn)] = BytesStorageMetadata()
        storage: dict[Any, Any] = {}
        for fqn, off, index, rel, offset, length, transforms in list(doc["storage"]):
            _relative(rel)
            if not _count(offset) or not _count(length):
                raise CorruptSnapshotError("bad storage entry in part metadata")
            key = MetadataIndex(
                str(fqn), None if off is None else _ints(off, "offset"), _index(index)
            )
            storage[key] = _StorageInfo(
                rel, offset, length, None if transforms is None else [str(x) for x in transforms]
            )
        planner = {str(k): tuple(v) for k, v in dict(doc["planner"]).items()}
        return Metadata(
            state_dict_metadata=sdm,
            planner_data=planner,
            storage_data=storage,
            version=None if doc.get("version") is None else str(doc["version"]),
        )
    except CorruptSnapshotError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptSnapshotError(f"malformed part metadata: {exc!r}") from exc


def _index(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CorruptSnapshotError("bad chunk index in part metadata")


def rebase(doc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A copy of a JSON metadata description whose files live under ``prefix/``."""
    out = dict(doc)
    out["storage"] = [[*e[:3], f"{prefix}/{e[3]}", *e[4:]] for e in doc["storage"]]
    return out


def write_metadata(directory: Path, md: Any) -> None:
    """Write ``directory/.metadata`` as DCP's ``FileSystemWriter`` does (tmp, fsync, rename)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    md.storage_meta = StorageMeta(checkpoint_id=str(directory))
    tmp = directory / ".metadata.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(md, f)  # what DCP's reader expects; we write it, we never load it here
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, directory / ".metadata")
