"""A step held in the memory of two hosts' SMPs, loaded by DCP into another world size across
hosts (``MemoryCheckpoint`` with a process group): each loader maps only its own host's slots,
a loader on a host that holds nothing (a machine that joins) gets everything from the others,
and every loader ends with the saved state, bit for bit.

The two hosts are two SMPs with run directories of their own; each loader is given only the
slots of its host's SMP, so every byte it did not map crossed the process group."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ftmem.smp.spawn import SmpProcess
from tests._support.procs import REPO
from tests._support.ranks import SMALL, RankRun, run_ranks

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
    two_hosts: list[Path], tmp_path: Path
) -> None:
    a, b = two_hosts
    run = run_ranks(
        tmp_path,
        SMALL,
        rank_env=[{"FTMEM_RUN_DIR": str(a)}, {"FTMEM_RUN_DIR": str(b)}],
    )
    assert run.codes == [0, 0], run.outputs
    (digest,) = run.digests()

    hosts = [str(a), str(b), ""]  # loader 2 is on a host that holds nothing
    store = tmp_path / "pg.store"
    script = LOAD.format(repo=str(REPO), store=str(store), saved=2)
    rank_env = [{"LOADER_HOST": host} for host in hosts]
    load = run_ranks(tmp_path, [], world=3, code=script, tag="load", rank_env=rank_env)
    assert load.codes == [0] * 3, [t[-2000:] for t in load.outputs]
    texts = load.outputs
    assert [re.findall(r"DIGEST (\w+)", t) for t in texts] == [[digest]] * 3, texts
    mapped = [int(re.findall(r"MAPPED (\d+)", t)[0]) for t in texts]
    assert mapped[0] > 0 and mapped[1] > 0 and mapped[2] == 0, mapped


@pytest.mark.timeout(300)
def test_a_smaller_job_reshards_the_step_from_memory_in_ftmem_load(
    smp: SmpProcess, run_dir: Path
) -> None:
    """4 ranks save (1/4 of the replicated state each); 3 ranks restarting on the same SMP
    load it with plain ``ftmem.load``: the saved sharding says the job's size changed, so
    the step is resharded from memory through DCP (not refused, not restored wrongly). Their
    parameters and optimizer state are the 4-rank run's (its digest: the run trains no
    further step). The per-rank RNG states reshard through ``RNGState``'s own method."""
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    first = run_ranks(run_dir, SMALL, world=4, env_extra=env, tag="w4", timeout=240)
    assert first.codes == [0] * 4, first.outputs
    (digest,) = first.digests()
    smaller = run_ranks(run_dir, SMALL, world=3, env_extra=env, tag="w3", timeout=240)
    assert smaller.codes == [0] * 3, smaller.outputs
    steps = SMALL[SMALL.index("--steps") + 1]
    for out in smaller.outputs:
        assert f"resharded step {steps} from 4 to 3 ranks" in out, out[-3000:]
        assert f"resumed from step {steps}" in out, out[-3000:]
    assert smaller.digests() == {digest}, smaller.outputs


ELASTIC = REPO / "tests" / "_support" / "elastic_train.py"


def _sources(run_dir: Path, step: int, ranks: int) -> list[Any]:
    """The committed slots of ``step`` of ranks ``0..ranks-1`` in the SMP of ``run_dir``."""
    from ftmem.protocol.smp_client import SmpClient
    from ftmem.tiers.export import RankSource

    out = []
    with SmpClient(run_dir) as c:
        for r in range(ranks):
            s = next(s for s in c.query(r) if s.step == step)
            out.append(RankSource(r, step, s.path, s.capacity, s.layout))
    return out


def _seen(outputs: list[str]) -> list[int]:
    return [
        int(i)
        for out in outputs
        for line in re.findall(r"SEEN \d+ (.*)", out)
        for i in line.split()
    ]


@pytest.mark.timeout(400)
def test_an_epoch_shrinks_from_4_to_3_ranks_and_grows_back_from_memory(
    smp: SmpProcess, run_dir: Path, tmp_path: Path
) -> None:
    """An epoch of 48 numbered samples (``ftmem.ElasticSampler``): 4 ranks train 3 steps and
    stop, 3 ranks go on from memory for 2 steps and stop, 4 ranks finish the epoch from
    memory. Right after each ``ftmem.load`` every rank's parameters and optimizer state equal
    stock ``dcp.load`` of the flushed step at the new world size, and over the epoch every
    sample is trained on exactly once (as in a run without the changes)."""
    from ftmem.tiers.export import export_dcp

    env = {"FTMEM_RUN_DIR": str(run_dir)}
    runs: list[RankRun] = []
    for world, stop, flushed_step in ((4, 3, 0), (3, 5, 3), (4, 0, 5)):
        args = ["--stop-after", str(stop)] if stop else []
        if flushed_step:
            flushed = tmp_path / f"step{flushed_step}"
            export_dcp(_sources(run_dir, flushed_step, ranks=len(runs[-1].codes)), flushed)
            args += ["--compare-dcp", str(flushed)]
        run = run_ranks(run_dir, args, world=world, env_extra=env, tag=f"w{world}", script=ELASTIC)
        assert run.codes == [0] * world, run.outputs
        loaded = run.lines(r"LOADED (\d+ \w+)")
        assert len(set(loaded)) == 1 and loaded[0].startswith(f"{flushed_step} "), loaded
        if flushed_step:
            assert set(run.lines(r"DCP (\w+)")) == {loaded[0].split()[1]}, run.outputs
        runs.append(run)
    seen = [i for run in runs for i in _seen(run.outputs)]
    assert sorted(seen) == list(range(48)), sorted(seen)


@pytest.mark.timeout(300)
def test_a_per_rank_entry_without_a_reshard_method_is_refused_clearly(
    smp: SmpProcess, run_dir: Path
) -> None:
    """An entry whose state differs between the ranks that saved (here each rank's number)
    and that has no ``load_resharded_state`` cannot be resharded: ``ftmem.load`` says which
    entry and what to do, before anything is loaded."""
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    args = ["--stop-after", "2", "--per-rank"]
    first = run_ranks(run_dir, args, world=4, env_extra=env, tag="w4", script=ELASTIC)
    assert first.codes == [0] * 4, first.outputs
    second = run_ranks(run_dir, args, world=3, env_extra=env, tag="w3", script=ELASTIC)
    assert all(c != 0 for c in second.codes), second.outputs
    for out in second.outputs:
        assert "state['data'] (PerRank) differs between the 4 ranks that saved step 2" in out, out
        assert "load_resharded_state" in out and "LOADED" not in out, out[-3000:]


@pytest.mark.timeout(300)
def test_when_memory_lacks_a_rank_the_flushed_checkpoint_is_resharded(
    two_hosts: list[Path], tmp_path: Path
) -> None:
    """ftmem-launch asks 3 ranks to reshard a 4-rank step (``$FTMEM_RESHARD``) but their
    SMP holds none of it (more machines were lost than the erasure code covers). Without a
    disk tier the error says so; with one, the newest flushed checkpoint of the 4-rank job is
    verified and resharded by ``dcp.load``, equal to stock ``dcp.load`` of it at 3 ranks."""
    from ftmem.protocol.rejoin import ReshardRequest
    from ftmem.tiers.checkpoints import checkpoint_name
    from ftmem.tiers.export import export_dcp, find_sources

    a, b = two_hosts
    args = ["--stop-after", "3"]
    first = run_ranks(
        a, args, world=4, env_extra={"FTMEM_RUN_DIR": str(a)}, tag="w4", script=ELASTIC
    )
    assert first.codes == [0] * 4, first.outputs
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    flushed = tier / checkpoint_name(3)
    export_dcp(find_sources([a], step=3), flushed)
    env = {"FTMEM_RUN_DIR": str(b), "FTMEM_RESHARD": ReshardRequest(4).to_env()}
    lost = run_ranks(b, args, world=3, env_extra=env, tag="none", script=ELASTIC)
    assert all(c != 0 for c in lost.codes), lost.outputs
    for out in lost.outputs:
        assert "nor is a flushed checkpoint of the 4-rank job" in out, out[-3000:]
    env["FTMEM_FLUSH_DIRS"] = str(tier)
    args += ["--compare-dcp", str(flushed)]
    disk = run_ranks(b, args, world=3, env_extra=env, tag="disk", script=ELASTIC)
    assert disk.codes == [0] * 3, disk.outputs
    loaded = set(disk.lines(r"LOADED 3 (\w+)"))
    assert len(loaded) == 1 and set(disk.lines(r"DCP (\w+)")) == loaded, disk.outputs
