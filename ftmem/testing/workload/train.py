"""A tiny deterministic training job with an ftmem snapshot after every step: the chaos
runner's workload (``ftmem-launch --nproc-per-node 2 .../ftmem/testing/workload/train.py``).

A next-token MLP over synthetic token streams (embedding, residual MLP blocks with dropout,
an LM head), AdamW with a warm-up schedule, and a data stream whose whole state is its
position; ``ftmem.load`` restores the model, the optimizer, the schedule, the stream and the
RNG state, and ``ftmem.save`` snapshots them after every step (under several ranks each
rank saves 1/world of the replicated state). Gradients are averaged with one all-reduce of
one flat buffer, so a run of a given world size sums them in the same order whatever it
survived: an interrupted run ends bit for bit where a failure-free one ends.

What it prints (what :mod:`ftmem.testing.chaos` reads):

- ``[rank R] resumed from step N`` after ``ftmem.load`` (0 for a fresh run);
- ``<time> [rank R] workload INFO: step N loss X`` every ``--log-every`` steps and at the end;
- ``[rank R] digest <sha256>`` at the end: every parameter (sorted by name) and every
  optimizer state entry (per parameter index, sorted keys), the same on every rank.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ftmem

logger = logging.getLogger("workload")


class TinyLM(nn.Module):
    """Embedding, ``n_layers`` residual MLP blocks (pre-LayerNorm, dropout), LM head."""

    def __init__(self, *, vocab: int, d_model: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(d_model),
                nn.Linear(d_model, 4 * d_model),
                nn.GELU(),
                nn.Linear(4 * d_model, d_model),
                nn.Dropout(dropout),
            )
            for _ in range(n_layers)
        )
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time)."""
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(self.ln(x))
        return out


class TokenStream:
    """Deterministic batches of noisy arithmetic progressions modulo ``vocab``.

    Batch ``p`` of rank ``r`` comes from a generator seeded with ``(seed, r, p)``: restoring
    :attr:`position` reproduces the same batches.
    """

    def __init__(self, *, vocab: int, seq_len: int, batch: int, seed: int, rank: int) -> None:
        self.vocab, self.seq_len, self.batch = vocab, seq_len, batch
        self.seed, self.rank = seed, rank
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len) int64; advances the position by one."""
        key = f"{self.seed}/{self.rank}/{self.position}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)
        g = torch.Generator().manual_seed(seed)
        n, t = self.batch, self.seq_len + 1
        start = torch.randint(0, self.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(t)) % self.vocab
        noise = torch.rand(n, t, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab, (n, t), generator=g), seq)
        self.position += 1
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """The stream's state: its position."""
        return {"position": self.position}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict`."""
        self.position = int(state_dict["position"])


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the parameters (sorted by name) and the optimizer state (per parameter
    index, sorted keys, scalars by repr), the same on every rank of a run."""
    h = hashlib.sha256()

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    for name, p in sorted(model.named_parameters()):
        add(f"param.{name}", p)
    opt_state = optimizer.state_dict()["state"]
    for idx in sorted(opt_state):
        for key in sorted(opt_state[idx]):
            value = opt_state[idx][key]
            if isinstance(value, torch.Tensor):
                add(f"optim.{idx}.{key}", value)
            else:
                h.update(f"optim.{idx}.{key}={value!r}|".encode())
    return h.hexdigest()


def average_gradients(params: list[nn.Parameter], world: int) -> None:
    """Average the gradients over the ranks: one all-reduce of one flat buffer."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def get_args_parser() -> argparse.ArgumentParser:
    """The workload's flags (defaults: a model of a few milliseconds a step)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2, help="per rank")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layers", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--log-every", type=int, default=1, help="log the loss every K steps")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="gloo timeout (s)")
    p.add_argument("--init-method", default="env://", help="process group init method")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep after each step (s)")
    return p


def _warmup(steps: int) -> Callable[[int], float]:
    """A linear warm-up over ``steps`` steps, then the full rate."""

    def fn(step: int) -> float:
        return min(1.0, (step + 1) / max(1, steps))

    return fn


def train(args: argparse.Namespace) -> int:
    """Train as ``args`` say, with a snapshot after every step; the exit code."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=args.init_method,
            timeout=timedelta(seconds=args.pg_timeout),
            rank=rank,
            world_size=world,
        )
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyLM(
        vocab=args.vocab, d_model=args.d_model, n_layers=args.n_layers, dropout=args.dropout
    )
    torch.manual_seed(args.seed + 1000 * rank + 1)  # per-rank dropout masks
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup(args.warmup_steps))
    stream = TokenStream(
        vocab=args.vocab, seq_len=args.seq_len, batch=args.batch_size, seed=args.seed, rank=rank
    )
    state: dict[str, Any] = {
        "model": model,
        "optim": optimizer,
        "sched": schedule,
        "data": stream,
        "rng": ftmem.RNGState(),
    }
    replicas = dist.group.WORLD if world > 1 else None
    start = ftmem.load(state, replicated_over=replicas)
    print(f"[rank {rank}] resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        inputs, targets = stream.next_batch()
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        if world > 1:
            average_gradients(params, world)
        optimizer.step()
        schedule.step()
        ftmem.save(state, step=step + 1, replicated_over=replicas)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            logger.info("step %d loss %.4f", step + 1, loss.item())
        if args.step_delay:
            time.sleep(args.step_delay)
    ftmem.close()
    print(f"[rank {rank}] digest {state_digest(model, optimizer)}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, set up logging (``[rank R]`` prefix) and train."""
    args = get_args_parser().parse_args(argv)
    if args.steps < 0 or args.log_every < 1:
        raise SystemExit("--steps must be >= 0 and --log-every >= 1")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {os.environ.get('RANK', '0')}] %(name)s %(levelname)s: "
        "%(message)s",
    )
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
