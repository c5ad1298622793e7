"""launcher/slurm/ftmem.sbatch on a real Slurm cluster (Debian's slurmctld, slurmd, munge) of
namespace hosts: a node lost mid-run (its slurmd and its job step SIGKILLed, its memory wiped)
is replaced by the spare from memory; a job requeued as a whole resumes from the persistent
tier. Both end with the digests of a failure-free run of the same world size.

Skipped, with the reason, where Slurm is not installed (``.ci/run`` installs it) or namespace
hosts cannot be made. ``sacct`` needs slurmdbd and a database, so the job's end is read from
the cluster's job completion log (``jobcomp/filetxt``) instead.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.config import ENV_TIER_KEY_FILE
from ftmem.errors import FtmemError
from ftmem.protocol.smp_client import SmpClient
from ftmem.tiers.checkpoints import list_checkpoints
from tests._support.launcher import TINY, WORKLOAD, Launcher, digests, reference_digests
from tests._support.procs import REPO
from tests._support.slurm import SlurmCluster, slurm_unavailable

SBATCH = REPO / "launcher" / "slurm" / "ftmem.sbatch"
STEPS = 150


def reference(launcher: Launcher, steps: int = STEPS) -> dict[int, str]:
    """Digests of a failure-free single-node run with 3 ranks (the same world size)."""
    return reference_digests(launcher, steps, nproc=3)


@pytest.fixture
def cluster(launcher_env: Launcher) -> Iterator[SlurmCluster]:
    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    with SlurmCluster(4, launcher_env.tmp / "slurm") as c:
        yield c


def _wait(what: str, ok: Callable[[], bool], timeout: float, c: SlurmCluster, out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            text = out.read_text()[-4000:] if out.exists() else "(no output)"
            raise AssertionError(f"{what} not within {timeout} s\n{text}\n{c.logs()}")
        time.sleep(0.5)


def _job_env(launcher: Launcher, shared: Path, **extra: str) -> dict[str, str]:
    return launcher.env(
        TRAIN_NODES="3",
        NPROC_PER_NODE="1",
        TRAIN_SCRIPT=str(WORKLOAD),
        # The delay leaves time to fail a node mid-run; after the resume only the end is awaited.
        TRAIN_ARGS=" ".join(
            ["--steps", str(STEPS), "--step-delay", "0.15", "--fast-after-resume", *TINY]
        ),
        SHARED_DIR=str(shared),
        LOCAL_DIR="/dev/shm/ftmem-local",  # each host's own /dev/shm: node-local for real
        LAUNCH_ARGS="--ftmem-ec-parity 1 --ftmem-standby 0",
        **extra,
    )


def _done(c: SlurmCluster, job: int) -> dict[str, str] | None:
    """The job's final completion record (None while it runs or waits to run again)."""
    for rec in c.completions():
        if rec.get("JobId") == str(job) and rec.get("JobState") in _FINAL:
            return rec
    return None


_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
"""Job states of a job that is over (a record of RESIZING, after a node of a --no-kill job
was lost, or REQUEUED is not its end)."""


def _complete(tier: Path) -> list[int]:
    """The steps of the complete (whole-job) checkpoints in ``tier``."""
    if not tier.exists():
        return []
    return [ck.step for ck in list_checkpoints(tier)[0] if not ck.is_part]


def _protected(job: int, attempt: int, at_least: int) -> int:
    """How many of the job's SMPs report a protected step >= ``at_least``."""
    n = 0
    for rd in glob.glob(f"/tmp/ftmem-{os.getuid()}/{job}-{attempt}-*"):
        try:
            with SmpClient(Path(rd), timeout=timedelta(seconds=2)) as smp:
                ex = smp.status().protection
        except FtmemError:
            continue
        if ex is not None and (ex.protected_step or 0) >= at_least:
            n += 1
    return n


def test_a_lost_node_is_replaced_by_the_spare_and_the_job_completes(
    launcher_env: Launcher, cluster: SlurmCluster
) -> None:
    """3 training nodes + 1 spare. Once every training node's step is protected, a training
    node other than the batch host (it serves the c10d rendezvous) is lost silently: its link,
    then its slurmd, its job step and its memory. The spare takes its place, rebuilt from the peers' parity; the job
    ends COMPLETED with the failure-free digests."""
    ref = reference(launcher_env)
    c = cluster
    out = c.dir / "job.out"
    job = c.sbatch(SBATCH, _job_env(launcher_env, c.dir / "shared"), "--nodes=4", f"--output={out}")
    spare_re = re.compile(r"\[(h\d)-\d+\] SPARE: the job has all its nodes")
    _wait("a spare", lambda: out.exists() and bool(spare_re.search(out.read_text())), 120, c, out)
    _wait("3 protected nodes", lambda: _protected(job, 0, 20) == 3, 180, c, out)
    m = spare_re.search(out.read_text())
    assert m is not None
    spare = int(m.group(1)[1:])
    victim = next(k for k in (2, 3, 4) if k != spare)  # h1 runs the batch script and c10d
    c.hosts.cut(victim)  # silently: its link first, then its processes
    c.hosts.kill(victim)
    _wait("the job's end", lambda: _done(c, job) is not None, 300, c, out)
    rec = _done(c, job)
    text = out.read_text()
    assert rec is not None and rec["JobState"] == "COMPLETED", (rec, text[-4000:])
    assert "SPARE TAKES OVER" in text, text[-4000:]
    assert digests(text) == ref, text[-4000:]
    assert c.job(job).get("JobState") in ("COMPLETED", None)


def test_a_requeued_job_resumes_from_the_persistent_tier(
    launcher_env: Launcher, cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job flushes every 10 steps. Once a checkpoint is in the shared directory, the whole
    job is requeued and held, every node's memory and local disk are wiped (a new allocation
    has neither), and it is released: the second attempt starts a new rendezvous, finds no
    snapshot in memory and resumes from the persistent tier; the job ends COMPLETED with the
    failure-free digests. The checkpoints are signed with the tier key the script made on the
    shared directory; the job's own mesh key is gone at the end, and so are the nodes' local
    tiers."""
    ref = reference(launcher_env)
    c = cluster
    out = c.dir / "job.out"
    shared = c.dir / "shared"
    monkeypatch.setenv(ENV_TIER_KEY_FILE, str(shared / "tier.key"))  # to read the job's tiers
    env = _job_env(launcher_env, shared, FLUSH_EVERY="10")
    job = c.sbatch(SBATCH, env, "--nodes=4", f"--output={out}")
    ckpts = shared / "checkpoints"
    # A complete checkpoint of every rank (the nodes' parts assembled), not one being written.
    _wait("a persistent checkpoint", lambda: bool(_complete(ckpts)), 240, c, out)
    first = max(_complete(ckpts))
    c.run("scontrol", "requeuehold", str(job))
    # Held once every process of the first attempt is gone (the job is PENDING again).
    _wait("the first attempt's end", lambda: c.job(job).get("JobState") == "PENDING", 120, c, out)
    for k in range(1, 5):  # each node's /dev/shm: its SMP's slots and its local tier
        for entry in c.hosts.shm_dir(k).iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    c.run("scontrol", "release", str(job))
    # Slurm delays a requeued job's start (its begin time) by two minutes: not here.
    c.run("scontrol", "update", f"jobid={job}", "StartTime=now")
    _wait("the job's end", lambda: _done(c, job) is not None, 300, c, out)
    rec = _done(c, job)
    text = out.read_text()
    assert rec is not None and rec["JobState"] == "COMPLETED", (rec, text[-4000:])
    resumed = [int(s) for s in re.findall(r"\[rank \d+\] resumed from step (\d+)", text)]
    assert max(resumed, default=0) >= first, (first, resumed, text[-4000:])
    assert digests(text) == ref, text[-4000:]
    assert (shared / "tier.key").stat().st_mode & 0o777 == 0o600
    assert not (shared / f"mesh-{job}.key").exists()
    for k in range(1, 5):  # each agent succeeded: its private local tier is removed
        assert list((c.hosts.shm_dir(k) / "ftmem-local").glob(f"ftmem-{job}.*")) == []
