"""torchtitan's checkpoint manager with a snapshot every step and a resume from memory.

Select it in the job's config (torchtitan builds the manager from the config's class, so no
torchtitan line changes) and launch with ``ftmem-launch`` (same flags as ``torchrun``)::

    from ftmem.integrations.torchtitan import FtmemCheckpointManager

    def llama3_8b_ftmem() -> Trainer.Config:
        config = llama3_8b()
        config.checkpoint = FtmemCheckpointManager.Config(enable=True, interval=500)
        return config

``save`` snapshots torchtitan's checkpoint states every step, then runs torchtitan's own DCP
save at its interval; ``load`` restores the newest step ftmem holds and skips the DCP load,
unless ftmem holds nothing, the checkpoint folder holds a newer step, or ``load_step`` is given.
``enable`` governs the DCP checkpoints only; ``load_only=True`` turns the snapshots off too.
No RNG states are saved (as with torchtitan's own resume). See docs/integrations.md,
"torchtitan".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpointer import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    CheckpointManager,
    ModelWrapper,
)

import ftmem
from ftmem.integrations import require_version

log = logging.getLogger(__name__)


class FtmemCheckpointManager(CheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's DCP ``CheckpointManager`` that also snapshots every step into the node's
    SMP and resumes from memory first (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):  # type: ignore[misc]
        """``CheckpointManager.Config`` unchanged; declared so that ``build()`` makes an
        :class:`FtmemCheckpointManager` (torchtitan builds the class the Config is nested in).
        ``enable`` and ``interval`` govern the DCP checkpoints, not the memory snapshots."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        require_version("torchtitan", (0, 3), "FtmemCheckpointManager", "torchtitan")
        super().__init__(
            config,
            dataloader=dataloader,
            model_parts=model_parts,
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            sd_adapter=sd_adapter,
            base_folder=base_folder,
        )
        if not self.enable:  # the parent returned before building its states: the same ones
            self.states = states
            self.states.update(
                {
                    MODEL: ModelWrapper(model_parts),
                    OPTIMIZER: optimizers,
                    DATALOADER: dataloader,
                    LR_SCHEDULER: lr_schedulers,
                }
            )
        self._ftmem_saves = not config.load_only
        self.ftmem_restored_step = 0
        """The step ``load()`` restored from ftmem (0: none)."""

    def ftmem_state(self) -> dict[str, Any]:
        """What is snapshotted: torchtitan's checkpoint states (``model``, ``optimizer``,
        ``lr_scheduler``, ``dataloader``, ``train_state`` and any other the trainer passed),
        without the ones that are ``None`` (a job without a data loader)."""
        states: dict[str, Any] = self.states
        return {k: v for k, v in states.items() if v is not None}

    def load(self, step: int = -1) -> bool:
        """Restore the newest step ftmem holds; else (or when torchtitan's checkpoint folder
        holds a newer step, or ``step`` names one) the parent's DCP load. Returns whether
        anything was loaded."""
        if step != -1:
            log.info("checkpoint.load_step=%d given: loading it from DCP, not from memory", step)
            return bool(super().load(step))
        restored = ftmem.load(self.ftmem_state())
        self.ftmem_restored_step = restored
        if restored == 0:
            log.info("nothing in ftmem to resume from: torchtitan's checkpoints are read")
            return bool(super().load(step))
        on_disk = self._find_load_step() if self.enable else -1
        if on_disk > restored:
            log.warning(
                "ftmem restored step %d but %s holds step %d: loading that one",
                restored,
                self.folder,
                on_disk,
            )
            self.ftmem_restored_step = 0
            return bool(super().load(step))
        log.info("resumed from ftmem at step %d", restored)
        return True

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot ``curr_step`` into ftmem (returns at once), then the parent's DCP save at
        its interval. At the last step, waits for the snapshot's commit (at most 120 s).
        Returns whether a DCP checkpoint was written."""
        if self._ftmem_saves and curr_step > 0:
            ftmem.save(self.ftmem_state(), step=curr_step)
        saved = bool(super().save(curr_step, last_step))
        if self._ftmem_saves and last_step and curr_step > 0:
            ftmem.wait(timeout=120.0)
        return saved
