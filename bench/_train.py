"""The training loop of the test workload (``tests/_support/workload/train.py``), for the bench workers that run inside ranks.

``bench/recovery.py --_dcp-worker`` and ``bench/overhead.py --_worker`` build the example's
model, data, optimizer, schedule and DDP wrapping in the example's order, so that the seeds
line up and the final digest equals the example's. The workers report what the benchmarks
time as JSON lines (:func:`mark`, read back with :func:`marks`), not as log lines to scrape.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

MARK = "BENCH_MARK "  # Prefix of the workers' JSON lines: {"event", "time", "rank", ...}.


def mark(event: str, rank: int, **fields: Any) -> None:
    """Print one JSON line of what a worker did, with the wall-clock time (``time.time()``)."""
    doc = {"event": event, "time": time.time(), "rank": rank, **fields}
    # One write of the whole line: print() writes the text and the newline apart, and two
    # ranks sharing the launcher's stdout then merged their lines (seen: 1 run in 6).
    sys.stdout.write(MARK + json.dumps(doc) + "\n")
    sys.stdout.flush()


def marks(text: str) -> list[dict[str, Any]]:
    """The JSON lines :func:`mark` printed in a job's output (launcher prefixes ignored)."""
    out = []
    decoder = json.JSONDecoder()
    for line in text.splitlines():
        for part in line.split(MARK)[1:]:  # two marks on one line: lines written together
            try:
                doc, _ = decoder.raw_decode(part)
            except json.JSONDecodeError:
                continue
            out.append(doc)
    return sorted(out, key=lambda d: d["time"])


@dataclass(slots=True)
class Training:
    """One rank's training objects, built as the example builds them."""

    ex: ModuleType  # The example module.
    args: argparse.Namespace  # The example's parsed arguments.
    rank: int
    world: int
    log: logging.Logger
    model: Any
    train_model: Any  # The model wrapped in DDP (the model itself with one rank).
    optimizer: Any
    scheduler: Any
    loader: Any

    def step(self) -> Any:
        """One training step (forward, backward, optimizer and schedule); the loss."""
        import torch.nn.functional as F

        inputs, targets = self.loader.next_batch()
        logits = self.train_model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.scheduler.step()
        return loss

    def log_step(self, step: int, loss: Any) -> None:
        """The example's per-step log line (when ``--log-every`` says so)."""
        if step % self.args.log_every == 0 or step == self.args.steps:
            lr = self.scheduler.get_last_lr()[0]
            self.log.info("step %d loss %.4f lr %.2e", step, loss.item(), lr)

    def dcp_state(self) -> dict[str, Any]:
        """The state a DCP checkpoint holds: model, optimizer, schedule, data, this rank's RNG."""
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sched": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            # Per-rank key: DCP de-duplicates equal keys across ranks.
            f"rng_rank{self.rank}": torch.get_rng_state(),
        }

    def dcp_restore(self, state: dict[str, Any]) -> None:
        """Put a loaded :meth:`dcp_state` back into the live objects."""
        import torch
        from torch.distributed.checkpoint.state_dict import set_state_dict

        sd = {"model_state_dict": state["model"], "optim_state_dict": state["optim"]}
        set_state_dict(self.model, self.optimizer, **sd)
        self.scheduler.load_state_dict(state["sched"])
        self.loader.load_state_dict(state["data"])
        torch.set_rng_state(state[f"rng_rank{self.rank}"])

    def finish(self, final_step: int, step_times: Sequence[float]) -> None:
        """Print the example's closing lines (final step, step times, digest); leave the group."""
        import torch.distributed as dist

        say = [f"final step {final_step}"]
        if step_times:
            say.append(f"mean step time {sum(step_times) / len(step_times):.4f} s")
            say.append(f"median step time {statistics.median(step_times):.4f} s")
        say.append(f"digest {self.ex.state_digest(self.model, self.optimizer)}")
        for line in say:
            print(f"[rank {self.rank}] {line}", flush=True)
        if self.world > 1:
            dist.destroy_process_group()


def setup(example_argv: Sequence[str], logger_name: str) -> Training:
    """Parse the example's arguments and build everything as the example does, in its order
    (logging, threads, determinism, gloo group, seeded model, DDP, AdamW, schedule, data)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ex = importlib.import_module("tests._support.workload.train")
    args = ex.get_args_parser().parse_args(list(example_argv))
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
    log = logging.getLogger(logger_name)
    mark("script_started", rank)  # after the interpreter and the imports
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if world > 1:
        timeout = datetime.timedelta(seconds=args.pg_timeout)
        pg = {"init_method": args.init_method, "timeout": timeout, "rank": rank}
        dist.init_process_group("gloo", world_size=world, **pg)
    torch.manual_seed(args.seed)
    gpt = ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "dropout", "batchnorm")
    model = ex.GPT(**{k: getattr(args, k) for k in gpt})
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2f M parameters", n_params / 1e6)
    mark("model", rank, params_m=n_params / 1e6)
    torch.manual_seed(args.seed + 1000 * rank + 1)
    # As the example: DDP keeps its initial bucket layout (see the example's comment).
    ddp = DistributedDataParallel(model, find_unused_parameters=True) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    total = args.lr_decay_steps or args.steps
    lr = ex._lr_lambda(args.warmup_steps, total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr)
    data = {k: getattr(args, k) for k in ("vocab", "seq_len", "batch_size", "seed")}
    loader = ex.SyntheticTokens(**data, rank=rank)
    return Training(ex, args, rank, world, log, model, ddp, optimizer, scheduler, loader)


def worker(prog: str, argv: Sequence[str], ints: Sequence[str]) -> tuple[Any, Training]:
    """A worker's command line (``--ckpt-dir DIR``, the int flags ``ints``, then ``--`` and
    the example's arguments): its arguments and the rank's :class:`Training`."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    for name in ints:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    p.add_argument("example_args", nargs=argparse.REMAINDER)
    w = p.parse_args(list(argv))
    example = w.example_args[1:] if w.example_args[:1] == ["--"] else w.example_args
    return w, setup(example, prog.split(".")[0] + "_worker")
