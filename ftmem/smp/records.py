"""Commit records: a small sidecar file per committed slot, so a restarted SMP can adopt it.

Slot files survive the SMP's death (only a clean shutdown removes them). At a commit the SMP
writes ``<slot file>.commit`` (tmp + rename: complete or absent) with the layout and identity
of what the slot holds, rewritten with the checksums once verified, and removed before the
slot is written again or dropped: a record present names committed data. A restarted SMP
hashes an adopted slot whose layout has no checksums yet; loads verify every checksum anyway.
The format is :mod:`ftmem.format.record`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.format.record import MAX_RECORD_BYTES, CommitRecord, decode_record, encode_record
from ftmem.secure_fs import replace_private_file

log = get_logger(__name__)

SUFFIX = ".commit"


def record_path(slot_path: Path | str) -> Path:
    """The record file of a slot file."""
    return Path(f"{slot_path}{SUFFIX}")


def write_record(slot_path: Path | str, rec: CommitRecord) -> None:
    """Write the record of ``slot_path`` atomically, through ``<record>.tmp``
    (:func:`ftmem.secure_fs.replace_private_file`). Paths stay strings: this runs twice per
    save."""
    final = f"{slot_path}{SUFFIX}"
    replace_private_file(final, encode_record(rec).encode(), f"{final}.tmp")


def remove_record(slot_path: Path | str) -> None:
    """Remove the record of a slot (before its data is overwritten or dropped)."""
    if slot_path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{slot_path}{SUFFIX}")


def read_record(path: Path) -> CommitRecord:
    """Read and check one record file. Raises ValueError if it is malformed or corrupt."""
    if path.stat().st_size > MAX_RECORD_BYTES:
        raise ValueError("record too large")
    try:
        text = path.read_text(errors="strict")
    except UnicodeDecodeError as exc:
        raise ValueError(f"malformed record: {exc!r}") from exc
    return decode_record(text)


def run_files(shm_dir: Path, run_id: str, node: str) -> list[tuple[Path, shm.SlotName]]:
    """Every entry of ``shm_dir`` named as a slot file, commit record or record's temporary
    file of exactly ``run_id`` and ``node`` (any nonce), sorted by name, with its parsed name.
    Names are parsed, not prefix-matched (run ``a-b`` node ``c`` is not run ``a`` node
    ``b-c``); the files themselves are not checked (see :func:`owned`)."""
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        parsed = shm.parse_slot_name(name)
        if parsed is not None and (parsed.run_id, parsed.node) == (run_id, node):
            out.append((shm_dir / name, parsed))
    return out


@dataclass(frozen=True, slots=True)
class Adoptable:
    """A slot file with a valid record that a restarted SMP can serve again."""

    path: Path
    record: CommitRecord


def owned(path: Path) -> bool:
    """The file (not a symlink) belongs to this user and no one else can write it."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def scan(shm_dir: Path, run_id: str, node: str, nslots: int) -> tuple[list[Adoptable], list[Path]]:
    """Split the files of ``run_id`` and ``node`` in ``shm_dir`` (:func:`run_files`, any
    nonce) into adoptable slots and leftovers to remove.

    A slot file is adoptable when it and its record are this user's and not writable by
    others, the record is valid and agrees with the name, and the file's size equals the
    recorded capacity; for each (rank, slot) the newest generation (then sequence number)
    wins. Files of another user are neither adopted nor listed as leftovers.
    """
    best: dict[tuple[int, int], Adoptable] = {}
    leftovers: list[Path] = []
    for p, name in run_files(shm_dir, run_id, node):
        if not owned(p):
            log.warning("not touching %s: another user's, or writable by others", p)
            continue
        if name.suffix:  # a record (or its temporary file): kept only beside its slot file
            if name.suffix != SUFFIX or not os.path.lexists(str(p)[: -len(SUFFIX)]):
                leftovers.append(p)
            continue
        if not os.path.lexists(record_path(p)):
            leftovers.append(p)  # never committed (or its record was being replaced)
            continue
        if not owned(record_path(p)):
            log.warning("not adopting %s: its record is another user's", p)
            continue
        try:
            rec = read_record(record_path(p))
            ok = (rec.rank, rec.slot, rec.gen) == (name.rank, name.slot, name.gen)
            ok = ok and p.stat().st_size == rec.capacity
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("not adopting %s: %s", p.name, exc)
            ok = False
        if not ok or name.slot >= nslots:
            leftovers.append(p)
            continue
        prev = best.get((name.rank, name.slot))
        if prev is None or (prev.record.gen, prev.record.seq) < (rec.gen, rec.seq):
            if prev is not None:
                leftovers.append(prev.path)
            best[(name.rank, name.slot)] = Adoptable(p, rec)
        else:
            leftovers.append(p)
    return sorted(best.values(), key=lambda a: (a.record.rank, a.record.slot)), leftovers
