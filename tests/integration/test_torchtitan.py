"""ftmem's torchtitan checkpoint manager against the real torchtitan package, on CPU, at the
manager level: a small model in torchtitan's ``model_parts``, its real ``OptimizersContainer``
and ``LRSchedulersContainer`` (built by their configs), its ``ParallelAwareDataloader`` over a
stateful dataset and a ``train_state``, a real SMP and a 1-rank gloo group.

- a snapshot every step, restored into fresh objects by a fresh manager: every key torchtitan
  checkpoints comes back bitwise at the last snapshotted step (a step taken after it waited at
  the fence), and the memory step wins over an older DCP checkpoint in the folder;
- nothing in memory: the parent's DCP load (and a fresh start, nothing loaded, at step 0);
  torchtitan's folder newer than memory: the DCP load;
- ``enable=False``: memory snapshots still happen, no DCP checkpoint is written.

torchtitan cannot train on CPU end to end (its trainer needs CUDA): an end-to-end run needs a
GPU machine and is not part of this suite. CI installs torchtitan (.ci/run): these tests do
not skip there.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

import ftmem
from ftmem.config import ENV_RUN_DIR, ENV_RUN_ID
from ftmem.smp.spawn import SmpProcess
from tests._support.launcher import free_port

pytest.importorskip("torchtitan", reason="pip install torchtitan (.ci/run installs it)")

from torchtitan.components.checkpointer import (
    BaseCheckpointManager,
    CheckpointManager,
)
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from ftmem.integrations.torchtitan import FtmemCheckpointManager

pytestmark = pytest.mark.timeout(120)


class Tokens(IterableDataset[torch.Tensor]):
    """An endless stream of rows of a seeded sequence; its position is its state."""

    def __init__(self) -> None:
        self.pos = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            g = torch.Generator().manual_seed(self.pos)
            self.pos += 1
            yield torch.randn(8, generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = int(sd["pos"])


class TrainState:
    """The trainer's own checkpointed state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


class Job:
    """What torchtitan's trainer builds and hands to its checkpoint manager."""

    def __init__(self, seed: int, config: BaseCheckpointManager.Config, folder: Path) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        optimizer = default_adamw(lr=1e-2)
        optimizer.implementation = "for-loop"  # "fused" is CUDA's
        self.optimizers = optimizer.build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=10
        )
        self.dataloader = ParallelAwareDataloader(
            Tokens(), dp_rank=0, dp_world_size=1, batch_size=4
        )
        self.train_state = TrainState()
        self.checkpointer = config.build(  # as torchtitan's Trainer builds it
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
            base_folder=str(folder),
        )
        self._batches: Iterator[torch.Tensor] | None = None
        self.last_batch: torch.Tensor | None = None

    def load(self) -> bool:
        """torchtitan's start: load, then iterate the data loader."""
        loaded = bool(self.checkpointer.load())
        self._batches = None
        return loaded

    def next_batch(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.dataloader)
        return next(self._batches)

    def train(self, steps: int, save: bool = True) -> None:
        """torchtitan's loop: step, then ``checkpointer.save(step)``."""
        for _ in range(steps):
            self.train_state.step += 1
            batch = self.last_batch = self.next_batch()
            self.model(batch).square().mean().backward()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.ntokens_seen += batch.numel()
            if save:
                self.checkpointer.save(self.train_state.step)

    def state(self) -> dict[str, Any]:
        """Every key torchtitan checkpoints, as values to compare (tensors cloned)."""
        clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
        return {
            "model": {k: clone(v) for k, v in self.model.state_dict().items()},
            "optimizer": {k: clone(v) for k, v in self.optimizers.state_dict().items()},
            "lr": [g["lr"] for g in self.optimizers.optimizers[0].param_groups],
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "last_lr": [s.get_last_lr() for s in self.lr_schedulers],
            "dataloader": pickle.loads(self.dataloader.state_dict()["dp_rank_0"]),
            "train_state": self.train_state.state_dict(),
        }


def assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key in ("model", "optimizer"):
            assert a[key].keys() == b[key].keys(), key
            for name in a[key]:
                x, y = a[key][name], b[key][name]
                same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                assert same, f"{key}[{name}] differs"
        else:
            assert a[key] == b[key], key


@pytest.fixture
def env(
    smp: SmpProcess, run_dir: Path, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A 1-rank gloo group (torchtitan's managers ask for the rank) and the SMP's address
    for ``ftmem.save``/``ftmem.load``; ftmem's default checkpointer is closed afterwards."""
    monkeypatch.setenv(ENV_RUN_DIR, str(run_dir))
    monkeypatch.setenv(ENV_RUN_ID, run_id)
    monkeypatch.delenv("FTMEM_FLUSH_DIRS", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    ftmem.close()  # a default checkpointer left by another test would talk to its SMP
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        ftmem.close()
        dist.destroy_process_group()


def ftmem_config(**kw: Any) -> FtmemCheckpointManager.Config:
    return FtmemCheckpointManager.Config(enable=True, keep_latest_k=0, **kw)


def restart() -> None:
    """As a new process: ftmem's default checkpointer goes (the SMP keeps the snapshots)."""
    assert ftmem.wait(60)
    ftmem.close()


def test_the_config_selects_the_manager() -> None:
    config = ftmem_config(interval=3)
    # Trainer.Config's checkpoint field is a BaseCheckpointManager.Config; build() makes the
    # class the Config is declared in.
    assert isinstance(config, BaseCheckpointManager.Config)
    assert isinstance(config, CheckpointManager.Config)
    assert FtmemCheckpointManager.Config._owner is FtmemCheckpointManager
    assert config.interval == 3 and config.async_mode == "disabled"


def test_every_step_in_memory_restored_bitwise(env: None, tmp_path: Path) -> None:
    job = Job(0, ftmem_config(interval=3), tmp_path)
    assert isinstance(job.checkpointer, FtmemCheckpointManager)
    assert job.load() is False  # nothing anywhere: a fresh start
    job.train(4)
    assert ftmem.wait(60)  # the slots exist: the next save copies in the background
    job.train(1)
    expect = job.state()
    job.train(1, save=False)  # its optimizer step waits at the fence for step 5's copy
    after = job.last_batch
    assert (tmp_path / "checkpoint" / "step-3" / ".metadata").is_file()  # DCP at its interval
    assert not (tmp_path / "checkpoint" / "step-5").exists()
    restart()

    other = Job(1, ftmem_config(interval=3), tmp_path)
    other.train(1, save=False)  # optimizer state exists but differs
    assert other.load() is True
    assert other.checkpointer.ftmem_restored_step == 5  # not the DCP step 3
    assert other.train_state.step == 5
    assert_equal(other.state(), expect)
    assert torch.equal(other.next_batch(), after)  # the data position
    # Training goes on from there, and the next snapshot is the next step.
    other.train(1)
    assert ftmem.wait(60)
    assert ftmem.stats()["last_step"] == 6


def test_nothing_in_memory_falls_back_to_dcp(env: None, tmp_path: Path) -> None:
    fresh = Job(0, ftmem_config(interval=2), tmp_path)
    before = fresh.state()
    assert fresh.load() is False  # step 0: nothing loaded, nothing changed
    assert_equal(fresh.state(), before)

    # A DCP checkpoint written by torchtitan's own manager (memory lost: another SMP).
    job = Job(0, CheckpointManager.Config(enable=True, keep_latest_k=0, interval=2), tmp_path)
    job.train(4)
    expect = job.state()

    other = Job(1, ftmem_config(interval=2), tmp_path)
    other.train(1, save=False)
    assert other.load() is True
    assert other.checkpointer.ftmem_restored_step == 0
    assert other.train_state.step == 4
    assert_equal(other.state(), expect)


def test_a_newer_dcp_checkpoint_wins_over_memory(env: None, tmp_path: Path) -> None:
    job = Job(0, ftmem_config(interval=100), tmp_path)
    job.train(2)  # memory holds step 2, no DCP checkpoint
    restart()
    plain = CheckpointManager.Config(enable=True, keep_latest_k=0, interval=4)
    job.checkpointer = plain.build(
        dataloader=job.dataloader,
        model_parts=[job.model],
        optimizers=job.optimizers,
        lr_schedulers=job.lr_schedulers,
        states={"train_state": job.train_state},
        sd_adapter=None,
        base_folder=str(tmp_path),
    )
    job.train(2)  # DCP step 4, not in memory
    expect = job.state()

    other = Job(1, ftmem_config(interval=100), tmp_path)
    assert other.load() is True
    assert other.checkpointer.ftmem_restored_step == 0
    assert other.train_state.step == 4
    assert_equal(other.state(), expect)


def test_disabled_dcp_still_snapshots(env: None, tmp_path: Path) -> None:
    config = FtmemCheckpointManager.Config(enable=False, interval=1)
    job = Job(0, config, tmp_path)
    job.train(3)
    expect = job.state()
    restart()
    assert not (tmp_path / "checkpoint").exists()

    other = Job(1, FtmemCheckpointManager.Config(enable=False), tmp_path)
    assert other.load() is True
    assert other.train_state.step == 3
    assert_equal(other.state(), expect)
