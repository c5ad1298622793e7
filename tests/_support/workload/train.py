"""The test workload: a small GPT on synthetic tokens with an ftmem snapshot after every step,
plus the switches tests, the chaos runner and the benchmarks need (failure injection, no
snapshots, in-process restart, timing lines). ``examples/train_gpt.py`` is the same loop
without them, written for reading.

Run it with ``ftmem-launch --nproc-per-node 2 tests/_support/workload/train.py --steps 20
--fail-at-step 12 --fail-rank 1``: rank 1 SIGKILLs itself once every rank committed step 12,
the launcher restarts the ranks and they resume from step 12. ``--no-ftmem`` trains without
snapshots (the reference). A single process trains without DDP.

What it prints (what :mod:`tests._support.chaos` and the tests read): ``[rank R] resumed from
step N`` after ``ftmem.load``; ``<time> [rank R] workload INFO: step N loss X`` every
``--log-every`` steps; at the end ``[rank R] final step N``, ``[rank R] mean step time X s``
(and the median) and ``[rank R] digest <sha256>`` over every byte of the parameters (sorted by
name) and of the optimizer state (per parameter index, sorted keys), the same on every rank;
with persistent buffers (``--batchnorm``) a per-rank ``[rank R] buffers sha256 <hex>`` line.
``--d-model``/``--n-layers``/``--vocab`` scale the state (12 bytes per parameter), e.g.
``--d-model 768 --n-layers 4 --vocab 8192`` is ~41 M parameters, ~0.5 GB of state."""

from __future__ import annotations

import argparse
import gc
import hashlib
import logging
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger("workload")


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask."""

    mask: torch.Tensor

    def __init__(self, d_model: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not a multiple of n_heads {n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        # Not persistent: derived from seq_len, so it is neither saved nor restored.
        self.register_buffer("mask", mask.view(1, 1, seq_len, seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_drop(self.proj(y))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, seq_len, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """A decoder-only transformer: token + position embedding, pre-LN blocks, LM head.

    With ``batchnorm=True`` a BatchNorm1d over the channels sits before the final LayerNorm,
    so the forward pass mutates buffers (its running statistics) in training mode.
    """

    def __init__(
        self,
        *,
        vocab: int,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        dropout: float,
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, seq_len, dropout) for _ in range(n_layers)
        )
        self.bn = nn.BatchNorm1d(d_model) if batchnorm else None
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return logits of shape (batch, time, vocab) for token ids of shape (batch, time)."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        if self.bn is not None:
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


# --------------------------------------------------------------------------- data


class SyntheticTokens:
    """An endless, deterministic stream of token batches whose whole state is its position.

    Batch ``p`` of rank ``r`` is generated from a ``torch.Generator`` seeded from
    ``(seed, r, p)``, so restoring ``position`` reproduces exactly the same batches. Each row is
    a noisy arithmetic progression modulo ``vocab`` (learnable, so the loss goes down).
    """

    def __init__(self, *, vocab: int, seq_len: int, batch_size: int, seed: int, rank: int) -> None:
        self.vocab = vocab
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.position = 0

    def _generator(self) -> torch.Generator:
        key = f"{self.seed}/{self.rank}/{self.position}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & (2**63 - 1)
        return torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (inputs, targets), each (batch_size, seq_len) int64, and advance by one."""
        g = self._generator()
        n, t = self.batch_size, self.seq_len + 1
        start = torch.randint(0, self.vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(t)) % self.vocab
        noise = torch.rand(n, t, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, self.vocab, (n, t), generator=g), seq)
        self.position += 1
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        """Return the loader's state: its position in the stream."""
        return {"position": self.position}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict`."""
        self.position = int(state_dict["position"])


# --------------------------------------------------------------------------- digest


def _update_tensor(h: Any, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Return a sha256 over the parameters and the optimizer's state, in a fixed order.

    Covers every parameter (sorted by name) and, for every parameter index of
    ``optimizer.state_dict()``, every state tensor (sorted keys, ``step`` included) and scalar.
    Under DDP it is the same on every rank.
    """
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        _update_tensor(h, f"param.{name}", p)
    opt_state = optimizer.state_dict()["state"]
    for idx in sorted(opt_state):
        for key in sorted(opt_state[idx]):
            value = opt_state[idx][key]
            if isinstance(value, torch.Tensor):
                _update_tensor(h, f"optim.{idx}.{key}", value)
            else:
                h.update(f"optim.{idx}.{key}={value!r}|".encode())
    return h.hexdigest()


def buffers_digest(model: nn.Module) -> str | None:
    """Return a sha256 over the persistent buffers (sorted by name), or None if there are none.

    BatchNorm running statistics differ between ranks (each sees its own batches), so this is
    a per-rank figure, printed apart from the digest.
    """
    params = {name for name, _ in model.named_parameters()}
    buffers = sorted((k, v) for k, v in model.state_dict().items() if k not in params)
    if not buffers:
        return None
    h = hashlib.sha256()
    for name, t in buffers:
        _update_tensor(h, f"buffer.{name}", t)
    return h.hexdigest()


# --------------------------------------------------------------------------- training


def get_args_parser() -> argparse.ArgumentParser:
    """Return the example's argument parser."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=20, help="total optimizer steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument(
        "--lr-decay-steps",
        type=int,
        default=0,
        help="length of the cosine schedule (default: --steps)",
    )
    p.add_argument("--batchnorm", action="store_true", help="add a BatchNorm1d (buffers)")
    p.add_argument("--cuda", action="store_true", help="train on GPU LOCAL_RANK (gloo)")
    p.add_argument("--no-ftmem", action="store_true", help="train without snapshots")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="train under ftmem.run: when another rank fails, this process rejoins the next "
        "generation in process (needs ftmem-launch)",
    )
    p.add_argument("--save-every", type=int, default=1, help="snapshot every K steps")
    p.add_argument(
        "--no-shard",
        action="store_true",
        help="every rank snapshots all of the replicated (DDP) state instead of 1/world of it",
    )
    p.add_argument(
        "--fail-at-step",
        type=int,
        default=0,
        help="once every rank committed its snapshot of step N, --fail-rank fails (once: not "
        "when resumed at >= N)",
    )
    p.add_argument("--fail-rank", type=int, default=0, help="the rank that fails")
    p.add_argument("--fail-mode", choices=("kill", "hang"), default="kill")
    p.add_argument(
        "--pg-timeout", type=float, default=300.0, help="gloo init/collective timeout (s)"
    )
    p.add_argument(
        "--init-method",
        default="env://",
        help="process group init method (tests use file:// to avoid racing for a free port)",
    )
    p.add_argument("--log-every", type=int, default=1, help="log the loss every K steps")
    p.add_argument(
        "--ddp-find-unused",
        choices=("true", "false"),
        default="true",
        help="DDP's find_unused_parameters (false on 3+ ranks: ftmem warns that the resume "
        "is not exact; docs/api.md, Pitfalls)",
    )
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds to sleep after each step (tests: time to lose a node mid-run)",
    )
    p.add_argument(
        "--fast-after-resume",
        action="store_true",
        help="no --step-delay once the rank resumed from a snapshot (a test that injects one "
        "failure then only waits for the end)",
    )
    p.add_argument(
        "--hold-after-step",
        type=int,
        default=0,
        help="after step N, wait until --hold-file exists (tests: the job is still running "
        "when a machine is lost, however long the machines took to start)",
    )
    p.add_argument("--hold-file", default="", help="the file --hold-after-step waits for")
    return p


def _lr_lambda(warmup: int, total: int) -> Any:
    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return fn


def _hold(path: str, rank: int, timeout: float = 600.0) -> None:
    """Wait until ``path`` exists (at most ``timeout`` s: a test that died never releases)."""
    deadline = time.monotonic() + timeout
    print(f"[rank {rank}] holding until {path} exists", flush=True)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"[rank {rank}] {path} did not appear within {timeout:g} s")
        time.sleep(0.05)


def _inject_failure(mode: str, rank: int, step: int) -> None:
    print(f"[rank {rank}] injecting failure ({mode}) after step {step}", flush=True)
    sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
    os.kill(os.getpid(), sig)


def fail_when_committed(
    ftmem: Any, saved: bool, rank: int, fail_rank: int, step: int, mode: str = "kill"
) -> None:
    """At the failure step (``--fail-at-step``), on every rank: wait until this rank's
    snapshot of ``step`` is committed (``ftmem.wait`` also commits one that was skipped; not
    when ``saved`` is False), meet the other ranks at a barrier, and then, on ``fail_rank``,
    fail (``mode``: kill or hang). So the restart resumes from ``step`` however loaded the
    machine is: an ordinary save may skip when the SMP still holds both slots."""
    committed = True
    if ftmem is not None and saved:
        try:  # wait() also commits this step if its snapshot was skipped
            committed = ftmem.wait(timeout=60.0)
        except TimeoutError:
            committed = False
    if not committed:
        logger.warning("snapshot of step %d not committed before the failure", step)
    if dist.is_initialized():
        dist.barrier()
    if rank == fail_rank:
        _inject_failure(mode, rank, step)


def deterministic_kernels() -> None:
    """What ``torch.use_deterministic_algorithms(True)`` sets for the kernels, without its
    other half: it also imports ``torch._inductor.config`` (and with it ``torch._dynamo``)
    to set a flag for ``torch.compile``, 1.5 s of CPU at every rank start on these machines,
    where the suite's ranks never compile. The suite starts a few hundred ranks."""
    torch._C._set_deterministic_algorithms(True, warn_only=False)


def train(args: argparse.Namespace) -> int:
    """Run the training loop described by ``args``; return the process exit code."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.cuda:
        # Deterministic cuBLAS needs its workspace set before its first call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if args.in_process:
        # Known issue: without torch._dynamo imported, a survivor of a SIGKILLed peer can
        # stay in DDP's finalize_backward while the others rejoin in process (the agent's
        # rejoin timeout then restarts it cold); use_deterministic_algorithms imports it.
        torch.use_deterministic_algorithms(True)
    else:
        deterministic_kernels()
    if world > 1:
        t_pg = time.perf_counter()
        # Bounded, so that a peer that never comes (or died) fails the rank instead of hanging.
        dist.init_process_group(
            "gloo",
            init_method=args.init_method,
            timeout=timedelta(seconds=args.pg_timeout),
            rank=rank,
            world_size=world,
        )
        logger.info("process group: %.3f s", time.perf_counter() - t_pg)

    torch.manual_seed(args.seed)  # same initial weights on every rank
    model: nn.Module = GPT(
        vocab=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        dropout=args.dropout,
        batchnorm=args.batchnorm,
    )
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: %.2f M parameters", n_params / 1e6)
    torch.manual_seed(args.seed + 1000 * rank + 1)  # per-rank dropout masks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    total_sched = args.lr_decay_steps or args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_lambda(args.warmup_steps, total_sched)
    )
    loader = SyntheticTokens(
        vocab=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        rank=rank,
    )

    ftmem: Any = None
    state: dict[str, Any] = {
        "model": model,
        "optim": optimizer,
        "sched": scheduler,
        "data": loader,
    }
    step_times: list[float] = []

    def steps_from(start: int) -> int:
        """Train from ``start`` to ``args.steps``; under --in-process, once per generation."""
        print(f"[rank {rank}] resumed from step {start}", flush=True)
        # Bucket layout must not depend on where the run started: DDP reorders its buckets
        # after its first iteration, and with 3+ ranks a different bucket layout sums the
        # gradients in another order (float addition is not associative).
        # find_unused_parameters=True keeps the initial layout for good (see docs/design.md,
        # "Bitwise resumption under DDP"). DDP is bound to the process group: built here.
        train_model = (
            DistributedDataParallel(model, find_unused_parameters=args.ddp_find_unused == "true")
            if world > 1
            else model
        )
        # Under DDP every rank holds the same parameters and optimizer state: each saves
        # 1/world of them, and load gathers them back (--no-shard: every rank saves everything).
        replicas = dist.group.WORLD if world > 1 and not args.no_shard else None
        delay = 0.0 if start and args.fast_after_resume else args.step_delay
        for step in range(start, args.steps):
            t0 = time.perf_counter()
            inputs, targets = loader.next_batch()
            inputs, targets = inputs.to(device), targets.to(device)
            logits = train_model(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
            optimizer.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            optimizer.step()
            scheduler.step()
            handle = None
            if ftmem is not None and (step + 1) % args.save_every == 0:
                handle = ftmem.save(state, step=step + 1, replicated_over=replicas)
            elif ftmem is not None:
                ftmem.heartbeat(step + 1)  # progress for hang detection between snapshots
            step_times.append(time.perf_counter() - t0)
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                logger.info(
                    "step %d loss %.4f lr %.2e", step + 1, loss.item(), scheduler.get_last_lr()[0]
                )
            if step + 1 == args.fail_at_step and start < args.fail_at_step:
                fail_when_committed(
                    ftmem, handle is not None, rank, args.fail_rank, step + 1, args.fail_mode
                )
            if delay:
                time.sleep(delay)
            if step + 1 == args.hold_after_step:
                _hold(args.hold_file, rank)
        return max(start, int(args.steps))

    if args.no_ftmem:
        final_step = steps_from(0)
    else:
        # Imported only with snapshots: the --no-ftmem reference run never touches ftmem.
        import ftmem

        state["rng"] = ftmem.RNGState()
        if args.in_process:
            # Survivors of another rank's failure stay alive and run steps_from again.
            shard = world > 1 and not args.no_shard
            final_step = ftmem.run(
                steps_from,
                state,
                replicated_over=(lambda: dist.group.WORLD) if shard else None,
                pg_timeout=timedelta(seconds=args.pg_timeout),
            )
        else:
            replicas = dist.group.WORLD if world > 1 and not args.no_shard else None
            final_step = steps_from(ftmem.load(state, replicated_over=replicas))

    if ftmem is not None:
        ftmem.close()
    mean = sum(step_times) / len(step_times) if step_times else 0.0
    print(f"[rank {rank}] final step {final_step}", flush=True)
    print(f"[rank {rank}] mean step time {mean:.4f} s", flush=True)
    if step_times:
        median = statistics.median(step_times)
        print(f"[rank {rank}] median step time {median:.4f} s", flush=True)
    print(f"[rank {rank}] digest {state_digest(model, optimizer)}", flush=True)
    buffers = buffers_digest(model)
    if buffers is not None:
        print(f"[rank {rank}] buffers sha256 {buffers}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, set up logging and train."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.save_every < 1 or args.steps < 0:
        parser.error("--save-every must be >= 1 and --steps >= 0")
    if args.fail_at_step % args.save_every:
        # Else the restart resumes before the failure step and fails again, for ever.
        parser.error("--fail-at-step must be a multiple of --save-every")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
    logger.info("script started")  # after the interpreter and the imports (for the benchmarks)
    return train(args)


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's last garbage collection of torch's heap at exit: ~0.8 s of CPU
    # per rank here, for nothing (the process ends; nothing it would free is needed).
    gc.freeze()
    sys.exit(code)
