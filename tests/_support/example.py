"""The test workload (:mod:`tests._support.workload.train`) as a module, and a fresh model
and optimizer of the size the export tests train, to load a checkpoint into (also from a
subprocess)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tests._support.procs import REPO

MODEL_ARGS = dict(vocab=128, seq_len=32, d_model=64, n_layers=2, n_heads=2, dropout=0.1)


def example() -> ModuleType:
    """The test workload's module (its model, its digest)."""
    return importlib.import_module("tests._support.workload.train")


def fresh_state(
    ex: ModuleType,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A new model and AdamW with state tensors to load into (values differ from the run's)."""
    torch.manual_seed(123)
    model = ex.GPT(batchnorm=False, **MODEL_ARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg, exp_avg_sq, step
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict()}


LOAD_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, {repo!r})
from tests._support.example import example, fresh_state
ex = example()
world = int(os.environ["WORLD_SIZE"])
if world > 1:
    dist.init_process_group("gloo", init_method="file://" + {store!r},
                            rank=int(os.environ["RANK"]), world_size=world)
model, opt, sd = fresh_state(ex)
dcp.load(sd, checkpoint_id={ckpt!r})
model.load_state_dict(sd["model"])
opt.load_state_dict(sd["optim"])
print("DIGEST", ex.state_digest(model, opt), flush=True)
if world > 1:
    dist.barrier()
    dist.destroy_process_group()
os._exit(0)  # the digest is out; torch's teardown is not what is tested (test_fsdp.py's LOAD)
"""
"""Loads checkpoint {ckpt} with stock ``dcp.load`` into :func:`fresh_state` and prints the
example's digest (format with repo, store, ckpt; env RANK and WORLD_SIZE)."""


def load_digests(tmp_path: Path, ckpt: Path, worlds: tuple[int, ...]) -> list:
    """Load ``ckpt`` with stock dcp.load in one gloo group per world size (one after the
    other, :func:`~tests._support.ranks.run_ranks`); each process's digests."""
    from tests._support.ranks import run_ranks

    out = []
    for world in worlds:
        store = tmp_path / f"pg{world}.store"
        script = LOAD_SCRIPT.format(repo=str(REPO), store=str(store), ckpt=str(ckpt))
        run = run_ranks(tmp_path, [], world=world, code=script, tag=f"load{world}", timeout=180)
        assert run.codes == [0] * world, [t[-2000:] for t in run.outputs]
        out += [re.findall(r"DIGEST (\w+)", t) for t in run.outputs]
    return out


def same_as_saved(ck: object, sources: list) -> None:  # type: ignore[type-arg]
    """Each rank of ``sources`` reads back from ``ck`` exactly the bytes it saved."""
    from ftmem.client.flatten import parse_layout
    from ftmem.format.tensors import decode_skeleton
    from ftmem.shm import MappedSegment
    from ftmem.tiers.disk_restore import load_rank

    for src in sources:
        snap, objects, buf = load_rank(ck, src.rank)  # type: ignore[arg-type]
        orig = parse_layout(src.layout, src.capacity)
        seg = MappedSegment(Path(src.path), src.capacity)
        try:
            assert [t.name for t in snap.tensors] == [t.name for t in orig.tensors]
            for a, b in zip(snap.tensors, orig.tensors, strict=True):
                assert (a.dtype, a.shape) == (b.dtype, b.shape)
                got = bytes(buf.view[a.offset : a.offset + a.nbytes])
                assert got == bytes(seg.view[b.offset : b.offset + b.nbytes]), (src.rank, a.name)
            saved = bytes(seg.view[orig.objects_offset : orig.objects_offset + orig.objects_nbytes])
            assert decode_skeleton(objects) == decode_skeleton(saved)
        finally:
            seg.close()
