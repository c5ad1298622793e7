"""The example (examples/train_gpt.py) loaded as a module, and a fresh model and optimizer of
the size the export tests train, to load a checkpoint into (also from a subprocess)."""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any

import torch

from tests._support.procs import EXAMPLE

MODEL_ARGS = dict(vocab=128, seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.1)


def example() -> ModuleType:
    """examples/train_gpt.py, imported from its file."""
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fresh_state(
    ex: ModuleType,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A new model and AdamW with state tensors to load into (values differ from the run's)."""
    torch.manual_seed(123)
    model = ex.GPT(batchnorm=False, **MODEL_ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg, exp_avg_sq, step
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict()}
