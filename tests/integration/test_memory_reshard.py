"""A step held in the memory of two hosts' SMPs, loaded by DCP into another world size across
hosts (``MemoryCheckpoint`` with a process group): each loader maps only its own host's slots,
a loader on a host that holds nothing (a machine that joins) gets everything from the others,
and every loader ends with the saved state, bit for bit.

The two hosts are two SMPs with run directories of their own; each loader is given only the
slots of its host's SMP, so every byte it did not map crossed the process group."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ftmem.smp.spawn import SmpProcess
from tests._support.procs import REPO, Procs
from tests._support.ranks import SMALL, run_ranks

LOAD = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
sys.path.insert(0, {repo!r})
from pathlib import Path
from ftmem.tiers.export import find_sources
from ftmem.tiers.memory_dcp import MemoryCheckpoint
from tests._support.example import example, fresh_state
ex = example()
dist.init_process_group("gloo", init_method="file://" + {store!r},
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
host = os.environ["LOADER_HOST"]
sources = find_sources([Path(host)]) if host else []
model, opt, sd = fresh_state(ex)
with MemoryCheckpoint(sources, world_size={saved}, group=dist.group.WORLD) as ckpt:
    print("MAPPED", len(ckpt.items), flush=True)
    dcp.load(sd, storage_reader=ckpt.reader())
model.load_state_dict(sd["model"])
opt.load_state_dict(sd["optim"])
print("DIGEST", ex.state_digest(model, opt), flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_a_step_in_two_hosts_memory_reshards_across_them(
    two_hosts: list[Path], tmp_path: Path, procs: Procs
) -> None:
    a, b = two_hosts
    run = run_ranks(
        procs,
        tmp_path,
        SMALL,
        rank_env=[{"FTMEM_RUN_DIR": str(a)}, {"FTMEM_RUN_DIR": str(b)}],
    )
    assert run.codes == [0, 0], run.outputs
    (digest,) = run.digests()

    hosts = [str(a), str(b), ""]  # loader 2 is on a host that holds nothing
    store = tmp_path / "pg.store"
    script = LOAD.format(repo=str(REPO), store=str(store), saved=2)
    logs, ps = [], []
    for r, host in enumerate(hosts):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="3", OMP_NUM_THREADS="1", LOADER_HOST=host)
        logs.append(tmp_path / f"load{r}.log")
        ps.append(procs.spawn([sys.executable, "-c", script], env, logs[-1]))
    for p in ps:
        assert p.wait(timeout=120) == 0, [log.read_text()[-2000:] for log in logs]
    texts = [log.read_text() for log in logs]
    assert [re.findall(r"DIGEST (\w+)", t) for t in texts] == [[digest]] * 3, texts
    mapped = [int(re.findall(r"MAPPED (\d+)", t)[0]) for t in texts]
    assert mapped[0] > 0 and mapped[1] > 0 and mapped[2] == 0, mapped


@pytest.mark.timeout(300)
def test_a_smaller_job_is_told_to_reshard_and_the_step_in_memory_still_reshards(
    smp: SmpProcess, run_dir: Path, tmp_path: Path, procs: Procs
) -> None:
    """4 ranks save (1/4 each); 3 ranks restarting on the same SMP get a clear error from
    ``ftmem.load`` (not a silent restore), which loses nothing: the step still loads into
    those 3 processes from memory through DCP, with the 4-rank run's digest."""
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    first = run_ranks(procs, run_dir, SMALL, world=4, env_extra=env, tag="w4", timeout=240)
    assert first.codes == [0] * 4, first.outputs
    (digest,) = first.digests()
    again = list(SMALL)
    again[again.index("--steps") + 1] = "30"
    smaller = run_ranks(procs, run_dir, again, world=3, env_extra=env, tag="w3", timeout=240)
    assert all(c != 0 for c in smaller.codes), smaller.outputs
    assert all("the job's size changed" in out for out in smaller.outputs), smaller.outputs

    store = tmp_path / "pg.store"
    script = LOAD.format(repo=str(REPO), store=str(store), saved=4)
    logs, ps = [], []
    for r in range(3):
        env_r = dict(os.environ, RANK=str(r), WORLD_SIZE="3", OMP_NUM_THREADS="1")
        env_r["LOADER_HOST"] = str(run_dir)
        logs.append(tmp_path / f"load{r}.log")
        ps.append(procs.spawn([sys.executable, "-c", script], env_r, logs[-1]))
    for p in ps:
        assert p.wait(timeout=120) == 0, [log.read_text()[-2000:] for log in logs]
    got = [re.findall(r"DIGEST (\w+)", log.read_text()) for log in logs]
    assert got == [[digest]] * 3, [log.read_text()[-2000:] for log in logs]
