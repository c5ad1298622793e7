"""Checkpoints on disk: names, the manifest that makes one complete, listing, checking, pruning.

A tier is a directory; each checkpoint in it is a DCP directory ``step_<N>`` (zero-padded so
names sort by step). A checkpoint is *complete* when its directory exists under its final name
(it is renamed there only after every file is written and fsynced) and holds
``ftmem-manifest.json``: the step, the world size and every file's size and xxh3-64. Anything
else in a tier (``*.tmp-<pid>`` left by a killed writer, a directory without a manifest) is
never listed as a checkpoint and is removed by :func:`prune`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ftmem._logging import get_logger
from ftmem.errors import CorruptSnapshotError

log = get_logger(__name__)

MANIFEST = "ftmem-manifest.json"
_NAME_RE = re.compile(r"^step_(\d{10})$")
_CHUNK = 8 << 20
_MAX_MANIFEST = 1 << 20


def checkpoint_name(step: int) -> str:
    """The directory name of step ``step``'s checkpoint."""
    return f"step_{step:010d}"


def file_hash(path: Path) -> str:
    """xxh3-64 (hex) of a file's bytes."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, step: int, world_size: int) -> None:
    """List every file of ``directory`` with its size and hash in its manifest (fsynced)."""
    files = {
        p.name: {"bytes": p.stat().st_size, "xxh3": file_hash(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    doc = {"version": 1, "step": step, "world_size": world_size, "files": files}
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint found in a tier (its files not yet verified)."""

    path: Path
    step: int
    world_size: int
    nbytes: int
    files: dict[str, tuple[int, str]]


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint's manifest and check that every listed file has its size.

    Raises:
        CorruptSnapshotError: no or a malformed manifest, or a file missing or truncated.
    """
    mpath = path / MANIFEST
    try:
        if mpath.stat().st_size > _MAX_MANIFEST:
            raise CorruptSnapshotError(f"{mpath} is too large")
        doc = json.loads(mpath.read_text())
        files = {
            str(name): (int(v["bytes"]), str(v["xxh3"])) for name, v in dict(doc["files"]).items()
        }
        step, world = int(doc["step"]), int(doc["world_size"])
    except CorruptSnapshotError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptSnapshotError(f"{path}: no valid manifest ({exc})") from exc
    for name, (size, _) in files.items():
        if "/" in name or name.startswith("."):
            if name != ".metadata":
                raise CorruptSnapshotError(f"{path}: manifest names a bad file {name!r}")
        try:
            actual = (path / name).stat().st_size
        except OSError as exc:
            raise CorruptSnapshotError(f"{path}: {name} is missing") from exc
        if actual != size:
            raise CorruptSnapshotError(f"{path}: {name} has {actual} bytes, expected {size}")
    return Checkpoint(path, step, world, sum(s for s, _ in files.values()), files)


def verify_checkpoint(ckpt: Checkpoint) -> None:
    """Check every file's hash against the manifest (reads all of it).

    Raises:
        CorruptSnapshotError: naming the first file that does not match.
    """
    for name, (_, want) in sorted(ckpt.files.items()):
        got = file_hash(ckpt.path / name)
        if got != want:
            raise CorruptSnapshotError(f"{ckpt.path}: {name} fails its checksum")


def list_checkpoints(tier: Path) -> tuple[list[Checkpoint], list[tuple[Path, str]]]:
    """Complete checkpoints of ``tier``, newest first, and what else is there (path, why)."""
    good: list[Checkpoint] = []
    other: list[tuple[Path, str]] = []
    if not tier.is_dir():
        return good, other
    for p in sorted(tier.iterdir()):
        mt = _NAME_RE.match(p.name)
        if not mt or not p.is_dir():
            other.append((p, "partial (a writer was stopped)" if ".tmp-" in p.name else "not ours"))
            continue
        try:
            ck = read_checkpoint(p)
        except CorruptSnapshotError as exc:
            other.append((p, f"incomplete: {exc}"))
            continue
        if ck.step != int(mt.group(1)):
            other.append((p, f"manifest says step {ck.step}"))
            continue
        good.append(ck)
    good.sort(key=lambda c: c.step, reverse=True)
    return good, other


def prune(tier: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints; remove older ones and partial leftovers
    of writers that are gone. Returns what was removed."""
    good, other = list_checkpoints(tier)
    removed = [c.path for c in good[keep:]]
    for p, why in other:
        if ".tmp-" in p.name and not _writer_alive(p.name):
            removed.append(p)
        elif why.startswith("incomplete"):
            removed.append(p)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    if removed:
        log.info("pruned %s", ", ".join(p.name for p in removed))
    return removed


def _writer_alive(name: str) -> bool:
    from ftmem._process import pid_alive

    try:
        return pid_alive(int(name.rsplit(".tmp-", 1)[1]))
    except ValueError:
        return False


def copy_checkpoint(ckpt: Checkpoint, tier: Path) -> Path:
    """Copy a complete checkpoint into another tier (tmp dir, fsync, rename); return its path.

    The copy's files are checked against the manifest before the rename.

    Raises:
        OSError: the copy failed (e.g. the tier is full); nothing is left behind.
        CorruptSnapshotError: the source does not match its manifest.
    """
    tier.mkdir(parents=True, exist_ok=True)
    final = tier / ckpt.path.name
    tmp = tier / f"{ckpt.path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700)  # the checkpoint holds the model: owner only
        for name in [*sorted(ckpt.files), MANIFEST]:
            shutil.copyfile(ckpt.path / name, tmp / name)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        verify_checkpoint(read_checkpoint(tmp))
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(tier)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def fsync_dir(directory: Path) -> None:
    """fsync a directory (makes a rename or a new file in it durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
