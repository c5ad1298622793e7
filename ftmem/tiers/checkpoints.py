"""Checkpoints on disk: names, the manifest that makes one complete, listing, checking, pruning.

A tier is a directory of DCP directories ``step_<N>`` (zero-padded: names sort by step), and
in a multi-node run of nodes' parts ``step_<N>.part-r<first rank>`` (:mod:`ftmem.tiers.assemble`).
A checkpoint is *complete* once it is under its final name (renamed there after every file was
fsynced) with ``ftmem-manifest.json``: step, world size, ranks held, every file's size and
xxh3-64. Anything else in a tier is never listed as a checkpoint.

Trust: a tier must be this user's directory that others cannot write, and so must each
checkpoint in it (``lstat``: symlinks are refused); the manifest must carry a valid signature
made with the tier key (:mod:`ftmem.tiers.signing`). Both are checked before any other file of
a checkpoint is opened, so a planted checkpoint is never read, in particular never by DCP's
metadata reader (a pickle). :func:`prune` removes only what is provably this job's.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import xxhash

from ftmem import typed_json
from ftmem._logging import get_logger
from ftmem.errors import CorruptSnapshotError, ProtocolError, UnsafePathError
from ftmem.secure_fs import check_dir, open_owned
from ftmem.tiers import signing
from ftmem.typed_json import MAX_INT, Most, Range

log = get_logger(__name__)

MANIFEST = "ftmem-manifest.json"
_NAME_RE = re.compile(r"^step_(\d{10})$")
_PART_RE = re.compile(r"^step_(\d{10})\.part-r(\d{6})$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_CHUNK = 8 << 20
_MAX_MANIFEST = 64 << 20
_MAX_WORLD = 1 << 20


def checkpoint_name(step: int) -> str:
    """The directory name of step ``step``'s checkpoint."""
    return f"step_{step:010d}"


def part_name(step: int, first_rank: int) -> str:
    """The directory name of the part of step ``step`` whose lowest rank is ``first_rank``."""
    return f"{checkpoint_name(step)}.part-r{first_rank:06d}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def temp_name(name: str) -> str:
    """The name a writer on this host gives ``name`` while it is being written: it carries
    the host and the pid, so only a process of this host that knows the pid is gone removes
    it (:func:`prune`)."""
    return f"{name}.tmp-{_host()}-{os.getpid()}"


def file_hash(path: Path) -> str:
    """xxh3-64 (hex) of a file's bytes."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its size and xxh3-64."""
    return {"bytes": path.stat().st_size, "xxh3": file_hash(path)}


def write_manifest(
    directory: Path,
    step: int,
    world_size: int,
    ranks: Sequence[int] | None = None,
    known: dict[str, dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """List every file of ``directory`` with its size and hash in its manifest, fsynced; a
    file in ``known`` (its entry computed as it was written, or one of a sub-directory's files)
    is listed as given, not read again. ``ranks``: the ranks it
    holds (default all of ``world_size``); ``extra``: more fields (a part's metadata)."""
    files = dict(known or {})
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST and p.name not in files:
            files[p.name] = manifest_entry(p)
    doc = {
        "version": 1,
        "step": step,
        "world_size": world_size,
        "ranks": sorted(ranks) if ranks is not None else list(range(world_size)),
        "files": files,
        **(extra or {}),
    }
    path = directory / MANIFEST
    signed = signing.sign(doc, signing.tier_key(create=True))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(signed, f)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True, slots=True)
class FileEntry:
    """A file a manifest lists: its size and its xxh3-64 (hex)."""

    bytes: Annotated[int, Range(0, MAX_INT)]
    xxh3: Annotated[str, Most(64)]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint's manifest, read (by the one JSON reader) once its signature checked."""

    step: Annotated[int, Range(0, 2**62 - 1)]
    world_size: Annotated[int, Range(1, _MAX_WORLD)]
    files: Annotated[dict[str, FileEntry], Most(1 << 20)]
    ranks: Annotated[list[Annotated[int, Range(0, _MAX_WORLD - 1)]], Most(_MAX_WORLD)] | None = None
    """The ranks it holds (None: all of ``world_size``)."""
    dcp: Any = None
    """Its DCP metadata as JSON (None: written by an older ftmem)."""
    chunked: Annotated[list[Annotated[str, Most(4096)]], Most(1 << 22)] | None = None
    """The tensors saved in row chunks (None: not recorded; derive them from ``dcp``)."""
    hashes: Any = None
    """A node's part: its ranks' tensor hashes (checked by the assembler)."""


def read_manifest(path: Path) -> Manifest:
    """The manifest of checkpoint directory ``path`` (size-bounded), after checking that the
    file is ours, not writable by others, and signed with the tier key.

    Raises:
        CorruptSnapshotError: it is missing, too large, not a JSON object, its signature does
            not check, or its fields are not a manifest's.
        UnsafePathError: it is not ours, a symlink, or writable by others; or there is no
            tier key to check it with.
        OSError: it could not be read (EIO, ESTALE...): nothing can be said about it.
    """
    mpath = path / MANIFEST
    try:
        fd = open_owned(mpath, "checkpoint manifest", private=False)
    except UnsafePathError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            raise CorruptSnapshotError(f"{path}: no manifest") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_MANIFEST + 1)
    if len(raw) > _MAX_MANIFEST:
        raise CorruptSnapshotError(f"{mpath} is too large")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
        raise CorruptSnapshotError(f"{path}: no valid manifest ({exc})") from exc
    if not isinstance(doc, dict):
        raise CorruptSnapshotError(f"{path}: the manifest is not a JSON object")
    signing.verify(doc, path)
    try:
        manifest: Manifest = typed_json.build(Manifest, doc, what="manifest", strict=False)
    except ProtocolError as exc:
        raise CorruptSnapshotError(f"{path}: no valid manifest ({exc})") from exc
    return manifest


def _good_file_name(name: str) -> bool:
    """A manifest may name files of the directory and of one level of sub-directories."""
    parts = name.split("/")
    return len(parts) <= 2 and all(p == ".metadata" or _FILE_RE.match(p) for p in parts)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint found in a tier (its files not yet verified)."""

    path: Path
    step: int
    world_size: int
    nbytes: int
    files: dict[str, tuple[int, str]]
    ranks: tuple[int, ...] = ()
    """The ranks it holds: all of ``world_size`` for a checkpoint, a node's ranks for a part."""
    dcp_json: Any = field(default=None, compare=False, repr=False)
    """Its DCP metadata as JSON, from the signed manifest (None: written by an older ftmem)."""

    @property
    def is_part(self) -> bool:
        """It holds some ranks only (a node's part of a multi-node checkpoint)."""
        return self.ranks != tuple(range(self.world_size))


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint's manifest (checked: see :func:`read_manifest`) and check that every
    listed file is a regular file (no symlink) of its size.

    Raises:
        CorruptSnapshotError: no, an unsigned or a malformed manifest, or a file missing or
            truncated.
        UnsafePathError: the directory or its manifest is not ours or writable by others.
        OSError: the manifest could not be read.
    """
    check_dir(path, "checkpoint")
    m = read_manifest(path)
    files = {name: (e.bytes, e.xxh3) for name, e in m.files.items()}
    world = m.world_size
    ranks = tuple(sorted(set(range(world) if m.ranks is None else m.ranks)))
    if not ranks or ranks[0] < 0 or ranks[-1] >= world:
        raise CorruptSnapshotError(f"{path}: the manifest names ranks outside 0..{world - 1}")
    for name, (size, _) in files.items():
        if not _good_file_name(name):
            raise CorruptSnapshotError(f"{path}: manifest names a bad file {name!r}")
        try:
            st = os.lstat(path / name)
        except OSError as exc:
            raise CorruptSnapshotError(f"{path}: {name} is missing") from exc
        if not stat.S_ISREG(st.st_mode):
            raise CorruptSnapshotError(f"{path}: {name} is not a regular file")
        if st.st_size != size:
            raise CorruptSnapshotError(f"{path}: {name} has {st.st_size} bytes, expected {size}")
    total = sum(s for s, _ in files.values())
    return Checkpoint(path, m.step, world, total, files, ranks, m.dcp)


def verify_checkpoint(ckpt: Checkpoint) -> None:
    """Check every file's hash against the manifest (reads all of it).

    Raises:
        CorruptSnapshotError: naming the first file that does not match.
    """
    for name, (_, want) in sorted(ckpt.files.items()):
        got = file_hash(ckpt.path / name)
        if got != want:
            raise CorruptSnapshotError(f"{ckpt.path}: {name} fails its checksum")


def check_tier(tier: Path, parents: bool = False) -> None:
    """``tier`` is a directory a disk tier may use: this user's, not writable by others; or a
    shared one with the sticky bit (a cluster's scratch directory, mode 1777), root's or
    ours, where nobody else can rename or remove our entries and every entry is checked on
    its own (others' are ignored). With ``parents``, nobody else can move it away either
    (:func:`check_tier_parents`).

    Raises:
        UnsafePathError: a symbolic link, not a directory, another user's directory, or one
            others can write without the sticky bit (the message says how to fix it).
    """
    try:
        st = os.lstat(tier)
    except OSError as exc:
        raise UnsafePathError(f"disk tier {tier}: {exc}") from exc
    if parents:
        check_tier_parents(tier)
    shared = stat.S_ISVTX & st.st_mode and st.st_mode & 0o022
    if stat.S_ISDIR(st.st_mode) and shared and st.st_uid in (0, os.geteuid()):
        return
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022 and st.st_uid == os.geteuid():
        raise UnsafePathError(
            f"disk tier {tier} is writable by others without the sticky bit (mode "
            f"{st.st_mode & 0o7777:o}): anyone could replace what ftmem writes there. "
            f"`chmod go-w {tier}`, or `chmod +t {tier}` for a directory other users share"
        )
    check_dir(tier, "disk tier")


def check_tier_parents(tier: Path) -> None:
    """Nobody but this user or root can rename ``tier`` or a directory above it (as written
    and as resolved): each directory holding one is ours or root's, and if others can write
    it, it has the sticky bit and the entry is ours or root's (``/tmp/<ours>``). An entry not
    made yet counts as ours (it is checked again once made).

    Raises:
        UnsafePathError: naming the directory, its owner and mode.
    """
    uid = os.geteuid()
    for path in (Path(os.path.abspath(tier)), Path(os.path.realpath(tier))):
        for entry in (path, *path.parents[:-1]):
            holder = Path(os.path.realpath(entry.parent))
            try:
                d = os.stat(holder)
                owner = os.lstat(entry).st_uid if os.path.lexists(entry) else uid  # to make
            except FileNotFoundError:
                continue
            mode = d.st_mode
            if d.st_uid in (0, uid) and (
                not mode & 0o022 or (mode & stat.S_ISVTX and owner in (0, uid))
            ):
                continue
            raise UnsafePathError(
                f"disk tier {tier}: another user could move {entry} away ({holder}: uid "
                f"{d.st_uid}, mode {stat.S_IMODE(mode):o}; {entry.name}: uid {owner}). Use a "
                "directory only you (or root) can write, e.g. one made by `mktemp -d`"
            )


def prepare_local_tier(tier: Path) -> None:
    """Make the first (node-local) tier ``tier`` and missing parents once its parents are
    checked, then check it and them again (:func:`check_tier`). Raises UnsafePathError."""
    check_tier_parents(tier)
    tier.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_tier(tier, parents=True)


def list_checkpoints(
    tier: Path, parts: bool = False
) -> tuple[list[Checkpoint], list[tuple[Path, str]]]:
    """Complete checkpoints of ``tier`` (and with ``parts``, nodes' parts too), newest first,
    and what else is there (path, why).

    Raises:
        UnsafePathError: ``tier`` is not this user's directory, is a symlink, or others can
            write to it (nothing in it is trusted).
    """
    good: list[Checkpoint] = []
    other: list[tuple[Path, str]] = []
    if not os.path.lexists(tier):
        return good, other
    check_tier(tier)
    for p in sorted(tier.iterdir()):
        whole, part = _NAME_RE.match(p.name), _PART_RE.match(p.name)
        mt = whole or part
        if not mt:
            other.append((p, "partial (a writer was stopped)" if ".tmp-" in p.name else "not ours"))
            continue
        try:
            ck = read_checkpoint(p)
        except CorruptSnapshotError as exc:
            other.append((p, f"incomplete: {exc}"))
            continue
        except UnsafePathError as exc:
            other.append((p, f"untrusted: {exc}"))
            continue
        except OSError as exc:
            other.append((p, f"unreadable: {exc}"))
            continue
        if ck.step != int(mt.group(1)) or ck.is_part != (part is not None):
            other.append((p, f"manifest says step {ck.step}, ranks {_span(ck.ranks)}"))
            continue
        if part is not None and not parts:
            other.append((p, f"part of ranks {_span(ck.ranks)} (not assembled)"))
            continue
        good.append(ck)
    good.sort(key=lambda c: (c.step, not c.is_part), reverse=True)
    return good, other


def _span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]) if ranks else "none"


def prune(tier: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints and the parts of the newest ``keep``
    steps that have parts; remove older ones and the partial directories of writers of this
    host that are gone. Anything else (another host's partial copy, a checkpoint that could
    not be read or checked right now) is left alone and logged. Returns what was removed."""
    good, other = list_checkpoints(tier, parts=True)
    whole = [c for c in good if not c.is_part]
    part_steps = sorted({c.step for c in good if c.is_part}, reverse=True)[:keep]
    removed = [c.path for c in whole[keep:]]
    removed += [c.path for c in good if c.is_part and c.step not in part_steps]
    for p, why in other:
        if _dead_writer_of_this_host(p.name):
            removed.append(p)
        elif not why.startswith(("partial", "not ours")):
            log.warning("not pruning %s: %s", p, why)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    if removed:
        log.info("pruned %s", ", ".join(p.name for p in removed))
    return removed


def _dead_writer_of_this_host(name: str) -> bool:
    from ftmem._process import pid_alive

    base, sep, tail = name.rpartition(".tmp-")
    host, dash, pid = tail.rpartition("-")
    if not (sep and dash and base) or host != _host() or not pid.isdigit():
        return False
    return not pid_alive(int(pid))


def copy_checkpoint(ckpt: Checkpoint, tier: Path) -> Path:
    """Copy a complete checkpoint (or part) into another tier, under the same name (tmp dir,
    fsync, rename); return its path.

    The copy's files are checked against the manifest before the rename.

    Raises:
        OSError: the copy failed (e.g. the tier is full); nothing is left behind.
        CorruptSnapshotError: the source does not match its manifest.
    """
    tier.mkdir(parents=True, exist_ok=True)
    check_tier(tier)
    final = tier / ckpt.path.name
    tmp = tier / temp_name(ckpt.path.name)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700)  # the checkpoint holds the model: owner only
        for name in [*sorted(ckpt.files), MANIFEST]:
            (tmp / name).parent.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(ckpt.path / name, tmp / name)
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        verify_checkpoint(read_checkpoint(tmp))
        fsync_dir(tmp)
        old = tier / temp_name(f"{ckpt.path.name}.old")
        try:  # replace by rename, then delete: a complete copy is there at every moment
            os.rename(final, old)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        try:
            os.rename(tmp, final)
        except OSError:
            if os.path.lexists(old):
                os.rename(old, final)
            raise
        fsync_dir(tier)
        shutil.rmtree(old, ignore_errors=True)
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
