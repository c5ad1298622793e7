"""The SMP's flush worker process over its typed protocol: a real ``python -m
ftmem.tiers.flush_worker`` answers a line that is not a job with a clear error and goes on,
and FlushProcess reports a SIGKILLed worker as gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ftmem.protocol.flush_jobs import AssembleJob, JobDone, WorkerReady, encode, parse_reply
from ftmem.smp.flush_process import FlushProcess
from tests._support.launcher import pid_gone

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
