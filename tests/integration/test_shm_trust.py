"""Shared memory is shared by every user and every SMP: slot files live in the user's private
directory (0700) under names no one can predict (a per-SMP nonce) nor confuse between runs and
nodes (``@`` separators); an SMP touches only the files of exactly its run and node that
belong to this user, never writes through a planted symlink, never shares a run and node with
another SMP, and refuses a private directory that is not private (real SMP processes, real
files in /dev/shm).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ftmem
from ftmem.config import ClientConfig, default_shm_dir
from ftmem.errors import SmpStartError, UnsafePathError
from ftmem.format.record import CommitRecord
from ftmem.protocol.smp_client import SmpClient
from ftmem.shm import MappedSegment, create_segment, parse_slot_name, remove_segment
from ftmem.smp import records
from ftmem.smp.allocation import SlotFiles
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import pid_gone, remove_shm, shm_files

SHM = Path("/dev/shm")
OTHER_UID = 65534  # nobody


def _start(
    run_dir: Path, run_id: str, node: str, log: Path, extra: list[str] | None = None
) -> SmpProcess:
    return start_smp(
        run_dir=run_dir,
        run_id=run_id,
        node=node,
        start_timeout=timedelta(seconds=60),
        log_path=log,
        extra_args=extra,
    )


def _committed(run_dir: Path) -> list[int]:
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:
        return c.status().ranks[0].committed_steps


def _save(run_dir: Path, value: float, step: int = 1) -> None:
    """A rank saves ``step`` (committed when this returns) and exits."""
    c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
    try:
        c.save({"t": torch.full((256,), value)}, step=step)
        assert c.wait(60), "the save was not committed"
    finally:
        c.close()


@pytest.fixture
def other_run_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def planted_dir(run_id: str) -> Iterator[Path]:
    """A path in /dev/shm for a test's own shared-memory directory, removed afterwards."""
    d = SHM / f"ftmem-test-{run_id}"
    yield d
    if d.is_symlink() or d.is_file():
        d.unlink()
    elif d.is_dir():
        shutil.rmtree(d)


def test_a_second_smp_of_the_same_run_and_node_is_refused(
    run_dir: Path, run_id: str, tmp_path: Path, other_run_dir: Path
) -> None:
    first = _start(run_dir, run_id, "n0", tmp_path / "first.log")
    try:
        with pytest.raises(SmpStartError):
            _start(other_run_dir, run_id, "n0", tmp_path / "second.log")
        log = (tmp_path / "second.log").read_text()
        assert f"another SMP (pid {first.pid}) serves run {run_id}, node n0" in log
        assert not pid_gone(first.pid), "the first SMP must keep serving"
    finally:
        first.stop()
    again = _start(run_dir, run_id, "n0", tmp_path / "again.log")  # the lock went with it
    again.stop()


@pytest.mark.parametrize("fault", ["other-user", "open", "symlink", "file"])
def test_an_unsafe_shared_memory_directory_is_refused(
    run_dir: Path, run_id: str, tmp_path: Path, planted_dir: Path, fault: str
) -> None:
    """Whoever gets to the private directory's path first can stop the SMP (deny service),
    never make it use their directory: the SMP exits naming the path, the owner or fault,
    and how to choose another directory."""
    target = tmp_path / "elsewhere"
    if fault == "other-user":
        if os.geteuid() != 0:
            pytest.skip("needs root to make a directory of another uid")
        planted_dir.mkdir(mode=0o700)
        os.chown(planted_dir, OTHER_UID, OTHER_UID)
        expect = f"belongs to uid {OTHER_UID}"
    elif fault == "open":  # this user's, but anyone may have planted files in it
        planted_dir.mkdir()
        os.chmod(planted_dir, 0o777)
        expect = "writable by others"
    elif fault == "symlink":  # would make the SMP create its slots wherever it points
        target.mkdir(mode=0o700)
        planted_dir.symlink_to(target)
        expect = "symbolic link"
    else:
        planted_dir.write_bytes(b"")
        expect = "not a directory"
    log = tmp_path / "smp.log"
    with pytest.raises(SmpStartError):
        _start(run_dir, run_id, "n0", log, ["--shm-dir", str(planted_dir)])
    text = log.read_text()
    assert str(planted_dir) in text and expect in text, text[-2000:]
    assert "FTMEM_SHM_DIR" in text and "--shm-dir" in text, text[-2000:]
    if fault == "symlink":
        assert os.listdir(target) == []  # nothing was made through the link
    if fault == "open":
        assert stat.S_IMODE(planted_dir.stat().st_mode) == 0o777  # not chmodded, refused


def test_ranks_map_slot_files_only_from_a_private_directory(tmp_path: Path) -> None:
    shm_dir = tmp_path / "shm"
    files = SlotFiles(shm_dir, "r", "n")
    files.prepare()
    assert stat.S_IMODE(shm_dir.stat().st_mode) == 0o700
    slot = files.path(0, 0, 1)
    create_segment(slot, 2 << 20)
    MappedSegment(slot, 2 << 20, shm_dir).close()
    os.chmod(shm_dir, 0o755)  # others could now list it; 0777 would let them plant files
    with pytest.raises(UnsafePathError, match="open to others"):
        MappedSegment(slot, 2 << 20, shm_dir)
    os.chmod(shm_dir, 0o700)
    with pytest.raises(ValueError, match="not a slot file"):  # a file the SMP did not name
        MappedSegment(slot, 2 << 20, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(shm_dir)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        MappedSegment(link / slot.name, 2 << 20, link)


def test_a_file_planted_at_the_next_slot_name_does_not_stop_allocation(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """Slot names used to be predictable files directly in the world-writable /dev/shm:
    another user could create the next one first and the SMP's ``O_EXCL`` create failed (the
    rank's saves were skipped). Now those names mean nothing and the real ones are private."""
    smp = _start(run_dir, run_id, "n0", tmp_path / "smp.log")
    planted = [SHM / f"ftmem-{run_id}-n0-r0-s{i}-g{g}" for i in range(2) for g in (1, 2, 3)]
    try:
        for p in planted:
            p.write_bytes(b"")
            if os.geteuid() == 0:
                os.chown(p, OTHER_UID, OTHER_UID)
        _save(run_dir, 1.0)
        assert _committed(run_dir) == [1]
        made = shm_files(run_id)
        assert made and all(Path(p).parent == default_shm_dir() for p in made)
        assert stat.S_IMODE(default_shm_dir().stat().st_mode) == 0o700
        assert all(p.exists() for p in planted)  # not ours to touch
        assert "cannot create" not in (tmp_path / "smp.log").read_text()  # no failed allocation
    finally:
        assert smp.stop() == 0
        for p in planted:
            p.unlink(missing_ok=True)
    assert shm_files(run_id) == []


def test_runs_and_nodes_whose_names_join_alike_never_touch_each_others_files(
    run_dir: Path, run_id: str, tmp_path: Path, other_run_dir: Path
) -> None:
    """Run ``X-b`` node ``c`` and run ``X`` node ``b-c`` used to get the same slot names: the
    second SMP adopted or deleted the first's files, and each one's stop removed the other's."""
    a_run, a_node, b_run, b_node = f"{run_id}-b", "c", run_id, "b-c"
    a = _start(run_dir, a_run, a_node, tmp_path / "a.log")
    b = _start(other_run_dir, b_run, b_node, tmp_path / "b.log")
    try:
        _save(run_dir, 1.0, step=3)
        _save(other_run_dir, 2.0, step=7)
        a_files, b_files = shm_files(a_run, a_node), shm_files(b_run, b_node)
        assert a_files and b_files and not set(a_files) & set(b_files)
        a.kill()  # its files stay; a new SMP of run X-b node c adopts them, and only them
        a = _start(run_dir, a_run, a_node, tmp_path / "a2.log")
        assert _committed(run_dir) == [3] and _committed(other_run_dir) == [7]
        assert a.stop() == 0
        assert shm_files(a_run, a_node) == [] and shm_files(b_run, b_node) == b_files
        assert _committed(other_run_dir) == [7]
    finally:
        a.stop()
        b.stop()
        remove_shm(a_run)
    assert shm_files(b_run) == []


def test_node_gpu_leaves_node_gpu_r1_files_alone(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """``gpu``'s names used to be a prefix of ``gpu-r1``'s: adoption at start and cleanup at
    stop deleted the other node's live snapshot."""
    files = SlotFiles(default_shm_dir(), run_id, "gpu-r1")
    files.prepare()
    theirs = [files.path(0, 0, 1), records.record_path(files.path(0, 0, 1))]
    try:
        create_segment(theirs[0], 2 << 20)
        theirs[1].write_text("not a record this test needs to be valid")
        smp = _start(run_dir, run_id, "gpu", tmp_path / "smp.log")
        smp.stop()
        assert all(p.exists() for p in theirs), "node gpu deleted node gpu-r1's files"
    finally:
        for p in theirs:
            remove_segment(p)


def test_commit_records_are_never_written_through_a_planted_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    slot = SlotFiles(tmp_path, "r", "n").path(0, 0, 1)
    create_segment(slot, 2 << 20)
    tmp = records.record_path(slot).with_name(records.record_path(slot).name + ".tmp")
    tmp.symlink_to(victim)
    rec = CommitRecord(rank=0, slot=0, gen=1, capacity=2 << 20, step=3, seq=1, layout="{}")
    records.write_record(slot, rec)
    assert victim.read_text() == "precious"
    assert records.read_record(records.record_path(slot)).step == 3
    assert not os.path.islink(records.record_path(slot))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant files as another uid")
def test_another_users_planted_files_neither_stop_nor_serve(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """A directory and a file under this run's slot names, owned by another user, in the
    private directory (only root could put them there): the SMP starts, serves, stops
    cleanly and leaves them (it could not remove them anyway)."""
    files = SlotFiles(default_shm_dir(), run_id, "n0")
    files.prepare()
    planted_dir, planted_file = files.path(0, 0, 1), files.path(0, 1, 1)
    assert parse_slot_name(planted_dir.name) is not None
    try:
        planted_dir.mkdir()
        planted_file.write_bytes(b"\0" * 4096)
        for p in (planted_dir, planted_file):
            os.chown(p, OTHER_UID, OTHER_UID)
        smp = _start(run_dir, run_id, "n0", tmp_path / "smp.log")
        code = smp.stop()
        assert code == 0, (tmp_path / "smp.log").read_text()[-2000:]
        assert f"belongs to uid {OTHER_UID}" in (tmp_path / "smp.log").read_text()
        assert planted_dir.is_dir() and planted_file.exists()
    finally:
        if planted_dir.is_dir():
            planted_dir.rmdir()
        remove_segment(planted_file)
