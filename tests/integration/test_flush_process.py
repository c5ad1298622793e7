"""The SMP's flush worker process over its typed protocol: a real ``python -m
ftmem.tiers.flush_worker`` answers a line that is not a job with a clear error and goes on,
FlushProcess reports a SIGKILLed worker as gone, and an SMP stopped while another node's
part never comes keeps its own part and exits within its final-flush bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from ftmem.protocol.flush_jobs import AssembleJob, JobDone, WorkerReady, encode, parse_reply
from ftmem.smp.flush_process import FlushProcess
from ftmem.smp.spawn import start_smp
from tests._support.launcher import pid_gone, remove_shm, shm_files

START_S = 120.0  # the worker imports torch and DCP (slow when other processes start too)


def test_the_worker_refuses_a_bad_line_and_serves_the_next_job(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "ftmem.tiers.flush_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        _serve_two_lines(proc, tmp_path)


def _serve_two_lines(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert isinstance(parse_reply(proc.stdout.readline()), WorkerReady)
        proc.stdin.write('{"op": "assemble", "id": "3", "tier": "/t", "world_size": 2}\n')
        proc.stdin.write(encode(AssembleJob(7, str(tmp_path), 2)))
        proc.stdin.flush()
        bad = parse_reply(proc.stdout.readline())
        assert isinstance(bad, JobDone) and not bad.ok and bad.id == -1
        assert "bad request" in bad.error and "'id' must be an integer" in bad.error
        assert parse_reply(proc.stdout.readline()) == JobDone(7, True)  # nothing to assemble
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_flush_process_reports_a_killed_worker_as_gone(tmp_path: Path) -> None:
    worker = FlushProcess("n0")
    try:
        worker.ensure()
        assert worker.ready.wait(0) is False
        deadline = time.monotonic() + START_S
        got = []
        while not worker.ready.is_set():
            assert time.monotonic() < deadline, "the worker never said it was ready"
            got += worker.replies()
            time.sleep(0.05)
        assert worker.send(AssembleJob(1, str(tmp_path), 2))
        while JobDone(1, True) not in got:
            assert time.monotonic() < deadline, got
            got += worker.replies()
            time.sleep(0.05)
        pid = worker._proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        while None not in got:
            assert time.monotonic() < deadline, got
            got += worker.replies()
            time.sleep(0.05)
        assert not worker.ready.is_set() and worker.exit_code == -signal.SIGKILL
    finally:
        worker.end()
    assert pid_gone(pid)
    assert not worker.send(AssembleJob(2, str(tmp_path), 2))


def test_a_stopped_smp_waits_for_a_dead_nodes_part_only_within_its_final_flush_bound(
    run_dir: Path, run_id: str, tmp_path: Path
) -> None:
    """The node of rank 0 of a 2-rank job, with a shared tier: rank 1's node never writes its
    part (it died). On SIGTERM the final flush writes this node's part and waits for the
    other within ``--flush-on-stop`` (not ``ftmem flush``'s 300 s); the SMP exits by itself
    before the launcher's grace (``flush_on_stop`` + 10 s) would SIGKILL it."""
    local, shared, bound = tmp_path / "local", tmp_path / "shared", 10
    extra = ["--flush-dir", str(local), "--flush-shared-dir", str(shared)]
    smp = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        start_timeout=timedelta(seconds=60),
        log_path=run_dir / "smp.log",
        extra_args=[*extra, "--flush-on-stop", str(bound)],
    )
    try:
        deadline = time.monotonic() + START_S
        while "flush worker ready" not in (run_dir / "smp.log").read_text():
            assert time.monotonic() < deadline, "the flush worker never said it was ready"
            time.sleep(0.1)
        env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.update(FTMEM_RUN_DIR=str(run_dir), FTMEM_RUN_ID=run_id)
        save = (
            "import torch, ftmem; s = {'w': torch.arange(8.0)}; ftmem.save(s, 1);"
            " ftmem.save(s, 2); assert ftmem.wait(timeout=60); ftmem.close()"
        )
        rank = subprocess.run([sys.executable, "-c", save], env=env, timeout=START_S)
        assert rank.returncode == 0
    finally:
        code = smp.stop(timedelta(seconds=bound + 10))
    try:
        log = (run_dir / "smp.log").read_text()
        assert code == 0, log[-3000:]  # not SIGKILLed
        assert "no part of ranks [1] reached" in log, log[-3000:]
        assert (shared / "step_0000000002.part-r000000" / "ftmem-manifest.json").is_file()
        assert shm_files(run_id) == []
    finally:
        remove_shm(run_id)  # a SIGKILLed SMP leaves its slot files
