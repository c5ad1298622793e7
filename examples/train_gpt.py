"""Train a small GPT on synthetic tokens with DDP, snapshotting the whole state every step.

The loop calls ``ftmem.load(state)`` once and ``ftmem.save(state, step=...)`` after every
step. ``state`` holds the model, the optimizer, the LR schedule, the data position and the
RNG state, so a restarted job resumes exactly where the newest snapshot every rank committed
left off.

    ftmem-launch --nproc-per-node 2 examples/train_gpt.py --steps 200

Kill a rank (``kill -9 <pid>``) while it trains: the launcher restarts the ranks, they log
``resumed from step N`` and train on. Under plain ``torchrun``, start one SMP per node first
(``FTMEM_RUN_DIR=$(mktemp -d) python -m ftmem.smp --run-dir "$FTMEM_RUN_DIR" &``).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ftmem

log = logging.getLogger("train_gpt")


class GPT(nn.Module):
    """Token and position embeddings, pre-LayerNorm causal transformer blocks, an LM head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time)."""
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        out: torch.Tensor = self.head(self.blocks(x, mask=mask, is_causal=True))
        return out


class SyntheticTokens:
    """Noisy arithmetic progressions; batch ``p`` of rank ``r`` depends only on ``(r, p)``, so
    the position is the loader's whole state (``state_dict``/``load_state_dict``)."""

    def __init__(self, vocab: int, seq_len: int, batch_size: int, rank: int) -> None:
        self.vocab, self.seq_len, self.batch_size, self.rank = vocab, seq_len, batch_size, rank
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len); advances the position."""
        key = hashlib.sha256(f"{self.rank}/{self.position}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(key[:7], "little"))
        n, t = self.batch_size, self.seq_len + 1
        start = torch.randint(0, self.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(t)) % self.vocab
        noise = torch.rand(n, t, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab, (n, t), generator=g), seq)
        self.position += 1
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """The position in the stream."""
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a position saved by :meth:`state_dict`."""
        self.position = int(state["position"])


def main() -> None:
    """Parse the flags and train."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    if world > 1:
        dist.init_process_group("gloo")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(args.vocab, args.seq_len, args.d_model, args.n_layers)
    torch.manual_seed(1 + rank)  # each rank its own dropout masks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    warmup = 10
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps)),
    )
    data = SyntheticTokens(args.vocab, args.seq_len, args.batch_size, rank)
    state = {
        "model": model,
        "optim": optimizer,
        "sched": schedule,
        "data": data,
        "rng": ftmem.RNGState(),
    }
    # Under DDP every rank holds the same model and optimizer: each rank snapshots 1/world of
    # them and ftmem.load gathers the rest from the other ranks' snapshots.
    replicas = dist.group.WORLD if world > 1 else None
    start = ftmem.load(state, replicated_over=replicas)  # 0 for a fresh run
    log.info("resumed from step %d", start)
    # find_unused_parameters=True keeps DDP's gradient buckets as they were at the start, so a
    # resumed run sums gradients in the same order as one that never failed (docs/api.md).
    ddp = DistributedDataParallel(model, find_unused_parameters=True) if world > 1 else model

    for step in range(start, args.steps):
        inputs, targets = data.next_batch()
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        ftmem.save(state, step=step + 1, replicated_over=replicas)  # returns at once
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            log.info("step %d loss %.4f", step + 1, loss.item())

    ftmem.close()  # waits for the last snapshot
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
