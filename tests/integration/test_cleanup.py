"""``ftmem cleanup`` finds the slot files a SIGKILLed SMP left behind in the user's private
shared-memory directory, and only those: a live SMP's files (its lock held, its rank mapping
them) are never listed (real SMPs, real ranks' mappings, the real CLI).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

import ftmem
from ftmem.config import ClientConfig
from ftmem.shm import board_file_name, new_nonce
from ftmem.smp.spawn import start_smp
from tests._support.launcher import shm_files


def _cleanup(*flags: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "ftmem.cli", "cleanup", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def _listed(out: str) -> list[str]:
    """The paths a cleanup run listed."""
    return [line.split(": ", 1)[1].rsplit(" (", 1)[0] for line in out.splitlines() if ": /" in line]


def test_cleanup_lists_and_removes_only_orphans(run_dir: Path, run_id: str) -> None:
    """The dead SMP's run and node (``X-b``/``c``) join to the same text as the live one's
    (``X``/``b-c``): the live lock must neither hide the orphans nor the orphans' names
    reach the live SMP's files."""
    dead_id, dead_node, live_node = run_id + "-b", "c", "b-c"
    dead_dir = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    # A private directory of the test's own, so that other tests' files are not its business.
    shm = Path("/dev/shm") / f"ftmem-test-{run_id}"
    wait = timedelta(seconds=60)
    live = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        node=live_node,
        log_path=run_dir / "smp.log",
        start_timeout=wait,
        extra_args=["--shm-dir", str(shm)],
    )
    dead = start_smp(
        run_dir=dead_dir,
        run_id=dead_id,
        node=dead_node,
        log_path=dead_dir / "smp.log",
        start_timeout=wait,
        extra_args=["--shm-dir", str(shm)],
    )
    model = torch.nn.Linear(64, 64)
    try:
        for rd in (run_dir, dead_dir):
            c = ftmem.Checkpointer(ClientConfig(run_dir=rd))
            c.save({"model": model}, step=1)
            assert c.wait(60)
            if rd == dead_dir:
                c.close()
            else:
                live_client = c  # keeps its slots mapped
        dead.kill()  # the OOM killer: nothing is cleaned up
        # grant boards (an SMP of several ranks makes one): the dead one's is an orphan
        for rid, node in ((dead_id, dead_node), (run_id, live_node)):
            board = shm / board_file_name(rid, node, new_nonce())
            fd = os.open(board, os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
        orphans, live_files = shm_files(dead_id, shm_dir=shm), shm_files(run_id, shm_dir=shm)
        assert orphans and live_files
        # the host key files of both runs (a killed agent leaves its run's behind)
        for rid in (dead_id, run_id):
            fd = os.open(shm / f"{rid}.mesh-key", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
        orphans = sorted([*orphans, str(shm / f"{dead_id}.mesh-key")])
        out = _cleanup("--shm-dir", str(shm))
        assert "dry run" in out
        assert sorted(_listed(out)) == orphans  # all of them, and nothing else
        assert _listed(_cleanup("--shm-dir", str(shm), "--run-id", run_id + "-zz")) == []
        assert sorted(_listed(_cleanup("--shm-dir", str(shm), "--run-id", dead_id))) == orphans
        assert shm_files(dead_id, shm_dir=shm) == orphans[1:]  # a dry run removes nothing
        _cleanup("--remove", "--shm-dir", str(shm), "--run-id", dead_id)
        assert shm_files(dead_id, shm_dir=shm) == []
        assert not (shm / f"{dead_id}.mesh-key").exists()
        assert (shm / f"{run_id}.mesh-key").exists(), "the live run's key was removed"
        assert shm_files(run_id, shm_dir=shm) == live_files, "the live SMP's slots were removed"
        live_client.close()
    finally:
        live.stop()
        dead.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(dead_dir, ignore_errors=True)


def test_cleanup_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o777)
    p = subprocess.run(
        [sys.executable, "-m", "ftmem.cli", "cleanup", "--remove", "--shm-dir", str(shm)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and str(shm) in p.stderr and "writable by others" in p.stderr


def _catches_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (15 - 1)))


def test_an_smp_stopped_while_starting_still_removes_what_its_predecessor_left(
    run_dir: Path, run_id: str
) -> None:
    """An SMP SIGKILLed leaves its slots; its replacement gets SIGTERM while it is still
    importing (a job's timeout hitting right after an SMP restart). It used to die by the
    default action and leave the slots; now it starts, adopts them, and removes them."""
    import signal
    import time

    shm = Path("/dev/shm") / f"ftmem-test-{run_id}"
    args = ["--shm-dir", str(shm)]
    try:
        first = start_smp(
            run_dir=run_dir, run_id=run_id, node="n0", log_path=run_dir / "smp.log", extra_args=args
        )
        c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        c.save({"model": torch.nn.Linear(64, 64)}, step=1)
        assert c.wait(60)
        c.close()
        first.kill()
        assert shm_files(run_id, shm_dir=shm)
        with open(run_dir / "smp2.log", "wb") as log:
            second = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ftmem.smp",
                    "--run-dir",
                    str(run_dir),
                    "--run-id",
                    run_id,
                    "--node",
                    "n0",
                    *args,
                ],
                stdout=log,
                stderr=log,
            )
            deadline = time.monotonic() + 30  # until it catches SIGTERM (its first act),
            while not _catches_sigterm(second.pid):  # i.e. well inside its imports (~0.7 s)
                assert time.monotonic() < deadline and second.poll() is None
                time.sleep(0.002)
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0, (run_dir / "smp2.log").read_text()[-2000:]
        assert "stop requested (signal 15) while starting" in (run_dir / "smp2.log").read_text()
        assert shm_files(run_id, shm_dir=shm) == []
    finally:
        shutil.rmtree(shm, ignore_errors=True)
