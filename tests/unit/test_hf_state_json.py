"""FtmemTrainer's snapshot of ``TrainerState`` keeps the log history it already encoded (it
was re-encoded whole every step: 75% of ``ftmem.save`` in a 400-step run) and still says
exactly what ``TrainerState`` says, whatever the Trainer does to the list."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from transformers import TrainerState

from ftmem.integrations.transformers import _state_json, _TrainerStateBox


def test_the_snapshot_json_is_the_states_through_appends_replacements_and_rebuilds() -> None:
    trainer = SimpleNamespace(state=TrainerState())
    box = _TrainerStateBox(trainer)  # type: ignore[arg-type]

    def same() -> None:
        assert json.loads(box.state_dict()["json"]) == json.loads(_state_json(trainer.state))

    same()
    for i in range(6):
        trainer.state.global_step = i
        trainer.state.log_history.append({"loss": 1.0 / (i + 1), "step": i})
        same()
    trainer.state.log_history[2] = {"loss": 0.0, "step": 2}  # replaced
    same()
    trainer.state.log_history = trainer.state.log_history[:3]  # rebuilt shorter
    same()
    trainer.state.log_history = []
    same()
