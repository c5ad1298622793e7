"""Train a small GPT sharded with FSDP2 (``fully_shard``) on CPU (gloo), snapshotting every step.

What it shows: with FSDP2 the model's and the optimizer's tensors are DTensors; ftmem
snapshots each rank's local shards with their global offsets, restores them in place at the
same world size, and the disk tier writes them as DCP's sharded tensors, so stock
``torch.distributed.checkpoint.load`` reshards a flushed checkpoint to another world size.
Killing a rank and restarting every rank resumes from the newest snapshot every rank
committed; the run ends bit for bit where an uninterrupted run ends (compare the
``[rank R] digest`` lines: a sha256 over the *full* parameters and optimizer state, gathered
from the shards, the same on every rank).

Commands (from a checkout of the repository, at its root, with ftmem installed: ``pip install
-e .``):

    ftmem-launch --nproc-per-node 2 examples/train_fsdp.py --steps 20 --fail-at-step 12
    ftmem-launch --nproc-per-node 4 examples/train_fsdp.py --steps 20 --hsdp 2   # HSDP 2 x 2
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --steps 20 --no-ftmem

The model, data, flags (failure injection included) and output lines are those of the test
workload, ``tests/_support/workload/train.py``, imported from the checkout this file lies in
(the tests train and check the same model); to use this example elsewhere, copy that file
beside it. Only the wrapping (``fully_shard`` per block, then the whole model, on a 1-D CPU
device mesh) and the digest differ.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root
from tests._support.workload.train import (
    GPT,
    SyntheticTokens,
    fail_when_committed,
    get_args_parser,
)

logger = logging.getLogger("train_fsdp")


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank calls it), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the full parameters (sorted by name) and the full optimizer state (per
    parameter index, sorted keys): the same on every rank, whatever the sharding."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = full(p.detach()).contiguous()
        h.update(f"param.{name}:{t.dtype}:{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    opt_state = optimizer.state_dict()["state"]
    for idx in sorted(opt_state):
        for key in sorted(opt_state[idx]):
            value = opt_state[idx][key]
            if isinstance(value, torch.Tensor):
                t = full(value).contiguous()
                h.update(f"optim.{idx}.{key}:{t.dtype}:{list(t.shape)}|".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(f"optim.{idx}.{key}={value!r}|".encode())
    return h.hexdigest()


def train(args: Any) -> int:
    """Run the FSDP2 training loop described by ``args``; return the exit code."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group(
        "gloo",
        init_method=args.init_method,
        timeout=timedelta(seconds=args.pg_timeout),
        rank=rank,
        world_size=world,
    )
    if args.hsdp > 1:  # HSDP: replicate over the first mesh dimension, shard over the second
        mesh = init_device_mesh(
            "cpu", (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)  # same initial weights on every rank before sharding
    model = GPT(
        vocab=args.vocab,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        dropout=args.dropout,
        batchnorm=False,
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(args.seed + 1000 * rank + 1)  # per-rank dropout masks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    loader = SyntheticTokens(
        vocab=args.vocab,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=args.seed,
        rank=rank,
    )
    ftmem: Any = None
    start = 0
    state: dict[str, Any] = {"model": model, "optim": optimizer, "data": loader}
    if not args.no_ftmem:
        import ftmem

        state["rng"] = ftmem.RNGState()
        start = ftmem.load(state)
    print(f"[rank {rank}] resumed from step {start}", flush=True)
    for step in range(start, args.steps):
        inputs, targets = loader.next_batch()
        logits = model(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        handle = None
        if ftmem is not None and (step + 1) % args.save_every == 0:
            handle = ftmem.save(state, step=step + 1)
        elif ftmem is not None:
            ftmem.heartbeat(step + 1)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            logger.info("step %d loss %.4f", step + 1, loss.item())
        if step + 1 == args.fail_at_step and start < args.fail_at_step:
            fail_when_committed(
                ftmem, handle is not None, rank, args.fail_rank, step + 1, args.fail_mode
            )
        if args.step_delay:
            time.sleep(args.step_delay)
    if ftmem is not None:
        ftmem.close()
    print(f"[rank {rank}] final step {max(start, args.steps)}", flush=True)
    print(f"[rank {rank}] digest {state_digest(model, optimizer)}", flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line (train_gpt.py's flags), set up logging and train."""
    parser = get_args_parser()
    parser.description = "FSDP2 variant of train_gpt.py"
    parser.add_argument(
        "--hsdp",
        type=int,
        default=1,
        help="HSDP: replicate over this many groups of world/N ranks that shard (default 1: "
        "plain FSDP2); ftmem then saves 1/N of each replicated shard per rank",
    )
    args = parser.parse_args(argv)
    if args.hsdp < 1 or int(os.environ.get("WORLD_SIZE", "1")) % args.hsdp:
        parser.error("--hsdp must divide the world size")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank {rank}] %(name)s %(levelname)s: %(message)s",
    )
    return train(args)


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown. With torch 2.13 on gloo, the process groups
    # that FSDP2's DeviceMesh still holds after destroy_process_group() are destroyed with
    # the interpreter, and that aborts now and then ("terminate called without an active
    # exception", SIGABRT: 4 of 50 plain torchrun runs of this script on a 2-core machine,
    # every one after its last line was printed). Nothing is left to do: flush and go.
    # (It also skips the last garbage collection of torch's heap, ~0.8 s of CPU per rank.)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
