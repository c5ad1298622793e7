"""The Hugging Face ``Trainer`` with a snapshot every optimizer step and resumes from memory.

Use :class:`FtmemTrainer` in place of ``transformers.Trainer`` and launch with ``ftmem-launch``
(same flags as ``torchrun``)::

    from ftmem.integrations.transformers import FtmemTrainer
    trainer = FtmemTrainer(model=model, args=args, train_dataset=data)
    trainer.train()

Every optimizer step (``on_step_end``) saves the model, optimizer, LR scheduler,
``TrainerState`` (its JSON) and RNG states; ``train()`` restores the newest step every rank
holds, and the Trainer resumes as from its own checkpoint (skipping the batches already taken,
then setting the snapshot's RNG states). ``train(resume_from_checkpoint=PATH)`` resumes the
Trainer's own way, without memory. See docs/integrations.md, "Hugging Face Trainer".

How it hooks in: the Trainer resumes only through a checkpoint directory, so ``train()`` passes
a private directory holding a fresh ``trainer_state.json`` (removed afterwards);
``_init_training_state`` creates the optimizer and scheduler early, restores the snapshot and
returns where to resume; the Trainer's loaders of that directory do nothing but apply the
snapshot's RNG states.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import TrainerState

import ftmem
from ftmem.client.rng import DeferredRNGState
from ftmem.config import ENV_RUN_DIR
from ftmem.errors import FtmemError

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"


def _state_json(state: TrainerState) -> str:
    """``TrainerState`` as the JSON its ``save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


class _TrainerStateBox:
    """The Trainer's ``TrainerState`` as a Stateful (its JSON: no pickled objects).

    ``log_history`` grows by an entry per logged step: re-encoding it whole every save would
    cost time quadratic in the run's length. Entries already encoded are kept as JSON while
    the list still starts with the very same entry objects (the Trainer appends; an entry
    changed in place is not seen, which only the log would show).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.restored: str | None = None
        self._entries: list[Any] = []
        self._encoded: list[str] = []

    def _history_json(self, history: list[Any]) -> str:
        n = len(self._entries)
        if n > len(history) or any(
            a is not b for a, b in zip(self._entries, history, strict=False)
        ):
            self._entries, self._encoded, n = [], [], 0
        for entry in history[n:]:
            self._entries.append(entry)
            self._encoded.append(json.dumps(entry, sort_keys=True))
        return "[" + ", ".join(self._encoded) + "]"

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
        history = fields.pop("log_history")
        try:  # json copies what it encodes: no deep copy first (dataclasses.asdict's)
            head = json.dumps(fields, sort_keys=True)
        except TypeError:  # a dataclass inside (none of TrainerState's own fields holds one)
            fields = dataclasses.asdict(state)
            del fields["log_history"]
            head = json.dumps(fields, sort_keys=True)
        return {"json": f'{head[:-1]}, "log_history": {self._history_json(history)}}}'}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.restored = str(sd["json"])


class FtmemCallback(TrainerCallback):
    """Snapshots the trainer's state into the node's SMP at the end of every optimizer step."""

    def __init__(self, trainer: FtmemTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> Any:
        ftmem.save(self.trainer.ftmem_state(), step=state.global_step)
        return control

    def on_train_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> Any:
        ftmem.wait(timeout=120.0)
        return control


class FtmemTrainer(Trainer):
    """``transformers.Trainer`` that snapshots every optimizer step into ftmem and resumes from
    memory at ``train()`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not hasattr(Trainer, "_init_training_state"):
            raise FtmemError(
                "FtmemTrainer needs transformers >= 5.24 (its Trainer._init_training_state); "
                "pip install 'ftmem[hf]'"
            )
        super().__init__(*args, **kwargs)
        self._ftmem_box = _TrainerStateBox(self)
        self._ftmem_rng = DeferredRNGState()
        self._ftmem_dir: str | None = None
        self.ftmem_restored_step = 0
        """The step ``train()`` resumed from memory (0: none)."""
        self.add_callback(FtmemCallback(self))

    def ftmem_state(self) -> dict[str, Any]:
        """What is snapshotted: model, optimizer, scheduler, TrainerState, RNG states."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        state: dict[str, Any] = {"model": self.model, "trainer": self._ftmem_box}
        if optimizer is not None:
            state["optim"] = optimizer
        if self.lr_scheduler is not None:
            state["sched"] = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        state["rng"] = self._ftmem_rng
        return state

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """``Trainer.train``, resumed from the newest step in memory when there is one."""
        kwargs: dict[str, Any] = {"trial": trial, "ignore_keys_for_eval": ignore_keys_for_eval}
        if resume_from_checkpoint is not None:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        # In the launcher's run directory (removed with it) when there is one: a rank killed
        # mid-run skips the ``finally`` below and would leave the directory in /tmp.
        self._ftmem_dir = tempfile.mkdtemp(prefix="ftmem-hf-", dir=os.environ.get(ENV_RUN_DIR))
        try:
            fresh = TrainerState()  # what the Trainer checks against its arguments
            fresh.train_batch_size = self._train_batch_size
            fresh.compute_steps(self.args, max(self.args.max_steps, 1))  # type: ignore[no-untyped-call]
            with open(os.path.join(self._ftmem_dir, TRAINER_STATE_NAME), "w") as f:
                f.write(_state_json(fresh))
            return super().train(resume_from_checkpoint=self._ftmem_dir, **kwargs)
        finally:
            shutil.rmtree(self._ftmem_dir, ignore_errors=True)
            self._ftmem_dir = None

    def _from_memory(self, checkpoint: Any) -> bool:
        return checkpoint is not None and checkpoint == self._ftmem_dir

    # -- the Trainer's resume, from memory --------------------------------------------------
    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: Any,
        trial: Any,
    ) -> tuple[int, int]:
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if not self._from_memory(resume_from_checkpoint):
            return int(epochs), int(steps)
        # The optimizer and scheduler exist before the restore (the Trainer keeps them: it
        # creates an optimizer only if there is none, and a scheduler it did not create).
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self._created_lr_scheduler = False
        step = ftmem.load(self.ftmem_state())
        self.ftmem_restored_step = step
        if step == 0 or self._ftmem_box.restored is None:
            return 0, 0
        restored = TrainerState(**json.loads(self._ftmem_box.restored))
        self.state = restored
        self._load_callback_state()
        self.state.init_training_references(  # type: ignore[no-untyped-call]
            self, max_steps, num_train_epochs, trial
        )
        epochs = restored.global_step // num_update_steps_per_epoch
        steps = 0
        if not self.args.ignore_data_skip:
            steps = restored.global_step % num_update_steps_per_epoch
            steps *= self.args.gradient_accumulation_steps
        log.info(
            "resumed from memory at step %d (epoch %d, %d batches into it)", step, epochs, steps
        )
        return int(epochs), int(steps)

    def _load_from_checkpoint(self, resume_from_checkpoint: Any, model: Any = None) -> None:
        if not self._from_memory(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if not self._from_memory(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: Any) -> None:
        if not self._from_memory(checkpoint):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: Any) -> None:
        if not self._from_memory(checkpoint):
            super()._load_rng_state(checkpoint)
        else:
            self._ftmem_rng.apply()
