"""Shared fixtures: short run directories, SMPs that are always stopped, process reaping,
ftmem-launch agents (``launcher_env``) and SMP meshes (``cluster_factory``).

Support code lives in plain modules under ``tests/_support/``; processes are started,
watched and reaped with :mod:`tests._support.launcher`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import Launcher, running_smp, shm_files, short_dir
from tests._support.smp_mesh import Cluster

FAULTS = Path(__file__).resolve().parent / "faults"
ONE_HOST_FAULTS = {
    "test_agreement.py",
    "test_cuda_launcher.py",
    "test_fsdp.py",
    "test_hf_trainer.py",
    "test_in_process.py",
    "test_last_step.py",
    "test_launcher_faults.py",
    "test_lightning.py",
    "test_rank_kill.py",
    "test_sharded.py",
}
"""Fault tests whose jobs run on this host alone (no namespace hosts, no etcd, no Slurm, no
erasure-coded group): they may run beside the other fault tests, as unit tests do."""


def pytest_configure(config: pytest.Config) -> None:
    """Install what the suite needs beyond the test extra where it is missing
    (:mod:`tests._support.system`), once, in the main process (pytest-xdist's workers start
    after it); ``FTMEM_TEST_INSTALL=0`` skips this."""
    if hasattr(config, "workerinput") or os.environ.get("FTMEM_TEST_INSTALL", "1") == "0":
        return
    from tests._support import system

    system.ensure(lambda line: print(f"tests: {line}", flush=True))


def pytest_sessionfinish() -> None:
    """Stop this test process's zygote server (:class:`tests._support.ranks.ZygoteServer`),
    if a test started it."""
    from tests._support.ranks import stop_zygote_server

    stop_zygote_server()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """How pytest-xdist shares the suite (``-n 2 --dist loadgroup``, the default options): the
    fault tests of several hosts or services (whole jobs with real failures, most of the
    suite's time) run one after another on one worker, never beside each other, while the
    other worker runs the rest a file at a time (a module's fixtures are made once), the
    one-host fault tests (``ONE_HOST_FAULTS``) included. Without xdist this does nothing."""
    for item in items:
        path = item.path.resolve()
        alone = FAULTS in path.parents and path.name not in ONE_HOST_FAULTS
        group = "faults" if alone else path.name
        item.add_marker(pytest.mark.xdist_group(group))


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


@pytest.fixture
def smp(run_dir: Path, run_id: str) -> Iterator[SmpProcess]:
    """A running SMP; stopped after the test, which then checks it left nothing behind."""
    with running_smp(run_dir, run_id) as proc:
        yield proc


@pytest.fixture
def launcher_env() -> Iterator[Launcher]:
    """A :class:`Launcher` in a short tmp dir; every process it started is gone afterwards."""
    tmp = short_dir()
    launcher = Launcher(tmp)
    try:
        yield launcher
    finally:
        launcher.cleanup()
        if not os.environ.get("FTMEM_TEST_KEEP"):  # keep the logs to read after a failure
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def cluster_factory(run_id: str) -> Iterator[Callable[..., Cluster]]:
    """Makes SMP meshes (``make(n, m, ranks_per_node=1, env=None, max_group=8)``); every SMP is stopped
    afterwards and none may leave shared memory behind."""
    made: list[Cluster] = []
    base = Path(tempfile.mkdtemp(prefix="ftx-", dir="/tmp"))

    def make(
        n: int,
        m: int,
        ranks_per_node: int = 1,
        env: dict[int, dict[str, str]] | None = None,
        max_group: int = 8,
    ) -> Cluster:
        c = Cluster(base, run_id, n, m, ranks_per_node, env, max_group)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
        assert shm_files(run_id) == [], "an SMP left shared memory behind"
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def two_hosts(tmp_path: Path, run_id: str) -> Iterator[list[Path]]:
    """Two SMPs of one run (nodes a and b: two hosts' memory); their run directories.
    Stopped afterwards, with nothing left behind."""
    smps: list[SmpProcess] = []
    try:
        for node in ("a", "b"):
            run_dir = tmp_path / node
            smps.append(
                start_smp(
                    run_dir=run_dir,
                    run_id=run_id,
                    node=node,
                    start_timeout=timedelta(seconds=60),
                    log_path=tmp_path / f"smp-{node}.log",
                )
            )
        yield [tmp_path / "a", tmp_path / "b"]
    finally:
        for smp in smps:
            smp.stop()
        assert shm_files(run_id) == []
