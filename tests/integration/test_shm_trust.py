"""Shared memory is shared by every user and every SMP: an SMP touches only the files of
exactly its run and node that belong to this user, never writes through a planted symlink,
and never shares a run and node with another SMP (real SMP processes, real /dev/shm files).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.errors import SmpStartError
from ftmem.format.record import CommitRecord
from ftmem.shm import create_segment, remove_segment
from ftmem.smp import records
from ftmem.smp.spawn import SmpProcess, start_smp
from ftmem.testing.harness import pid_gone

SHM = Path("/dev/shm")


def _start(run_dir: Path, run_id: str, node: str, log: Path) -> SmpProcess:
    return start_smp(
        run_dir=run_dir,
        run_id=run_id,
        node=node,
        start_timeout=timedelta(seconds=60),
        log_path=log,
    )


def test_a_second_smp_of_the_same_run_and_node_is_refused(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    first = _start(run_dir, run_id, "n0", tmp_path / "first.log")
    other_dir = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    try:
        with pytest.raises(SmpStartError):
            _start(other_dir, run_id, "n0", tmp_path / "second.log")
        log = (tmp_path / "second.log").read_text()
        assert f"another SMP (pid {first.pid}) serves run {run_id}, node n0" in log
        assert not pid_gone(first.pid), "the first SMP must keep serving"
    finally:
        first.stop()
        shutil.rmtree(other_dir, ignore_errors=True)
    again = _start(run_dir, run_id, "n0", tmp_path / "again.log")  # the lock went with it
    again.stop()


def test_node_gpu_leaves_node_gpu_r1_files_alone(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """``gpu``'s file names are a prefix of ``gpu-r1``'s: adoption at start and cleanup at stop
    used to delete the other node's live snapshot."""
    theirs = [
        SHM / f"ftmem-{run_id}-gpu-r1-r0-s0-g1",
        SHM / f"ftmem-{run_id}-gpu-r1-r0-s0-g1.commit",
    ]
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
    slot = tmp_path / "ftmem-r-n-r0-s0-g1"
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
    """A directory and a file under this run's slot names, owned by another user: the SMP
    starts, serves, stops cleanly and leaves them (it could not remove them anyway)."""
    planted_dir = SHM / f"ftmem-{run_id}-n0-r0-s0-g1"
    planted_file = SHM / f"ftmem-{run_id}-n0-r0-s1-g1"
    try:
        planted_dir.mkdir()
        planted_file.write_bytes(b"\0" * 4096)
        for p in (planted_dir, planted_file):
            os.chown(p, 65534, 65534)
        smp = _start(run_dir, run_id, "n0", tmp_path / "smp.log")
        code = smp.stop()
        assert code == 0, (tmp_path / "smp.log").read_text()[-2000:]
        assert "belongs to uid 65534" in (tmp_path / "smp.log").read_text()
        assert planted_dir.is_dir() and planted_file.exists()
    finally:
        if planted_dir.is_dir():
            planted_dir.rmdir()
        remove_segment(planted_file)
