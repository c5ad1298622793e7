"""The run directory, the SMP's key and the slot files are used only when they are this user's
and private: a directory planted in /tmp, a key or slot file opened up or swapped for a
symlink is refused with a clear error (real SMP processes, real files).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem import config
from ftmem.config import AUTH_KEY_NAME
from ftmem.errors import SmpStartError, UnsafePathError
from ftmem.protocol.smp_client import SmpClient
from ftmem.secure_fs import prepare_private_dir
from ftmem.shm import MappedSegment, create_segment, remove_segment, slot_file_name
from ftmem.smp.spawn import SmpProcess, start_smp

ROOT = os.geteuid() == 0


def test_default_run_dir_prefers_a_private_xdg_runtime_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(config.ENV_RUN_DIR, raising=False)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert config.default_run_dir("r1") == runtime / "ftmem" / "r1"
    runtime.chmod(0o755)  # not what the specification promises: not used
    assert config.default_run_dir("r1") == Path("/tmp") / f"ftmem-{os.getuid()}" / "r1"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert config.default_run_dir("r1") == Path("/tmp") / f"ftmem-{os.getuid()}" / "r1"


def test_prepare_makes_private_dirs_and_refuses_symlinks(tmp_path: Path) -> None:
    run = tmp_path / "a" / "b" / "run"
    prepare_private_dir(run, "run directory")
    for d in (run.parent.parent, run.parent, run):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    link = tmp_path / "a" / "b" / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        prepare_private_dir(link, "run directory")
    assert stat.S_IMODE(os.lstat(target).st_mode) == 0o755  # the target was not chmodded
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    with pytest.raises(UnsafePathError, match="writable by others"):
        prepare_private_dir(open_parent / "run", "run directory")


@pytest.mark.skipif(not ROOT, reason="needs root to plant a directory as another uid")
def test_an_smp_refuses_a_run_dir_under_another_users_directory(tmp_path: Path) -> None:
    """Another user made the parent (as they could make /tmp/ftmem-<uid>): the SMP exits
    with a clear error instead of serving from a directory they can swap."""
    planted = Path(tempfile.mkdtemp(prefix="ftm-planted-", dir="/tmp"))
    try:
        os.chown(planted, 65534, 65534)
        planted.chmod(0o777)
        with pytest.raises(SmpStartError) as err:
            start_smp(
                run_dir=planted / "run",
                run_id="planted",
                start_timeout=timedelta(seconds=60),
                log_path=tmp_path / "smp.log",
            )
        log = (tmp_path / "smp.log").read_text()
        assert "belongs to uid 65534" in log or "belongs to uid 65534" in str(err.value)
        assert not (planted / "run").exists()
    finally:
        subprocess.run(["rm", "-rf", str(planted)], check=False)


def test_clients_refuse_a_key_or_run_dir_others_can_read(smp: SmpProcess, run_dir: Path) -> None:
    with SmpClient(run_dir, timeout=timedelta(seconds=30)) as client:
        assert client.smp_pid == smp.pid
    key = run_dir / AUTH_KEY_NAME
    key.chmod(0o644)
    try:
        with pytest.raises(UnsafePathError, match="open to others"):
            SmpClient(run_dir)
    finally:
        key.chmod(0o600)
    run_dir.chmod(0o755)
    try:
        with pytest.raises(UnsafePathError, match="run directory"):
            SmpClient(run_dir)
    finally:
        run_dir.chmod(0o700)
    real = run_dir / "real.key"
    os.rename(key, real)
    key.symlink_to(real)
    try:
        with pytest.raises(UnsafePathError, match="symbolic link"):
            SmpClient(run_dir)
    finally:
        key.unlink()
        os.rename(real, key)


def test_ranks_refuse_slot_files_others_can_open_or_symlinked(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    seg = shm / slot_file_name("r", "n", "0123456789abcdef", 0, 0, 1)
    create_segment(seg, 2 << 20)
    MappedSegment(seg, 2 << 20, shm).close()
    seg.chmod(0o666)
    with pytest.raises(UnsafePathError, match="open to others"):
        MappedSegment(seg, 2 << 20, shm)
    seg.chmod(0o600)
    link = shm / slot_file_name("r", "n", "0123456789abcdef", 0, 1, 1)
    link.symlink_to(tmp_path / "outside")
    (tmp_path / "outside").write_bytes(b"\0" * (2 << 20))
    with pytest.raises(ValueError, match="not a slot file"):
        MappedSegment(link, 2 << 20, shm)
    remove_segment(seg)


def test_the_smp_cli_names_the_unsafe_dir(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    p = subprocess.run(
        [sys.executable, "-m", "ftmem.smp", "--run-dir", str(open_dir / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert "writable by others" in p.stderr
