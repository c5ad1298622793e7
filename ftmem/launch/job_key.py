"""How the agents of a job get its CURVE key pair, the peer mesh's secret.

From ``--ftmem-key-file`` (``ftmem keygen`` writes one); else, for a mesh on this host, through
a private file of this host that group rank 0 makes and every agent holds share-locked while
it runs (the round's store names the file's job id, never the key); else
(``--ftmem-insecure-mesh``) through the rendezvous store, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ftmem.errors import FtmemError, UnsafePathError

log = logging.getLogger(__name__)

_KEY_KEY = "ftmem/curve"
HOST_KEY_WAIT_S = 60.0
"""How long an agent waits for the host's key file the first agent makes."""
_HOST_JOB_KEY = "ftmem/host-key"
"""The round's store key where group rank 0 names the host key file's job id (public)."""
_held: dict[Path, int] = {}
"""The host key file each path names, as this process holds it: open, share-locked."""
_held_lock = threading.Lock()


def host_key_path(run_id: str) -> Path:
    """The file through which the agents of run ``run_id`` on this host share the job's key
    when no key file was given: in this user's private shared-memory directory (mode 0700,
    ``ftmem.config.default_shm_dir``). Torch's TCPStore listens on every interface whatever
    address it is given, so a key handed out through the store could be read from any host."""
    from ftmem.config import default_shm_dir
    from ftmem.launch.config import safe_name

    return default_shm_dir() / f"{safe_name(run_id)}.mesh-key"


def _same_file(fd: int, path: Path) -> bool:
    st = os.fstat(fd)
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _hold(fd: int, path: Path) -> None:
    """Keep ``fd`` (share-locked) as this process's hold on ``path``, instead of an older one."""
    old = _held.get(path)
    _held[path] = fd
    if old is not None and old != fd:
        os.close(old)


def _job_of(fd: int) -> tuple[str, bytes]:
    """The job id and the bytes of the open host key file ``fd`` ("" for a file of none)."""
    data = os.pread(fd, 4097, 0)
    try:
        doc = json.loads(data)
        job = doc.get("job") if isinstance(doc, dict) else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        job = None
    return (job if isinstance(job, str) else ""), data


def _make_host_keys(path: Path) -> str:
    """(Group rank 0) the job id of the host key file to use this round: the file this
    process holds; else one some live agent holds (share-locked: an agent of this job);
    else a new pair with a new job id, written to a unique temporary file of the same
    private directory and renamed over ``path`` (a stale file of a killed job is replaced,
    never reused). This process then holds it."""
    import fcntl
    import secrets
    import tempfile

    from ftmem.exchange import keys
    from ftmem.secure_fs import open_owned

    mine = _held.get(path)
    if mine is not None and _same_file(mine, path):
        return _job_of(mine)[0]
    try:
        fd = open_owned(path, "the job's host key file", private=True)
    except UnsafePathError as exc:
        if not isinstance(exc.__cause__, FileNotFoundError):
            raise FtmemError(str(exc)) from exc
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # live agents of this job hold it
            job = _job_of(fd)[0]
            os.close(fd)
            if job:
                return job
        else:
            os.close(fd)
            log.info("replacing the host key file %s of an earlier job (no agent holds it)", path)
    job = secrets.token_hex(16)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        doc = json.loads(keys.generate().to_json())
        os.write(fd, json.dumps({**doc, "job": job}).encode())
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    _hold(fd, path)
    return job


def _read_host_keys(path: Path, job: str) -> str | None:
    """The pair (JSON) of ``path`` if it is this user's private file of job ``job``, now
    held (share-locked) by this process; None if it is missing, of another job, or being
    replaced or removed.

    Raises:
        FtmemError: the file is not this user's private file, or is malformed.
    """
    import fcntl

    from ftmem.exchange import keys
    from ftmem.secure_fs import open_owned

    try:
        fd = open_owned(path, "the job's host key file", private=True)
    except UnsafePathError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            return None
        raise FtmemError(str(exc)) from exc
    try:
        found, data = _job_of(fd)
        pair = keys.CurveKeyPair.from_json(data) if found == job and len(data) <= 4096 else None
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # BlockingIOError: being replaced
        if pair is None or not _same_file(fd, path):
            os.close(fd)
            return None
    except keys.KeyFileError as exc:
        os.close(fd)
        raise FtmemError(f"the job's host key file {path}: {exc}") from exc
    except BlockingIOError:
        os.close(fd)
        return None
    _hold(fd, path)
    return pair.to_json()


def _host_keys(path: Path, store: Any, group_rank: int) -> str:
    """The job's key pair (JSON) through the host key file ``path``: group rank 0 picks the
    file (:func:`_make_host_keys`) and names its job id in the round's store (an id, not the
    key); the others read it from the file of that id. Every agent holds the file it read
    (a shared lock) until it exits, so a file nobody holds is known to be stale.

    Raises:
        FtmemError: the file is not this user's private file, is malformed, or the file of
            the round's job id does not appear within ``HOST_KEY_WAIT_S``.
    """
    from ftmem.secure_fs import prepare_private_dir

    prepare_private_dir(path.parent, "shared-memory directory")
    if group_rank == 0:
        with _held_lock:
            job = _make_host_keys(path)
        store.set(_HOST_JOB_KEY, job)
    else:
        job = bytes(store.get(_HOST_JOB_KEY)).decode("ascii", "replace")
    deadline = time.monotonic() + HOST_KEY_WAIT_S
    while True:
        with _held_lock:
            pair = _read_host_keys(path, job)
        if pair is not None:
            return pair
        if time.monotonic() > deadline:
            raise FtmemError(
                f"the job's host key file {path} of job id {job[:40]!r} did not appear in "
                f"{HOST_KEY_WAIT_S} s"
            )
        time.sleep(0.05)


def release_host_key(path: Path, job_over: bool) -> None:
    """Let go of this process's hold on the host key file ``path`` (an agent's exit), and
    remove the file when the job is over or when no other agent holds it (this was the
    last agent of the job on this host). A killed agent's hold goes with it; the file it
    leaves is replaced by the next job's group rank 0."""
    import fcntl

    with _held_lock:
        fd = _held.pop(path, None)
        if fd is None:
            last = False
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = _same_file(fd, path)
            except BlockingIOError:
                last = False
        if job_over or last:
            path.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)


def job_keys(
    key_file: Path | None, host_key: Path | None, store: Any, group_rank: int, warn: bool = True
) -> str:
    """The job's CURVE key pair as JSON: from the key file; else, for a mesh on this host,
    from the host's private key file; else (``--ftmem-insecure-mesh``) through the store,
    with a warning when ``warn`` (``PeerMesh`` warns once per agent)."""
    from ftmem.exchange import keys

    if key_file is not None:
        return keys.read_key_file(key_file).to_json()
    if host_key is not None:
        return _host_keys(host_key, store, group_rank)
    if warn:
        log.warning(
            "no --ftmem-key-file: the peer mesh's CURVE key pair is handed out through the "
            "rendezvous store, so anyone who can read that store can join the mesh; make a "
            "key file with `ftmem keygen` and pass --ftmem-key-file"
        )
    if group_rank == 0:
        store.set(_KEY_KEY, keys.generate().to_json())
    return bytes(store.get(_KEY_KEY)).decode()
