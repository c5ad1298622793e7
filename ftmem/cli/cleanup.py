"""``ftmem cleanup``: find (and with ``--remove``, delete) this user's orphaned slot files.

An SMP killed with SIGKILL (the OOM killer, a scheduler whose kill wait was shorter than the
final flush) cannot remove its slot files: they stay in /dev/shm, holding memory, until an SMP
of the same run and node adopts them (``ftmem-launch`` with the same ``--rdzv-id`` and
``--ftmem-node``) or this command removes them. A file is *orphaned* when it has an ftmem slot
file's name (or is a slot's commit record), belongs to this user, and no live SMP holds the
lock of its run and node (:mod:`ftmem.smp.node_lock`) and no process of this user has it mapped
or open (``/proc/<pid>/maps`` and ``fd``: a rank maps its slots for its whole life, so a live
job is recognised even if its lock lives elsewhere, e.g. under another ``XDG_RUNTIME_DIR``).
Files of other users are never listed.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ftmem.config import user_base_dir

_SLOT_RE = re.compile(r"^ftmem-.+-r\d+-s\d+-g\d+(\.commit(\.tmp)?)?$")


@dataclass(frozen=True, slots=True)
class Orphan:
    """One orphaned file and its size."""

    path: Path
    nbytes: int


def _held(lock: Path) -> bool:
    """Some live process holds this lock (an SMP serving its run and node)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def live_prefixes(base: Path | None = None) -> list[str]:
    """File-name prefixes of every run and node a live SMP of this user serves."""
    locks = (base or user_base_dir()) / "locks"
    out = []
    for lock in sorted(locks.glob("*@*.lock")) if locks.is_dir() else []:
        run, _, node = lock.name.removesuffix(".lock").partition("@")
        if _held(lock):
            out.append(f"ftmem-{run}-{node}-r")
    return out


def in_use(shm_dir: Path) -> set[str]:
    """Names of the files in ``shm_dir`` some process of this user maps or holds open."""
    names: set[str] = set()
    prefix = str(shm_dir).rstrip("/") + "/"
    for pid in (d for d in os.listdir("/proc") if d.isdigit()):
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                continue
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    if path.startswith(prefix):
                        names.add(path[len(prefix) :].removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    names.add(target[len(prefix) :])
        except OSError:
            continue  # the process exited meanwhile, or is not ours to read
    return names


def find_orphans(shm_dir: Path = Path("/dev/shm"), base: Path | None = None) -> list[Orphan]:
    """This user's slot files and records in ``shm_dir`` that no live SMP serves."""
    live = tuple(live_prefixes(base))
    used = in_use(shm_dir)
    found = []
    for p in sorted(shm_dir.glob("ftmem-*")):
        if not _SLOT_RE.match(p.name) or (live and p.name.startswith(live)):
            continue
        if p.name in used or p.name.removesuffix(".tmp").removesuffix(".commit") in used:
            continue
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if st.st_uid == os.geteuid():
            found.append(Orphan(p, st.st_size))
    return found


def run_cleanup(args: argparse.Namespace) -> int:
    """List the orphans (and remove them with ``--remove``); exit 0."""
    orphans = find_orphans(Path(args.shm_dir))
    total = sum(o.nbytes for o in orphans)
    verb = "removing" if args.remove else "would remove (dry run; --remove to delete)"
    for o in orphans:
        print(f"{verb}: {o.path} ({o.nbytes / 2**20:.1f} MiB)")
        if args.remove:
            try:
                os.unlink(o.path)
            except FileNotFoundError:
                pass
    print(f"{len(orphans)} orphaned file(s), {total / 2**30:.2f} GiB")
    return 0
