"""The pitfalls of real training loops produce their warning, once, with the fix: a DDP built
with find_unused_parameters=False on 3+ ranks, a DataLoader without its own generator, a state
without an optimizer (real objects; the DDP is a real one over a 1-rank gloo group, checked
as if the world had 3 ranks; then for real in a launched 3-rank job), and shared memory too
small for the slots (a real SMP)."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from ftmem.client import pitfalls
from ftmem.errors import FtmemError
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess
from tests._support.launcher import TINY, WORKLOAD, Launcher, free_port


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    saved = set(pitfalls._warned)
    pitfalls._warned.clear()
    yield
    pitfalls._warned.clear()
    pitfalls._warned.update(saved)


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _pitfalls(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("PITFALL")]


def test_ddp_without_find_unused_parameters_on_three_ranks(
    fresh_warnings: None, one_rank_group: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ftmem.client")
    model = torch.nn.Linear(4, 4)
    state = {"model": model}
    ddp = DistributedDataParallel(model)
    pitfalls.check_ddp(state, world_size=2)  # 2 ranks: the order of a sum of two is fixed
    assert _pitfalls(caplog) == []
    pitfalls.check_ddp(state, world_size=3)
    pitfalls.check_ddp({"wrapped": ddp}, world_size=3)  # once only
    (msg,) = _pitfalls(caplog)
    assert "find_unused_parameters=False on 3 ranks" in msg
    assert "find_unused_parameters=True" in msg
    pitfalls._warned.clear()
    caplog.clear()
    safe = torch.nn.Linear(4, 4)
    kept = DistributedDataParallel(safe, find_unused_parameters=True)
    pitfalls.check_ddp({"model": safe}, world_size=4)
    assert _pitfalls(caplog) == [] and kept.module is safe
    # Found also once the DDP's __dict__ exists as a dict of its own (vars() makes it).
    pitfalls._warned.clear()
    other = torch.nn.Linear(4, 4)
    wrapper = DistributedDataParallel(other)
    assert vars(wrapper)["_modules"]["module"] is other
    pitfalls.check_ddp({"model": other}, world_size=3)
    assert len(_pitfalls(caplog)) == 1


def test_loader_without_generator_and_state_without_optimizer(
    fresh_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ftmem.client")
    data = TensorDataset(torch.arange(8.0))
    seeded = DataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(0))
    pitfalls.check_loaders({"nested": {"loader": seeded}})
    assert _pitfalls(caplog) == []
    pitfalls.check_loaders({"nested": {"loader": DataLoader(data, shuffle=True)}})
    (msg,) = _pitfalls(caplog)
    assert "no generator of its own" in msg and "generator=torch.Generator()" in msg
    caplog.clear()
    pitfalls.check_optimizer(True)
    assert _pitfalls(caplog) == []
    pitfalls.check_optimizer(False)
    pitfalls.check_optimizer(False)
    (msg,) = _pitfalls(caplog)
    assert "holds no torch.optim.Optimizer" in msg and "ftmem.wait()" in msg


def test_shared_memory_too_small_is_refused_with_how_to_size_it(
    run_dir: Path, smp: SmpProcess
) -> None:
    free = shutil.disk_usage("/dev/shm").free
    too_much = min(free + (64 << 30), (1 << 40) - (1 << 20))
    with SmpClient(run_dir, timeout=timedelta(seconds=30)) as client:
        with pytest.raises(FtmemError) as info:
            client.request(m.Prepare(rank=0, slot=-1, nbytes=too_much))
        text = str(info.value)
        assert "not enough shared memory" in text
        assert "--shm-size=" in text and "medium: Memory" in text and "sizeLimit" in text
        # nothing was allocated, and the SMP still serves
        client.request(m.Prepare(rank=0, slot=-1, nbytes=1 << 20))
    log = (run_dir / "smp.log").read_text()
    assert log.count("NOT ENOUGH SHARED MEMORY") == 1


def test_ddp_pitfall_is_warned_once_per_rank_in_a_launched_three_rank_job(
    launcher_env: Launcher,
) -> None:
    # The real thing: 3 ranks under ftmem-launch, DDP with find_unused_parameters=False.
    script = [str(WORKLOAD), "--steps", "2", *TINY, "--ddp-find-unused", "false"]
    agent = launcher_env.single_node(launcher_env.new_run_id(), 3, [], script)
    assert agent.wait(180) == 0, agent.text()[-3000:]
    warned = re.findall(
        r"\[default(\d)\]:.*PITFALL: DistributedDataParallel with find_unused_parameters=False "
        r"on 3 ranks.*find_unused_parameters=True",
        agent.text(),
    )
    assert sorted(warned) == ["0", "1", "2"], agent.text()[-3000:]
