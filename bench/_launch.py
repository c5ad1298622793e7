"""Starting and reaping the jobs the bench scripts run (``ftmem-launch`` agents, ``torchrun``)
on :mod:`tests._support.launcher`'s process handling; what the training-job parts share (the
example's flags, a job's result, its clean-up); SMP STATUS polling.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

from tests._support import workload
from tests._support.launcher import (
    AgentProcess,
    agent_env,
    free_port,
    launch_args,
    launch_command,
    remove_shm,
    shm_files,
)

__all__ = ["free_port", "remove_shm"]  # re-exported for the bench scripts

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = Path(workload.SCRIPT)
"""The script the benchmarks train: the test workload (the example's loop plus its switches)."""
# The example's model size in the launcher benchmarks: 2.64 M parameters (32 MB of state per
# rank), about 0.1 s a step on one core here.
MODEL_DEFAULTS = {"d_model": 256, "n_layers": 2, "vocab": 2048, "seq_len": 32, "batch_size": 2}
# The example's closing prints.
MEDIAN_RE = re.compile(r"\[rank (\d+)\] median step time ([0-9.]+) s")
MEAN_RE = re.compile(r"\[rank (\d+)\] mean step time ([0-9.]+) s")


def job_env(**extra: str) -> dict[str, str]:
    """A job's environment: :func:`tests._support.launcher.agent_env` (standby ranks off unless
    asked for), the repository on PYTHONPATH, unbuffered output."""
    return agent_env({"PYTHONUNBUFFERED": "1", **extra}, pythonpath=[REPO])


def single_node_args(*, nproc: int, run_id: str, run_dir: Path) -> list[str]:
    """``ftmem-launch`` flags for one node: c10d rendezvous on a free local port, own run dir."""
    rdzv = {"rdzv_endpoint": f"127.0.0.1:{free_port()}", "rdzv_id": run_id}
    return launch_args(nproc=nproc, node="n0", run_dir=run_dir, **rdzv)


class Job(AgentProcess):
    """One command in a session of its own, run in the repository, its output in ``log``."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str], cwd: Path = REPO) -> None:
        super().__init__(cmd, log, env, cwd=cwd)


class Agent(Job):
    """One ``ftmem-launch`` agent (``python -m ftmem.launch ARGS``)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        super().__init__(launch_command(args), log, env)


def wait_all(
    jobs: list[Job], *, timeout: float, poller: StatusPoller | None = None, poll_s: float = 0.5
) -> None:
    """Wait until every job has exited, polling ``poller`` every ``poll_s`` seconds meanwhile;
    TimeoutError if a job still runs after ``timeout`` seconds (the caller stops the jobs)."""
    deadline = time.monotonic() + timeout
    next_poll = 0.0
    while any(job.poll() is None for job in jobs):
        for job in jobs:
            job.children()
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"not finished within {timeout:g} s")
        if poller is not None and now >= next_poll:
            poller.poll()
            next_poll = now + poll_s
        time.sleep(0.1)


def shm_bytes(run_id: str) -> tuple[int, int]:
    """(allocated bytes, file count) of the shared-memory files of ``run_id``."""
    total = count = 0
    for name in shm_files(run_id):
        with contextlib.suppress(OSError):
            total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
            count += 1
    return total, count


class StatusPoller:
    """Polls the STATUS of the SMP of each run directory (one client each, reopened on error),
    keeping the last STATUS of each and its SMP's CPU seconds (its children's included: the
    encode workers); :meth:`close` closes them."""

    def __init__(self, run_dirs: list[Path], timeout: timedelta = timedelta(seconds=2)) -> None:
        self.run_dirs = run_dirs
        self.timeout = timeout
        self.clients: dict[int, Any] = {}
        self.last: dict[int, dict[str, Any]] = {}
        self.cpu: dict[int, float] = {}
        self.polls = 0

    def poll(self) -> None:
        """Ask every SMP that serves for its STATUS; skip those that do not answer."""
        from ftmem.errors import FtmemError
        from ftmem.protocol.smp_client import SmpClient

        self.polls += 1
        for i, rd in enumerate(self.run_dirs):
            if i not in self.clients and not (rd / "smp.sock").exists():
                continue
            try:
                if i not in self.clients:
                    self.clients[i] = SmpClient(rd, timeout=self.timeout)
                st = self.clients[i].status_document()  # recorded as sent
            except (FtmemError, OSError):
                if (client := self.clients.pop(i, None)) is not None:
                    client.close()
                continue
            self.last[i] = st
            with contextlib.suppress(psutil.Error, KeyError, ValueError):
                smp = psutil.Process(int(st["pid"]))
                t = smp.cpu_times()
                # Its live children too (encode workers): their CPU is the SMP's work.
                self.cpu[i] = t.user + t.system + t.children_user + t.children_system
                for child in smp.children():
                    with contextlib.suppress(psutil.Error):
                        ct = child.cpu_times()
                        self.cpu[i] += ct.user + ct.system

    def skipped(self) -> dict[int, int]:
        """Snapshots each rank skipped, summed over the nodes (last STATUS of each)."""
        out: dict[int, int] = {}
        for st in self.last.values():
            for r, rs in (st.get("ranks") or {}).items():
                out[int(r)] = out.get(int(r), 0) + int(rs.get("skipped") or 0)
        return out

    def close(self) -> None:
        """Close every client."""
        for client in self.clients.values():
            client.close()
        self.clients.clear()


def flags(**values: Any) -> list[str]:
    """``--name value`` for each keyword, in order (``_`` in a name becomes ``-``)."""
    return [x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def model_flags(args: argparse.Namespace) -> list[str]:
    """The example's model-size flags from ``args`` (``add_model_args``)."""
    return flags(**{k: getattr(args, k) for k in MODEL_DEFAULTS})


def example() -> str:
    """The workload script, relative to the repository root."""
    return str(EXAMPLE.relative_to(REPO))


def shown(cmd: list[str], tmp: Path) -> str:
    """A command for the docs: repository-relative, ``python``, ``tmp`` shown as ``$TMP``."""
    text = " ".join(cmd).replace(str(tmp), "$TMP").replace(str(REPO) + "/", "")
    return text.replace(sys.executable, "python")


@dataclass
class JobRun:
    """One training job in one configuration: status and each rank's step times."""

    config: str
    repeat: int
    ok: bool = False
    error: str = ""
    wall_s: float = 0.0
    load_start: float = 0.0
    rank_median: dict[int, float] = field(default_factory=dict)
    rank_mean: dict[int, float] = field(default_factory=dict)

    def read_step_times(self, text: str) -> None:
        """Each rank's median and mean step time from the example's closing lines."""
        for r, v in MEDIAN_RE.findall(text):
            self.rank_median[int(r)] = float(v)
        for r, v in MEAN_RE.findall(text):
            self.rank_mean[int(r)] = float(v)


def clean_up(res: Any, run_id: str, tmp: Path, keep_logs: bool) -> None:
    """Remove the shared memory of ``run_id`` left behind (noted in ``res.notes``) and ``tmp``."""
    if leftovers := remove_shm(run_id):
        res.notes.append(f"shared memory left behind (removed): {leftovers}")
    if keep_logs:
        print(f"# {res.config} {res.repeat}: logs kept in {tmp}", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The example's model-size flags, with :data:`MODEL_DEFAULTS` as defaults."""
    for name, default in MODEL_DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def add_job_args(p: argparse.ArgumentParser, *, run_timeout: float) -> None:
    """``--poll`` (STATUS interval), ``--run-timeout`` (one job) and ``--keep-logs``."""
    p.add_argument("--poll", type=float, default=0.5, help="STATUS poll interval (s)")
    timeout = "one job, start to end (s)"
    p.add_argument("--run-timeout", type=float, default=run_timeout, help=timeout)
    p.add_argument("--keep-logs", action="store_true", help="keep each job's logs and dirs")
