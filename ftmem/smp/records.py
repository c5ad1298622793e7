"""Commit records: a small sidecar file per committed slot, so a restarted SMP can adopt them.

The slot files live in /dev/shm and survive the SMP's death (only a clean shutdown removes
them). When a slot is committed, the SMP writes ``<slot file>.commit`` (tmp + rename, so it
is complete or absent) holding the layout and identity of what the slot holds (rewritten
with the checksums once the SMP has verified the slot); when the slot is handed out for
writing again, or dropped, the record is removed first. A record present therefore names
committed data; a restarted SMP hashes an adopted slot whose layout has no checksums yet, and
the data's checksums are still verified at every load. The record's format is
:mod:`ftmem.format.record`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ftmem._logging import get_logger
from ftmem.format.record import MAX_RECORD_BYTES, CommitRecord, decode_record, encode_record

log = get_logger(__name__)

SUFFIX = ".commit"
__all__ = ["CommitRecord", "read_record", "record_path", "remove_record", "scan", "write_record"]


def record_path(slot_path: Path | str) -> Path:
    """The record file of a slot file."""
    return Path(str(slot_path) + SUFFIX)


def write_record(slot_path: Path | str, rec: CommitRecord) -> None:
    """Write the record of ``slot_path`` atomically (tmp + rename). The temporary file is
    created new (``O_EXCL|O_NOFOLLOW``): a file or symlink planted under its name is removed
    first if it is ours, else the write fails, and nothing is written through a symlink."""
    text = encode_record(rec)
    final = record_path(slot_path)
    tmp = final.with_name(final.name + ".tmp")
    tmp.unlink(missing_ok=True)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, final)


def remove_record(slot_path: Path | str) -> None:
    """Remove the record of a slot (before its data is overwritten or dropped)."""
    if slot_path:
        record_path(slot_path).unlink(missing_ok=True)


def read_record(path: Path) -> CommitRecord:
    """Read and check one record file. Raises ValueError if it is malformed or corrupt."""
    if path.stat().st_size > MAX_RECORD_BYTES:
        raise ValueError("record too large")
    try:
        text = path.read_text(errors="strict")
    except UnicodeDecodeError as exc:
        raise ValueError(f"malformed record: {exc!r}") from exc
    return decode_record(text)


def file_pattern(prefix: str) -> re.Pattern[str]:
    """Names of exactly one run's and node's files (``prefix`` is ``ftmem-<run>-<node>-r``):
    slot files, their records and the records' temporary files. Another node whose name
    extends this one's (``gpu-r1`` next to ``gpu``) never matches."""
    return re.compile(re.escape(prefix) + r"\d+-s\d+-g\d+(\.commit(\.tmp)?)?$")


@dataclass(frozen=True, slots=True)
class Adoptable:
    """A slot file with a valid record that a restarted SMP can serve again."""

    path: Path
    record: CommitRecord


def _ours(path: Path) -> bool:
    """The file (not a symlink) belongs to this user and no one else can write it."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def scan(shm_dir: Path, prefix: str, nslots: int) -> tuple[list[Adoptable], list[Path]]:
    """Split the files starting with ``prefix`` into adoptable slots and leftovers to remove.

    A slot file is adoptable when its name parses, its record is valid and agrees with the
    name, and its size equals the recorded capacity; for each (rank, slot) the newest
    generation wins.
    """
    name_re = re.compile(re.escape(prefix) + r"(\d+)-s(\d+)-g(\d+)$")
    any_re = file_pattern(prefix)
    best: dict[tuple[int, int], Adoptable] = {}
    leftovers: list[Path] = []
    for p in sorted(shm_dir.glob(prefix + "*")):
        if not any_re.match(p.name):
            continue  # another node's (``gpu-r1`` when this is ``gpu``), or not ftmem's
        if not _ours(p):
            log.warning("not touching %s: another user's, or writable by others", p.name)
            continue
        if p.name.endswith(SUFFIX + ".tmp"):
            leftovers.append(p)
            continue
        if p.name.endswith(SUFFIX):
            if not Path(str(p)[: -len(SUFFIX)]).exists():
                leftovers.append(p)
            continue
        match = name_re.match(p.name)
        if match is None:
            leftovers.append(p)
            continue
        rank, slot, gen = (int(g) for g in match.groups())
        if not os.path.lexists(record_path(p)):
            leftovers.append(p)  # never committed (or its record was being replaced)
            continue
        if not _ours(record_path(p)):
            # /dev/shm is world-writable: never serve (nor try to delete) another user's file.
            log.warning("not adopting %s: its record is another user's", p.name)
            continue
        try:
            rec = read_record(record_path(p))
            ok = (rec.rank, rec.slot, rec.gen) == (
                rank,
                slot,
                gen,
            ) and p.stat().st_size == rec.capacity
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("not adopting %s: %s", p.name, exc)
            ok = False
        if not ok or slot >= nslots:
            leftovers.append(p)
            continue
        prev = best.get((rank, slot))
        if prev is None or prev.record.gen < gen:
            if prev is not None:
                leftovers.append(prev.path)
            best[(rank, slot)] = Adoptable(p, rec)
        else:
            leftovers.append(p)
    return sorted(best.values(), key=lambda a: (a.record.rank, a.record.slot)), leftovers
