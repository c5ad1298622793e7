"""Assemble the nodes' parts of a step into one global DCP checkpoint (the commit point).

Each node's flush worker writes a *part* (``step_<N>.part-r<first rank>``) into the shared
tier, its manifest carrying its DCP metadata and each rank's tensor hashes as JSON. The
coordinator (the node of rank 0), once parts cover every rank, moves them into
``step_<N>.tmp-<pid>/part-r<first rank>/``, writes the global ``.metadata`` from the parts'
JSON (:func:`merge_parts`: rank 0's state at the top level, per-rank entries pointing at bytes
the parts already hold: nothing copied, nothing unpickled) and the global manifest, fsyncs and
renames the directory to ``step_<N>``. A crash before that leaves a ``.tmp-`` directory that
is never listed. See docs/design.md, "Multi-node: parts and one coordinator".
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftmem._logging import get_logger
from ftmem.errors import CorruptSnapshotError, FtmemError
from ftmem.tiers.checkpoints import (
    MANIFEST,
    Checkpoint,
    checkpoint_name,
    fsync_dir,
    list_checkpoints,
    manifest_entry,
    read_checkpoint,
    read_manifest,
    temp_name,
    write_manifest,
)
from ftmem.tiers.dcp_meta import metadata_from_json, rebase, write_metadata
from ftmem.tiers.export import PER_RANK_KEY

log = get_logger(__name__)


def part_prefix(first_rank: int) -> str:
    """The name of the part whose lowest rank is ``first_rank`` (its sub-directory)."""
    return f"part-r{first_rank:06d}"


class AssembleError(FtmemError):
    """The parts of a step cannot be assembled (missing past the deadline, inconsistent)."""


@dataclass(frozen=True, slots=True)
class Part:
    """A node's part of a step, read from its manifest."""

    ckpt: Checkpoint
    dcp: dict[str, Any]
    """The part's DCP metadata as JSON (:func:`ftmem.tiers.dcp_meta.metadata_to_json`)."""
    hashes: dict[int, dict[str, str]]
    """Each rank's tensor name -> xxh3, as the rank saved them."""
    chunked: frozenset[str] = frozenset()
    """Tensors the part holds chunks of (DTensor shards, replicas' rows): merged over parts."""

    @classmethod
    def parse(cls, ckpt: Checkpoint, dcp: Any, hashes: Any, chunked: Any) -> Part:
        """A part from the JSON fields :meth:`ftmem.tiers.export.StepState.part_fields` made.

        Raises:
            TypeError, ValueError, AttributeError: a field is malformed.
        """
        by_rank = {
            int(r): {str(k): str(v) for k, v in dict(h).items()} for r, h in dict(hashes).items()
        }
        return cls(ckpt, dict(dcp), by_rank, frozenset(str(n) for n in chunked or ()))

    @property
    def prefix(self) -> str:
        """The part's sub-directory in the assembled checkpoint."""
        return part_prefix(self.ckpt.ranks[0])


def read_part(ckpt: Checkpoint) -> Part:
    """The metadata of part ``ckpt`` (sizes already checked by listing it).

    Raises:
        CorruptSnapshotError: its manifest lacks the part fields or they are malformed.
    """
    m = read_manifest(ckpt.path)
    try:
        part = Part.parse(ckpt, m.dcp, m.hashes, m.chunked)
    except (TypeError, ValueError, AttributeError) as exc:
        raise CorruptSnapshotError(f"{ckpt.path}: not a part ({exc!r})") from exc
    if sorted(part.hashes) != list(ckpt.ranks):
        raise CorruptSnapshotError(f"{ckpt.path}: hashes for ranks {sorted(part.hashes)}")
    return part


def find_parts(tier: Path, step: int, world_size: int) -> list[Part]:
    """The readable parts of ``step`` in ``tier`` (bad ones are logged and left out)."""
    out = []
    for ck in list_checkpoints(tier, parts=True)[0]:
        if ck.step != step or not ck.is_part or ck.world_size != world_size:
            continue
        try:
            out.append(read_part(ck))
        except CorruptSnapshotError as exc:
            log.warning("ignoring part %s: %s", ck.path, exc)
    return out


def _cover(parts: list[Part], world_size: int) -> list[Part] | None:
    """Parts holding every rank once (None if there are not such parts yet)."""
    chosen: dict[int, Part] = {}
    for p in parts:
        if any(r in chosen for r in p.ckpt.ranks):
            raise AssembleError(f"parts overlap: {p.ckpt.path} and another hold the same rank")
        chosen.update(dict.fromkeys(p.ckpt.ranks, p))
    if sorted(chosen) != list(range(world_size)):
        return None
    return list({id(p): p for p in chosen.values()}.values())


def merge_parts(parts: list[Part]) -> dict[str, Any]:
    """The global checkpoint's metadata (JSON form) from the parts of every rank."""
    by_rank = {r: p for p in parts for r in p.ckpt.ranks}
    first = by_rank[0]
    h0 = first.hashes[0]
    out: dict[str, Any] = {"version": first.dcp.get("version"), "tensors": {}, "bytes": []}
    out["planner"] = {}
    out["storage"] = []
    for p in sorted(parts, key=lambda p: p.ckpt.ranks[0]):
        doc = rebase(p.dcp, p.prefix)
        storage: dict[str, list[Any]] = {}
        for entry in doc["storage"]:
            storage.setdefault(entry[0], []).append(entry)
        mine = tuple(f"{PER_RANK_KEY}.{r}." for r in p.ckpt.ranks)
        for fqn in [*doc["tensors"], *doc["bytes"]]:
            if fqn in p.chunked:
                _merge_chunks(out, doc, storage, fqn)
            elif p is first or fqn.startswith(mine):
                _take(out, doc, storage, fqn, fqn)
        if p is first:
            continue  # its per-rank entries are already relative to rank 0
        for rank in p.ckpt.ranks:
            for name, h in p.hashes[rank].items():
                own = f"{PER_RANK_KEY}.{rank}.tensors.{name}"
                if h0.get(name) == h or own in doc["tensors"] or name in p.chunked:
                    continue
                if name not in doc["tensors"]:
                    raise AssembleError(f"{p.ckpt.path}: rank {rank}'s {name} is not in its part")
                # Equal to the part's top level (its lowest rank's value): point there.
                _take(out, doc, storage, name, own, [PER_RANK_KEY, str(rank), "tensors", name])
    return out


def _merge_chunks(
    out: dict[str, Any], doc: dict[str, Any], storage: dict[str, list[Any]], fqn: str
) -> None:
    """Add a part's chunks of tensor ``fqn`` to the global entry (the same chunk once)."""
    mine = doc["tensors"][fqn]
    have = out["tensors"].get(fqn)
    if have is None:
        out["tensors"][fqn] = {**mine, "chunks": []}
        out["planner"][fqn] = doc["planner"].get(fqn, [fqn])
        have = out["tensors"][fqn]
    elif have["size"] != mine["size"] or have["dtype"] != mine["dtype"]:
        raise AssembleError(f"{fqn}: parts disagree on its size or dtype")
    known = {tuple(c[0]) for c in have["chunks"]}
    for chunk in mine["chunks"]:
        if tuple(chunk[0]) in known:
            continue
        known.add(tuple(chunk[0]))
        have["chunks"].append(chunk)
        for e in storage.get(fqn, []):
            if e[1] is not None and tuple(e[1]) == tuple(chunk[0]):
                out["storage"].append([fqn, e[1], len(have["chunks"]) - 1, *e[3:]])


def _take(
    out: dict[str, Any],
    doc: dict[str, Any],
    storage: dict[str, list[Any]],
    fqn: str,
    as_fqn: str,
    path: list[str] | None = None,
) -> None:
    """Copy entry ``fqn`` of a part's metadata into ``out`` as ``as_fqn``."""
    if fqn in doc["tensors"]:
        out["tensors"][as_fqn] = doc["tensors"][fqn]
    else:
        out["bytes"].append(as_fqn)
    out["planner"][as_fqn] = path or doc["planner"].get(fqn, [as_fqn])
    out["storage"] += [[as_fqn, *e[1:]] for e in storage.get(fqn, [])]


def assemble(
    tier: Path,
    step: int,
    world_size: int,
    timeout_s: float,
    stop: threading.Event | None = None,
    on_wait: Callable[[int, int], None] | None = None,
) -> Checkpoint:
    """Wait (at most ``timeout_s``) for parts of ``step`` covering every rank in ``tier`` and
    assemble them into ``tier/step_<N>``; return the checkpoint.

    ``on_wait(ranks_present, world_size)`` is called while waiting.

    Raises:
        AssembleError: parts missing at the deadline (or ``stop`` set), or inconsistent.
        OSError: writing failed (e.g. the disk is full); the parts are put back.
    """
    final = tier / checkpoint_name(step)
    if final.exists():
        return read_checkpoint(final)
    deadline = time.monotonic() + timeout_s
    while True:
        parts = find_parts(tier, step, world_size)
        cover = _cover(parts, world_size)
        if cover is not None:
            break
        have = sum(len(p.ckpt.ranks) for p in parts)
        if on_wait is not None:
            on_wait(have, world_size)
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            missing = sorted(set(range(world_size)) - {r for p in parts for r in p.ckpt.ranks})
            raise AssembleError(
                f"step {step}: no part of ranks {missing[:8]}{'...' if len(missing) > 8 else ''}"
                f" reached {tier} in {timeout_s:.0f} s (is it shared by every node?)"
            )
        # A shared file system gives no event to wait on: poll, bounded by the deadline.
        if stop is not None:
            stop.wait(0.2)
        else:
            time.sleep(0.2)
    merged = merge_parts(cover)
    md = metadata_from_json(merged)
    tmp = tier / temp_name(final.name)
    shutil.rmtree(tmp, ignore_errors=True)
    moved: list[tuple[Path, Path]] = []
    try:
        tmp.mkdir(mode=0o700)
        for p in cover:
            dest = tmp / p.prefix
            os.rename(p.ckpt.path, dest)
            moved.append((dest, p.ckpt.path))
        write_metadata(tmp, md)
        known: dict[str, dict[str, Any]] = {}
        for p in cover:
            for name, (size, digest) in p.ckpt.files.items():
                known[f"{p.prefix}/{name}"] = {"bytes": size, "xxh3": digest}
            known[f"{p.prefix}/{MANIFEST}"] = manifest_entry(tmp / p.prefix / MANIFEST)
        chunked = sorted(set().union(*(p.chunked for p in cover)))
        write_manifest(
            tmp, step, world_size, known=known, extra={"dcp": merged, "chunked": chunked}
        )
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(tier)
    except BaseException:
        for dest, orig in moved:  # give the parts back: a later attempt may succeed
            try:
                os.rename(dest, orig)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ck = read_checkpoint(final)
    log.info(
        "assembled step %d of %d ranks from %d parts in %s (%.1f MiB)",
        step,
        world_size,
        len(cover),
        final,
        ck.nbytes / 2**20,
    )
    return ck
