"""``ftmem cleanup`` finds the slot files a SIGKILLed SMP left behind, and only those: a live
SMP's files (its lock held, its rank mapping them) are never listed (real SMPs, real ranks'
mappings, the real CLI).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

import ftmem
from ftmem.config import ClientConfig
from ftmem.smp.spawn import start_smp
from ftmem.testing.harness import remove_shm, shm_files


def _cleanup(*flags: str) -> str:
    p = subprocess.run(
        [sys.executable, "-m", "ftmem.cli", "cleanup", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_cleanup_lists_and_removes_only_orphans(run_dir: Path, run_id: str) -> None:
    dead_id = run_id + "d"
    dead_dir = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    wait = timedelta(seconds=60)
    live = start_smp(
        run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log", start_timeout=wait
    )
    dead = start_smp(
        run_dir=dead_dir, run_id=dead_id, log_path=dead_dir / "smp.log", start_timeout=wait
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
        orphans = shm_files(dead_id)
        assert orphans and shm_files(run_id)
        out = _cleanup()
        assert "dry run" in out
        for name in orphans:
            assert f"/dev/shm/{name}" in out
        assert run_id + "-" not in out.replace(dead_id, "")
        assert shm_files(dead_id) == orphans  # a dry run removes nothing
        _cleanup("--remove")
        assert shm_files(dead_id) == []
        assert shm_files(run_id), "the live SMP's slots were removed"
        live_client.close()
    finally:
        live.stop()
        dead.stop()
        remove_shm(dead_id)
        shutil.rmtree(dead_dir, ignore_errors=True)
