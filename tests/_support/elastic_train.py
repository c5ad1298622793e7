"""A data-parallel job over a dataset of numbered samples, for the tests of a changing world
size: DDP over a small MLP, AdamW, ``ftmem.ElasticSampler`` and one ``ftmem.save`` per step.

It prints ``SEEN <step> <index>...`` for every batch it trains on (the samples' numbers),
``LOADED <step> <digest>`` after ``ftmem.load`` (the parameters and optimizer state), with
``--compare-dcp DIR`` also ``DCP <digest>`` of the same state loaded by stock ``dcp.load``
from DIR at this world size, and ``FINAL <digest>`` at the end of the epoch. ``--stop-after
K``: exit after step K is committed (a job that stops there). ``--per-rank``: add an entry
whose state differs between the ranks and that cannot be resharded. ``--samples N``: the
epoch's size; ``--step-delay S``: a pause after each step; ``--gate FILE``: the epoch's last
batch waits until FILE exists (a test keeps the job from ending before it has failed it).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

# Run by path, so this file's folder (tests/_support) is first on sys.path: the workload is
# found there whether or not the checkout is importable (ranks do not get it on PYTHONPATH).
from workload.train import deterministic_kernels  # type: ignore[import-not-found]
from workload.train import state_digest as digest  # type: ignore[import-not-found]

import ftmem

SAMPLES = 48


class Numbered(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """``size`` samples; sample ``i``: its number, an input and a target made from ``i``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return i, x, x.sum(0, keepdim=True)


class PerRank:
    """A Stateful whose state is the rank's own (and no load_resharded_state)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.rank}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.rank = int(sd["rank"])


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stop-after", type=int, default=0)
    ap.add_argument("--compare-dcp", default="")
    ap.add_argument("--per-rank", action="store_true")
    ap.add_argument("--init-method", default="env://")
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--gate", default="")
    args, _ = ap.parse_known_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    deterministic_kernels()
    dist.init_process_group(
        "gloo",
        init_method=args.init_method,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    model, opt = build()
    sampler = ftmem.ElasticSampler(args.samples, seed=7)
    state: dict[str, Any] = {"model": model, "optim": opt, "sampler": sampler}
    state["rng"] = ftmem.RNGState()
    if args.per_rank:
        state["data"] = PerRank(rank)
    start = ftmem.load(state, replicated_over=dist.group.WORLD)
    print(f"LOADED {start} {digest(model, opt)}", flush=True)
    if args.compare_dcp:
        import torch.distributed.checkpoint as dcp

        from ftmem.client.reshard import init_optimizer_state

        m2, o2 = build()
        init_optimizer_state(o2)
        sd = {"model": m2.state_dict(), "optim": o2.state_dict()}
        dcp.load(sd, checkpoint_id=args.compare_dcp)
        m2.load_state_dict(sd["model"])
        o2.load_state_dict(sd["optim"])
        print(f"DCP {digest(m2, o2)}", flush=True)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    step = start
    done = bool(args.stop_after) and start >= args.stop_after
    loader = DataLoader(Numbered(args.samples), batch_size=2, sampler=sampler)
    batches = 0 if done else len(loader)
    for i, (idx, x, y) in enumerate([] if done else loader):
        while args.gate and i == batches - 1 and not os.path.exists(args.gate):
            time.sleep(0.05)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        print(f"SEEN {step} " + " ".join(str(int(i)) for i in idx), flush=True)
        ftmem.save(state, step, replicated_over=dist.group.WORLD)
        if step == args.stop_after:
            break
        if args.step_delay:
            time.sleep(args.step_delay)
    assert ftmem.wait(timeout=60) or done  # (nothing saved when nothing was trained)
    print(f"FINAL {step} {digest(model, opt)}", flush=True)
    ftmem.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
