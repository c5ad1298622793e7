"""A pipeline-parallel tiny transformer (torch.distributed.pipelining, gloo, CPU) with ftmem
snapshots every step and CheckFree as the last resort for a lost stage.

Each rank is one stage: the first holds the token embedding and a block, the middle ones a
block, the last a block, the final norm and the head; a middle stage's block is named as every
other stage's (``blocks.0...``), so CheckFree can rebuild it from its neighbours
(``ftmem-launch --ftmem-checkfree``, docs/api.md). The task is learnable (each token is a
fixed function of the one before), so the loss falls fast and a rebuilt stage's effect on it
shows.

    ftmem-launch --nproc-per-node 4 examples/train_pipeline.py --steps 60
    ftmem-launch --nproc-per-node 4 examples/train_pipeline.py --steps 60 --in-process
    python examples/train_pipeline.py --no-ftmem      # one process per stage, torchrun-style

The last stage prints ``[rank R] step S loss L`` every step and every rank its digest at the
end; ``[rank R] resumed from step S`` after ``ftmem.load`` (``rebuilt by CheckFree`` if so).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention and an MLP)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(1)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """Stage ``index`` of ``count``: [embedding] + one block + [norm and head]."""

    def __init__(self, index: int, count: int, vocab: int, seq_len: int, d: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.ModuleList([Block(d, 2)])
        if self.last:
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos[: x.size(1)]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)) if self.last else x


def batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (the same on every rank): token t+1 = (3 * token t + 1) % vocab."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    first = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    seq = [first]
    for _ in range(args.seq_len):
        seq.append((3 * seq[-1] + 1) % args.vocab)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def digest(module: nn.Module) -> str:
    """sha256 over the stage's parameters, in name order."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(args: argparse.Namespace) -> int:
    """Run the pipeline; return the exit code."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=args.init_method,
        timeout=timedelta(seconds=args.pg_timeout),
        rank=rank,
        world_size=world,
    )
    torch.manual_seed(args.seed + rank)
    stage_mod = Stage(rank, world, args.vocab, args.seq_len, args.d_model)
    optimizer = torch.optim.AdamW(stage_mod.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    ftmem: Any = None
    state: dict[str, Any] = {"model": stage_mod, "optim": optimizer, "sched": scheduler}

    def steps_from(start: int) -> int:
        """Train from ``start`` to ``args.steps``; under --in-process, once per generation."""
        if ftmem is not None:
            how = " (rebuilt by CheckFree)" if state["checkfree"].rebuilt_at is not None else ""
            print(f"[rank {rank}] resumed from step {start}{how}", flush=True)
        # The stage and its schedule talk over the process group: built for each one.
        stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
        for step in range(start, args.steps):
            inputs, targets = batch(step, args)
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if stage_mod.first:
                schedule.step(inputs)
            elif stage_mod.last:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            if ftmem is not None:
                state["checkfree"].record_gradients()
            optimizer.step()
            scheduler.step()
            if ftmem is not None:
                ftmem.save(state, step=step + 1)
            if losses:
                loss = torch.stack(losses).mean().item()
                print(f"[rank {rank}] step {step + 1} loss {loss:.6f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
        return max(start, args.steps)

    if args.no_ftmem:
        steps_from(0)
    else:
        import ftmem

        state["checkfree"] = ftmem.CheckFreeStage(stage_mod, rank, world, optimizer, scheduler)
        if args.in_process:  # survivors of another rank's failure run steps_from again
            ftmem.run(steps_from, state, pg_timeout=timedelta(seconds=args.pg_timeout))
        else:
            steps_from(ftmem.load(state))
    print(f"[rank {rank}] digest {digest(stage_mod)}", flush=True)
    if ftmem is not None:
        ftmem.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def get_args_parser() -> argparse.ArgumentParser:
    """The example's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-ftmem", action="store_true", help="train without snapshots")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="gloo timeout (s)")
    p.add_argument("--init-method", default="env://")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="train under ftmem.run: ranks that survive another's failure keep their process",
    )
    return p


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    code = train(get_args_parser().parse_args())
    sys.stdout.flush()
    import gc

    gc.freeze()  # skip the last collection of torch's heap at exit
    sys.exit(code)
