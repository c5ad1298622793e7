"""Lightning with a snapshot every optimizer step and a mid-epoch resume from memory.

Add the callback and launch with ``ftmem-launch`` (same flags as ``torchrun``)::

    from ftmem.integrations.lightning import FtmemCallback
    trainer = lightning.Trainer(..., callbacks=[FtmemCallback()])
    trainer.fit(model, datamodule=dm)

After every optimizer step it saves the LightningModule, the optimizers and LR schedulers,
Lightning's own state (fit loop, callbacks, datamodule, precision plugin) and the RNG states;
at ``fit()`` it restores the newest step every rank holds and Lightning goes on as from its own
mid-epoch checkpoint. A loader Lightning cannot resume is re-iterated as the run without the
failure iterated it and the batches already trained on are skipped (through Lightning's
private ``fit_loop._data_fetcher``, in :func:`_skip_batches` only); the snapshot's RNG states
are set after that. ``fit(ckpt_path=PATH)`` resumes Lightning's way, without memory. What is
covered and tested: docs/integrations.md, "Lightning".
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful

import ftmem
from ftmem.client.rng import DeferredRNGState
from ftmem.integrations import require_version

log = logging.getLogger(__name__)

_LIGHTNING_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
"""Lightning's warning about a mid-epoch resume of a loader it cannot resume (this callback
resumes it)."""


class _TrainerStateBox:
    """Lightning's own state beside the tensors: the fit loop's progress, the callbacks', the
    datamodule's and the precision plugin's state, and the torch RNG at the epoch's start.
    A restore keeps it for :meth:`FtmemCallback.on_fit_start` to apply."""

    def __init__(self, callback: FtmemCallback) -> None:
        self.callback = callback
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        trainer: Any = self.callback.trainer  # lightning's properties are untyped for mypy
        assert trainer is not None
        sd: dict[str, Any] = {
            "fit_loop": trainer.fit_loop.state_dict(),
            "callbacks": {
                cb.state_key: cb.state_dict()
                for cb in trainer.callbacks
                if not isinstance(cb, FtmemCallback) and cb.state_dict()
            },
            "precision": trainer.precision_plugin.state_dict(),
            "epoch_rng": self.callback.epoch_rng,
        }
        if trainer.datamodule is not None:
            sd["datamodule"] = trainer.datamodule.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.restored = dict(sd)


class FtmemCallback(pl.Callback):
    """Snapshots the whole training state into the node's SMP after every optimizer step and
    resumes from the newest one at ``fit()`` (see the module docstring)."""

    def __init__(self) -> None:
        require_version("lightning", (2, 6), "FtmemCallback", "lightning")
        self.trainer: pl.Trainer | None = None
        self.restored_step = 0
        """The step ``fit()`` resumed from (0: none)."""
        self.epoch_rng: torch.Tensor = torch.get_rng_state()
        """The torch CPU RNG state when the current epoch's data iterator was created."""
        self._box = _TrainerStateBox(self)
        self._rng = DeferredRNGState()
        self._saved_step = -1
        self._resume_data = False

    def ftmem_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """What is snapshotted: the module, optimizers, LR schedulers, Lightning's own state
        (loops, callbacks, datamodule, precision plugin) and the RNG states."""
        state: dict[str, Any] = {"model": pl_module}
        for i, optimizer in enumerate(trainer.optimizers):
            state[f"optim.{i}"] = optimizer
        for i, config in enumerate(trainer.lr_scheduler_configs):
            state[f"sched.{i}"] = config.scheduler
        state["lightning"] = self._box
        state["rng"] = self._rng
        return state

    # -- resume --------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        if trainer.ckpt_path is not None:
            log.info(
                "fit(ckpt_path=%s) given: resuming from it, not from memory", trainer.ckpt_path
            )
            return
        step = ftmem.load(self.ftmem_state(trainer, pl_module))
        self.restored_step = self._saved_step = step
        restored, self._box.restored = self._box.restored, None
        if step == 0 or restored is None:
            return
        trainer.fit_loop.load_state_dict(restored["fit_loop"])
        for cb in trainer.callbacks:
            cb_state = restored["callbacks"].get(cb.state_key)
            if cb_state and not isinstance(cb, FtmemCallback):
                cb.load_state_dict(cb_state)
        if restored["precision"]:
            trainer.precision_plugin.load_state_dict(restored["precision"])
        if trainer.datamodule is not None and restored.get("datamodule"):
            trainer.datamodule.load_state_dict(restored["datamodule"])
        self.epoch_rng = restored["epoch_rng"]
        self._resume_data = True
        log.info("resumed from memory at step %d", step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the fit loop created the epoch's data iterator, before its first batch.
        if self._resume_data:
            self._resume_data = False
            self.epoch_rng = _skip_batches(trainer, self.epoch_rng, self._rng)
        self._rng.apply()  # the snapshot's RNG states, unless _skip_batches applied them

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # For every epoch after the first, Lightning creates the data iterator right after
        # this hook, drawing its seed from the global torch RNG: keep the state it draws from.
        self.epoch_rng = torch.get_rng_state()

    # -- snapshot ------------------------------------------------------------------------
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step > self._saved_step:
            ftmem.save(self.ftmem_state(trainer, pl_module), step=step)
            self._saved_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ftmem.wait(timeout=120.0)


def _skip_batches(
    trainer: pl.Trainer, epoch_rng: torch.Tensor, rng: DeferredRNGState
) -> torch.Tensor:
    """Bring the restored epoch's data iterator to where the run without the failure was.

    Lightning restores a resumable loader's position itself. For the others: in an epoch
    after the first, the iterator is created again from the global RNG state the original
    one drew its seed from (``epoch_rng`` mid-epoch; when the snapshot closed the previous
    epoch, the snapshot's own states ``rng``, applied here); then the batches already
    trained on in this epoch are drawn and dropped, the sampler's epoch set first as
    Lightning sets it. Returns the global torch RNG state at the start of the epoch now
    running (what later snapshots record as ``epoch_rng``)."""
    loop: Any = trainer.fit_loop
    combined = loop._combined_loader
    fetcher = loop._data_fetcher
    if combined is None or fetcher is None:
        return epoch_rng
    epoch = loop.epoch_progress.current.processed
    done = loop.epoch_loop.batch_progress.current.processed
    if done >= trainer.num_training_batches:
        done = 0  # the snapshot closed the epoch: the next one starts from its beginning
    if all(isinstance(dl, _Stateful) for dl in combined.flattened):
        return epoch_rng
    if done > 0 and not isinstance(trainer.num_training_batches, int):
        warnings.warn(
            "ftmem: the train loader has no length and cannot be resumed (no state_dict): "
            f"the resumed epoch starts from its beginning, not at batch {done}",
            stacklevel=2,
        )
        return epoch_rng
    for dl in combined.flattened:
        _set_sampler_epoch(dl, epoch)  # before iter(): workers take indices at once
    if epoch > 0:  # the original iterator drew its seed from the global torch RNG
        if done > 0:
            torch.set_rng_state(epoch_rng)
        else:
            rng.apply()
            # Lightning calls no on_train_epoch_start for this epoch: its start is now.
            epoch_rng = torch.get_rng_state()
        iter(fetcher)  # a new iterator, seeded as the original one was
    iterator = fetcher.iterator
    assert iterator is not None
    for _ in range(done):
        next(iterator)
    if done:
        warnings.filterwarnings("ignore", message=_LIGHTNING_WARNING)
        log.info("skipped the %d batches of epoch %d already trained on", done, epoch)
    return epoch_rng
