"""A Hugging Face Trainer job with a snapshot every optimizer step: one changed line.

    ftmem-launch --standalone --nproc-per-node 2 examples/train_hf.py --steps 40

trains a tiny Llama (built from a config: nothing is downloaded) on random tokens with the
Trainer's DDP (gloo on CPU), using ``ftmem.integrations.transformers.FtmemTrainer`` where
``transformers.Trainer`` would be. Kill a rank (``--fail-at-step N --fail-rank R``: it
SIGKILLs itself once step N is committed) and ftmem-launch restarts the ranks, which resume
from memory at step N. ``--no-ftmem`` runs the plain Trainer (the failure-free reference).
Every rank prints ``[rank R] digest HEX`` of its parameters and optimizer state at the end.
Needs ``pip install 'ftmem[hf]'``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import signal
import sys
import tempfile
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences of random tokens (fixed seed): language-model inputs and labels."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def digest(model: torch.nn.Module, optimizer: Any) -> str:
    """sha256 of the parameters and the optimizer state, in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    inner = getattr(optimizer, "optimizer", optimizer)
    for i, st in sorted(inner.state_dict()["state"].items()):
        for key, value in sorted(st.items()):
            h.update(f"{i}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(
                    value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
    return h.hexdigest()


class FailOnce(TrainerCallback):
    """SIGKILL rank ``rank`` once every rank committed ``step`` to ftmem (not again after a
    resume): each waits for its commit, then all meet at a barrier."""

    def __init__(self, step: int, rank: int, trainer: Any) -> None:
        self.step, self.rank, self.trainer = step, rank, trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        me = int(os.environ.get("RANK", "0"))
        resumed = getattr(self.trainer, "ftmem_restored_step", 0)
        if state.global_step == self.step and resumed < self.step:
            import ftmem

            ftmem.wait(timeout=60.0)  # also commits the step if its snapshot was skipped
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            if me == self.rank:
                print(f"[rank {me}] injecting failure after step {self.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return control


def main(argv: list[str] | None = None) -> int:
    """Train; print the digest."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--fail-at-step", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--no-ftmem", action="store_true", help="the plain Trainer")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    # save_strategy="no": the Trainer writes nothing here. Under ftmem-launch it goes with the
    # run directory, so a rank killed mid-run leaves nothing in /tmp.
    out = tempfile.mkdtemp(prefix="ftmem-hf-out-", dir=os.environ.get("FTMEM_RUN_DIR"))
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    data = RandomTokens(n=64, seq_len=16, vocab=64)
    if args.no_ftmem:
        trainer: Trainer = Trainer(model=model, args=targs, train_dataset=data)
    else:
        from ftmem.integrations.transformers import FtmemTrainer

        trainer = FtmemTrainer(model=model, args=targs, train_dataset=data)
        if args.fail_at_step:
            trainer.add_callback(FailOnce(args.fail_at_step, args.fail_rank, trainer))
    try:
        metrics = trainer.train().metrics
    finally:
        shutil.rmtree(out, ignore_errors=True)
    resumed = getattr(trainer, "ftmem_restored_step", 0)
    print(f"[rank {rank}] train_runtime {metrics['train_runtime']:.3f} s", flush=True)
    print(f"[rank {rank}] resumed from step {resumed}", flush=True)
    print(f"[rank {rank}] final step {trainer.state.global_step}", flush=True)
    print(f"[rank {rank}] digest {digest(trainer.model, trainer.optimizer)}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's last garbage collection of torch's heap at exit: ~0.8 s of CPU
    # per rank here, for nothing (the process ends; nothing it would free is needed).
    gc.freeze()
    sys.exit(code)
