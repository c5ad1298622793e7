"""``ftmem status`` finds a running job's SMPs from its run id alone (the run directory is
``<run id>-<node>`` under ``/tmp/ftmem-<uid>``, which a user does not know), and when nothing
matches it names the runs that do exist instead of telling the user to start an SMP (real SMPs,
the real CLI)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.config import ENV_RUN_DIR, SOCKET_NAME
from ftmem.launch.config import default_run_dir
from ftmem.smp.spawn import SmpProcess, start_smp


def _ftmem(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_RUN_DIR}
    return subprocess.run(
        [sys.executable, "-m", "ftmem.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _docs(out: str) -> list[dict[str, object]]:
    dec, docs, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        doc, i = dec.raw_decode(out, i)
        docs.append(doc)
    return docs


@pytest.fixture
def runs(run_id: str) -> Iterator[dict[tuple[str, str], Path]]:
    """Run A on nodes n0 and n1, run B on n0, each where ftmem-launch puts it; and a stale
    socket of run A's n2 (its SMP gone)."""
    shm = Path("/dev/shm") / f"ftmem-test-{run_id}"
    names = [(run_id + "a", "n0"), (run_id + "a", "n1"), (run_id + "b", "n0")]
    dirs = {k: default_run_dir(*k) for k in names}
    stale = default_run_dir(run_id + "a", "n2")
    procs: list[SmpProcess] = []
    try:
        for (rid, node), d in dirs.items():
            d.mkdir(parents=True, mode=0o700)
            procs.append(
                start_smp(
                    run_dir=d,
                    run_id=rid,
                    node=node,
                    log_path=d.parent / f"{d.name}.log",
                    start_timeout=timedelta(seconds=60),
                    extra_args=["--shm-dir", str(shm)],
                )
            )
        stale.mkdir(parents=True, mode=0o700)
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(stale / SOCKET_NAME))  # bound, never listening: a dead SMP's socket
        yield dirs
    finally:
        for p in procs:
            p.stop()
        for d in [*dirs.values(), stale]:
            shutil.rmtree(d, ignore_errors=True)
            (d.parent / f"{d.name}.log").unlink(missing_ok=True)
        shutil.rmtree(shm, ignore_errors=True)


def test_status_by_run_id_finds_that_runs_smps_only(
    runs: dict[tuple[str, str], Path], run_id: str
) -> None:
    got = _ftmem("status", "--run-id", run_id + "a", "--json")
    assert got.returncode == 0, got.stderr
    assert sorted((d["run_id"], d["node"]) for d in _docs(got.stdout)) == [
        (run_id + "a", "n0"),
        (run_id + "a", "n1"),
    ]


def test_status_without_arguments_lists_every_running_smp_of_the_user(
    runs: dict[tuple[str, str], Path],
) -> None:
    got = _ftmem("status", "--json")
    assert got.returncode == 0, got.stderr
    seen = {(d["run_id"], d["node"]) for d in _docs(got.stdout)}
    assert set(runs) <= seen


def test_an_unknown_run_id_names_the_runs_that_exist(
    runs: dict[tuple[str, str], Path], run_id: str
) -> None:
    got = _ftmem("status", "--run-id", run_id + "c")
    assert got.returncode == 1
    assert f"no SMP of run '{run_id}c' runs on this host" in got.stderr
    for (rid, node), d in runs.items():
        assert f"run {rid} node {node} ({d})" in got.stderr
    assert "python -m ftmem.smp" not in got.stderr


def test_a_flush_without_a_common_step_names_each_ranks_steps(run_dir: Path, run_id: str) -> None:
    """Rank 0 committed step 1, rank 1 said hello and committed nothing: `ftmem flush` says
    which rank holds what instead of only "no step is committed by every rank yet"."""
    import torch

    import ftmem
    from ftmem.config import ClientConfig
    from ftmem.protocol import messages as m
    from ftmem.protocol.smp_client import SmpClient

    shm = Path("/dev/shm") / f"ftmem-test-{run_id}"
    smp = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        node="n0",
        log_path=run_dir / "smp.log",
        extra_args=["--shm-dir", str(shm), "--flush-dir", str(run_dir / "tier")],
    )
    try:
        c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        c.save({"model": torch.nn.Linear(8, 8)}, step=1)
        assert c.wait(60)
        with SmpClient(run_dir) as other:
            other.request(m.Hello(rank=1, pid=os.getpid(), world_size=2))
        got = _ftmem("flush", "--run-dir", str(run_dir), "--timeout", "60")
        assert got.returncode == 1
        assert "no step is committed by every rank yet (rank 0: steps [1]; rank 1: none)" in (
            got.stderr + got.stdout
        )
        c.close()
    finally:
        smp.stop()
        shutil.rmtree(shm, ignore_errors=True)


def test_the_disk_tiers_line_says_when_nothing_is_scheduled_or_flushed_yet() -> None:
    from ftmem.cli import flush_line
    from ftmem.protocol.status import FlushStatus

    idle = FlushStatus(enabled=True, tiers=("/ckpt",), every=0, keep=2)
    line = flush_line(idle)
    assert "on `ftmem flush` and SIGTERM only" in line and "nothing flushed yet" in line
    assert "every 0 steps" not in line and "None" not in line
    done = FlushStatus(
        enabled=True, tiers=("/ckpt",), every=10, keep=2, last_step=20, last_seconds=1.5, flushes=2
    )
    assert "every 10 steps, keep 2; last flushed step 20 (1.5 s); flushes 2" in flush_line(done)
