"""Shared fixtures: short run directories, SMPs that are always stopped, process reaping."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.smp.spawn import SmpProcess, start_smp

REPO = Path(__file__).resolve().parent.parent


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer exists (or is a zombie nobody will reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short, private run directory (ipc socket paths must stay under ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def run_id() -> str:
    """A unique run id so shared-memory names never collide between tests."""
    return "t" + uuid.uuid4().hex[:10]


def shm_files(run_id: str) -> list[str]:
    """Arena files of ``run_id`` currently in /dev/shm."""
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"ftmem-{run_id}-"))


@pytest.fixture
def smp(run_dir: Path, run_id: str) -> Iterator[SmpProcess]:
    """A running SMP; stopped after the test, which then checks it left nothing behind."""
    proc = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        start_timeout=timedelta(seconds=60),
        log_path=run_dir / "smp.log",
    )
    try:
        yield proc
    finally:
        proc.stop()
        assert pid_gone(proc.pid)
        assert shm_files(run_id) == [], "the SMP left shared memory behind"


class Procs:
    """Processes a test started; each in its own session so the whole group can be killed."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def spawn(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        f = open(log, "w")  # closed with the process
        p = subprocess.Popen(
            args,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd=REPO,
        )
        f.close()
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs() -> Iterator[Procs]:
    """Start processes through this; all are killed (by process group) and reaped afterwards."""
    ps = Procs()
    try:
        yield ps
    finally:
        ps.kill_all()
        for p in ps.procs:
            assert pid_gone(p.pid)


PYTHON = sys.executable
