"""A Lightning job with a snapshot every optimizer step: one added callback.

    ftmem-launch --standalone --nproc-per-node 2 examples/train_lightning.py --steps 40

trains a small MLP with dropout on random data (fixed seeds: nothing is downloaded) with
Lightning's DDP (gloo on CPU), ``Trainer(callbacks=[FtmemCallback()])``. An epoch is 8
optimizer steps, so a run spans several epochs. Kill a rank (``--fail-at-step N --fail-rank
R``: it SIGKILLs itself once step N is committed; ``N,M``: twice) and ftmem-launch restarts
the ranks, which resume from memory at step N, mid-epoch (or at an epoch's end: N=8). ``--no-ftmem`` runs without the callback (the
failure-free reference). Every rank prints ``[rank R] digest HEX`` of its parameters and
optimizer state at the end. Needs ``pip install 'ftmem[lightning]'``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import signal
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


class Regressor(pl.LightningModule):
    """An MLP with dropout (so the RNG matters), AdamW and a per-step LR schedule."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, width),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(width, 1),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class NoisyPairs(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(x + noise, y): the noise is an augmentation drawn from the process's (or the loader
    worker's) torch RNG, so a resume must give the workers the seeds they had."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.01 * torch.randn(self.x.shape[1:]), self.y[i]


def digest(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> str:
    """sha256 of the parameters and the optimizer state, in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for opt in optimizers:
        for i, st in sorted(opt.state_dict()["state"].items()):
            for key, value in sorted(st.items()):
                h.update(f"{i}.{key}".encode())
                if isinstance(value, torch.Tensor):
                    h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class FailOnce(pl.Callback):
    """SIGKILL rank ``rank`` once every rank committed each of ``steps`` to ftmem (not again
    after the resume from it): each waits for its commit, then all meet at a barrier."""

    def __init__(self, steps: list[int], rank: int, ftmem_cb: Any) -> None:
        self.steps, self.rank, self.ftmem_cb = steps, rank, ftmem_cb

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        me, step = trainer.global_rank, trainer.global_step
        if step in self.steps and self.ftmem_cb.restored_step < step:
            import ftmem

            ftmem.wait(timeout=60.0)  # also commits the step if its snapshot was skipped
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            if me == self.rank:
                print(f"[rank {me}] injecting failure after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


class TrainTime(pl.Callback):
    """Seconds from the first training batch to the end of training (what a snapshot every
    step adds to, without the start-up)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, *args: Any) -> None:
        if self.start is not None:
            self.seconds = time.perf_counter() - self.start


def main(argv: list[str] | None = None) -> int:
    """Train; print the digest."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    p.add_argument("--fail-at-step", default="", help="steps to fail at, comma-separated")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--no-ftmem", action="store_true", help="without the callback")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8 * 8 * args.grad_accum * 2, 16, generator=g)  # 8 steps per epoch, 2 ranks
    y = x.sum(dim=1, keepdim=True).sin()
    loader = DataLoader(
        NoisyPairs(x, y),
        batch_size=8,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=False,
    )
    callbacks: list[pl.Callback] = []
    ftmem_cb = None
    if not args.no_ftmem:
        from ftmem.integrations.lightning import FtmemCallback

        ftmem_cb = FtmemCallback()
        callbacks.append(ftmem_cb)
        if args.fail_at_step:
            steps = [int(s) for s in args.fail_at_step.split(",")]
            callbacks.append(FailOnce(steps, args.fail_rank, ftmem_cb))
    timer = TrainTime()
    callbacks.append(timer)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local
    model = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=local,
        num_nodes=nodes,
        strategy="ddp" if local * nodes > 1 else "auto",
        max_steps=args.steps,
        max_epochs=-1,
        accumulate_grad_batches=args.grad_accum,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    trainer.fit(model, train_dataloaders=loader)
    rank = trainer.global_rank
    resumed = ftmem_cb.restored_step if ftmem_cb is not None else 0
    print(f"[rank {rank}] resumed from step {resumed}", flush=True)
    print(f"[rank {rank}] train_runtime {timer.seconds:.3f} s", flush=True)
    print(f"[rank {rank}] final step {trainer.global_step}", flush=True)
    print(f"[rank {rank}] digest {digest(model, trainer.optimizers)}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's last garbage collection of torch's heap at exit: ~0.8 s of CPU
    # per rank here, for nothing (the process ends; nothing it would free is needed).
    gc.freeze()
    sys.exit(code)
