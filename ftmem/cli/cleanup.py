"""``ftmem cleanup``: find (and with ``--remove``, delete) this user's orphaned slot files.

An SMP killed with SIGKILL cannot remove its slot files: they stay in the user's private
shared-memory directory, holding memory, until an SMP of the same run and node adopts them
or this command removes them. A file is *orphaned* when it has a slot file's name (or is a
slot's commit record), belongs to this user, no live SMP holds the lock of its run and node
(:mod:`ftmem.smp.node_lock`) and no process of this user maps it or holds it open (a rank
maps its slots for its whole life, so a live job is recognised even if its lock lives
elsewhere, e.g. under another ``XDG_RUNTIME_DIR``). Names are parsed
(:func:`ftmem.shm.parse_slot_name`), so a live run ``a`` node ``b-c`` never protects (nor
hides) run ``a-b`` node ``c``'s files. A run's host key file (``<run id>.mesh-key``) is
orphaned when no live SMP of that run is left.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ftmem.config import default_shm_dir, user_base_dir
from ftmem.errors import UnsafePathError
from ftmem.secure_fs import check_dir
from ftmem.shm import parse_slot_name


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


def live_runs() -> set[tuple[str, str]]:
    """(run id, node) of every run and node a live SMP of this user serves (its lock held)."""
    locks = user_base_dir() / "locks"
    out = set()
    for lock in sorted(locks.glob("*@*.lock")) if locks.is_dir() else []:
        run, _, node = lock.name.removesuffix(".lock").partition("@")
        if _held(lock):
            out.add((run, node))
    return out


def in_use(shm_dir: Path) -> set[str]:
    """Names of the files in ``shm_dir`` some process of this user maps or holds open."""
    names: set[str] = set()
    prefix = os.path.realpath(shm_dir).rstrip("/") + "/"
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


_MESH_KEY = ".mesh-key"


def _run_and_node(name: str, live: set[tuple[str, str]]) -> tuple[str, bool] | None:
    """(run id, whether a live SMP keeps it) of a file ftmem makes, or None for other names."""
    if name.endswith(_MESH_KEY):
        run = name.removesuffix(_MESH_KEY)
        return run, any(r == run for r, _ in live)
    parsed = parse_slot_name(name)
    if parsed is None:
        return None
    return parsed.run_id, (parsed.run_id, parsed.node) in live


def find_orphans(shm_dir: Path | None = None, run_id: str | None = None) -> list[Orphan]:
    """This user's slot files, records and host key files in ``shm_dir`` (default
    :func:`ftmem.config.default_shm_dir`) that no live SMP serves and no process uses; only
    run ``run_id``'s when given.

    Raises:
        UnsafePathError: ``shm_dir`` is a symlink, another user's, or writable by others
            (nothing is listed: whoever could write there may have planted the names).
    """
    shm_dir = default_shm_dir() if shm_dir is None else shm_dir
    if not os.path.lexists(shm_dir):
        return []
    check_dir(shm_dir, "shared-memory directory")
    live = live_runs()
    used = in_use(shm_dir)
    found = []
    for name in sorted(os.listdir(shm_dir)):
        which = _run_and_node(name, live)
        if which is None or which[1] or (run_id is not None and which[0] != run_id):
            continue
        parsed = parse_slot_name(name)
        if name in used or (parsed is not None and name.removesuffix(parsed.suffix) in used):
            continue
        try:
            st = os.lstat(shm_dir / name)
        except FileNotFoundError:
            continue
        if st.st_uid == os.geteuid():
            found.append(Orphan(shm_dir / name, st.st_size))
    return found


def run_cleanup(args: argparse.Namespace) -> int:
    """List the orphans (and remove them with ``--remove``); exit 0, or 1 if the directory
    is unsafe. No ``--shm-dir``, or ``/dev/shm``, means this user's private directory."""
    arg = getattr(args, "shm_dir", None)
    shm_dir = default_shm_dir() if arg in (None, "/dev/shm") else Path(arg)
    try:
        orphans = find_orphans(shm_dir, run_id=getattr(args, "run_id", None))
    except UnsafePathError as exc:
        print(f"ftmem cleanup: {exc}", file=sys.stderr)
        return 1
    total = sum(o.nbytes for o in orphans)
    verb = "removing" if args.remove else "would remove (dry run; --remove to delete)"
    for o in orphans:
        print(f"{verb}: {o.path} ({o.nbytes / 2**20:.1f} MiB)")
        if args.remove:
            try:
                os.unlink(o.path)
            except FileNotFoundError:
                pass
    print(f"{len(orphans)} orphaned file(s) in {shm_dir}, {total / 2**30:.2f} GiB")
    return 0
