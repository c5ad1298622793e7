"""Resharding a step to another world size: DCP from SMP memory vs DCP from a flushed checkpoint.

    python bench/reshard.py                         # 0.5 GiB of state, D = 2, 5 repeats
    python bench/reshard.py --size-gib 0.05 --repeats 2 --no-write   # a quick look

D ranks (gloo, one node) snapshot the same replicated state, each 1/D of it (as under DDP),
into one SMP; then one process (world 1: it reads every byte, the largest reshard) loads the
step into fresh tensors with ``dcp.load``, alternating: from memory
(:class:`ftmem.tiers.memory_dcp.MemoryCheckpoint`: map, check the checksums, plan, copy) and
from disk (the flush of that step, ``export_dcp``, then ``dcp.load`` of the directory; the
flush is timed apart, as a job that shrinks without ftmem's memory would have flushed it
before the failure). Every load is checked bitwise against the saved state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as bench/reshard.py

from bench import _render, _results
from bench._figures import Goal, table
from bench._stats import stat

PART = "reshard"


def worker(args: argparse.Namespace) -> None:
    """One rank: save the replicated state once (1/D of it), wait for the commit."""
    import torch
    import torch.distributed as dist

    from bench._baselines import build_state
    from ftmem.client import Checkpointer
    from ftmem.config import ClientConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=world)
    st = build_state(args.size_gib, seed=0)
    ck = Checkpointer(ClientConfig(shard_replicated=True))
    ck.save({"model": st.model, "optim": st.optimizer}, 1, replicated_over=dist.group.WORLD)
    ck.wait(600)
    dist.barrier()
    ck.close()
    dist.destroy_process_group()


def _fresh(size_gib: float) -> tuple[Any, dict[str, Any]]:
    """A state of the same shapes with other values, and its DCP state dict to load into."""
    import torch

    from bench._baselines import build_state

    st = build_state(size_gib, seed=1)
    for p in st.model.parameters():
        p.grad = torch.zeros_like(p)
    st.optimizer.step()  # AdamW's state tensors exist
    return st, {"model": st.model.state_dict(), "optim": st.optimizer.state_dict()}


def _same(got: dict[str, Any], want: Any) -> bool:
    """Every parameter and AdamW state tensor of ``got`` equals ``want``'s, bitwise."""
    import torch

    model = want.model.state_dict()
    optim = want.optimizer.state_dict()["state"]
    return all(torch.equal(v, model[k]) for k, v in got["model"].items()) and all(
        torch.equal(v, optim[i][k])
        for i, entry in got["optim"]["state"].items()
        for k, v in entry.items()
        if isinstance(v, torch.Tensor)
    )


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Start an SMP and D ranks that save; then time loads from memory and from disk."""
    import torch
    import torch.distributed.checkpoint as dcp

    from bench._baselines import build_state
    from ftmem.smp.spawn import start_smp
    from ftmem.tiers.export import export_dcp, find_sources
    from ftmem.tiers.memory_dcp import MemoryCheckpoint

    torch.set_num_threads(1)
    run_dir, store = tmp / "run", tmp / "store"
    out: dict[str, Any] = {"memory": [], "disk": [], "flush": [], "exact": True}
    with start_smp(run_dir=run_dir, run_id=f"bsreshard{os.getpid()}", slots=2):
        procs = []
        for r in range(args.world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.world), LOCAL_RANK=str(r))
            env.update(FTMEM_RUN_DIR=str(run_dir), OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--_worker", "--store", str(store)]
            procs.append(subprocess.Popen([*cmd, "--size-gib", str(args.size_gib)], env=env))
        for p in procs:
            if p.wait(timeout=3600) != 0:
                raise RuntimeError(f"a rank failed (exit {p.returncode})")
        want = build_state(args.size_gib, seed=0)
        out["nbytes"] = want.nbytes
        sources = find_sources([run_dir])
        _, sd = _fresh(args.size_gib)
        for rep in range(args.repeats):
            ckpt = tmp / f"ckpt{rep}"
            t0 = time.perf_counter()
            export_dcp(sources, ckpt)
            out["flush"].append(time.perf_counter() - t0)
            for how in ("memory", "disk") if rep % 2 == 0 else ("disk", "memory"):
                _, sd = _fresh(args.size_gib)
                t0 = time.perf_counter()
                if how == "memory":
                    with MemoryCheckpoint(sources) as mem:
                        dcp.load(sd, storage_reader=mem.reader(), no_dist=True)
                else:
                    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
                out[how].append(time.perf_counter() - t0)
                out["exact"] = out["exact"] and _same(sd, want)
            shutil.rmtree(ckpt)
    return out


@dataclass(kw_only=True)
class ReshardResult(_results.PartResult):
    """The reshard part's results."""

    size_gib: float
    world: int
    repeats: int
    runs: dict[str, Any] = field(default_factory=dict)


def get_args_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = _results.parser(__doc__)
    p.add_argument("--size-gib", type=float, default=0.5, help="state (GiB), replicated")
    p.add_argument("--world", type=int, default=2, help="ranks that save (D)")
    p.add_argument("--repeats", type=int, default=5, help="loads of each kind")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    return p


def run(argv: list[str]) -> ReshardResult:
    """Parse ``argv`` and measure."""
    args = get_args_parser().parse_args(argv)
    same = {k: getattr(args, k) for k in ("size_gib", "world", "repeats")}
    res = ReshardResult(argv=argv, machine=_results.machine(), **same)
    with tempfile.TemporaryDirectory(prefix="ftmem-bench-reshard-", dir="/tmp") as tmp:
        res.runs = measure(args, Path(tmp))
    if not res.runs["exact"]:
        res.errors.append("a load differed from the saved state")
    _results.finish(res.machine)
    return res


# ------------------------------------------------------------------------------ the section

Doc = dict[str, Any]


def sections(r: Doc) -> dict[str, list[str]]:
    """Section ``reshard``: load time from memory and from disk, and the flush before it."""
    runs = r["runs"]
    gib = runs["nbytes"] / 2**30
    out = [
        f"- state {gib:.3f} GiB (model + AdamW), saved by D={r['world']} ranks, 1/D each; "
        f"loaded by one process (world 1) with `dcp.load`; {r['repeats']} loads of each kind, "
        "alternating; medians (min-max); every load bitwise equal to the saved state: "
        f"{'yes' if runs['exact'] else 'NO'}",
        "- the disk directory is on /tmp, written fresh before each pair of loads (its files "
        "are in the page cache when read: the disk path's best case)",
        "",
    ]
    body = [
        ["dcp.load from SMP memory (MemoryCheckpoint)", stat(runs["memory"], ".3f", " s")],
        ["dcp.load from the flushed checkpoint", stat(runs["disk"], ".3f", " s")],
        ["(the flush itself, export_dcp, before the failure)", stat(runs["flush"], ".3f", " s")],
    ]
    return {"reshard": out + table(["path", "time"], body)}


def goals(r: Doc | None) -> list[Goal]:
    """No goal yet: the issue asks for the comparison, not a figure."""
    return []


if __name__ == "__main__":
    if "--_worker" in sys.argv:
        worker(get_args_parser().parse_args())
        sys.exit(0)
    sys.exit(_render.script_main(PART, run))
