"""Sharded snapshots under DDP: each of D ranks saves 1/D of the replicated parameters and
optimizer state (plus its own per-rank state); after a SIGKILL and a restart, load gathers the
rows back from every rank and the run ends bitwise equal to one without failure."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.protocol.smp_client import SmpClient
from ftmem.smp.spawn import SmpProcess
from tests._support.ranks import SMALL, run_ranks


def reference(workdir: Path, world: int) -> str:
    """Digest of a failure-free plain-torch run (one retry: see test_rank_kill.baseline_run)."""
    for attempt in range(2):
        run = run_ranks(
            workdir, [*SMALL, "--no-ftmem"], world=world, tag=f"ref{attempt}", timeout=90
        )
        if run.codes == [0] * world:
            break
    assert run.codes == [0] * world, run.outputs
    (digest,) = run.digests()
    return digest


def held_bytes(run_dir: Path, world: int, step: int) -> list[tuple[int, int]]:
    """Per rank: (bytes of its chunks of replicated tensors, bytes of everything else) in
    its snapshot of ``step``."""
    out = []
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:
        for rank in range(world):
            snaps = c.query(rank)
            layout = json.loads(next(s for s in snaps if s.step == step).layout)
            chunked = sum(t["nbytes"] for t in layout["tensors"] if "chunk" in t)
            other = sum(t["nbytes"] for t in layout["tensors"] if "chunk" not in t)
            out.append((chunked, other))
    return out


# World 4 only: every 2-rank DDP run of the launcher tests saves 1/2 already (the default).
@pytest.mark.parametrize("world", [4])
def test_each_rank_saves_1_over_d_and_a_restart_restores_bitwise(
    run_dir: Path, smp: SmpProcess, world: int
) -> None:
    expect = reference(run_dir, world)
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    args = [*SMALL, "--fail-at-step", "12", "--fail-rank", str(world - 1)]
    first = run_ranks(run_dir, args, world=world, env_extra=env, tag="first")
    assert first.codes[world - 1] == -9, first.outputs

    held = held_bytes(run_dir, world, 12)
    replicated = sum(c for c, _ in held)
    # Every rank holds about 1/D of the replicated bytes (split between rows of a tensor)...
    for chunked, _ in held:
        assert abs(chunked - replicated / world) <= 0.02 * replicated, held
    # ...and its own per-rank state in full (RNG, buffers), which is small next to it here.
    assert all(other < 0.1 * replicated for _, other in held), held
    # ftmem status shows both: what each rank holds, what it would hold without sharding.
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:
        ranks = c.status().ranks
    for rank, (chunked, other) in enumerate(held):
        r = ranks[rank]
        assert r.snapshot_bytes >= chunked + other
        assert r.unsharded_bytes >= r.snapshot_bytes + (replicated - chunked)

    second = run_ranks(run_dir, args, world=world, env_extra=env, tag="second")
    assert second.codes == [0] * world, second.outputs
    assert second.resumed() == [12] * world
    assert second.digests() == {expect}


def test_no_shard_saves_everything_on_every_rank(run_dir: Path, smp: SmpProcess) -> None:
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    args = [*SMALL, "--steps", "3"]
    run = run_ranks(run_dir, [*args, "--no-shard"], env_extra=env, tag="full")
    assert run.codes == [0, 0], run.outputs
    full = held_bytes(run_dir, 2, 3)
    assert all(chunked == 0 for chunked, _ in full), full
    run = run_ranks(run_dir, [*args, "--steps", "6"], env_extra=env, tag="sharded")
    assert run.codes == [0, 0], run.outputs
    sharded = held_bytes(run_dir, 2, 6)
    # Sharding on: each rank holds about half of what it held without.
    total_full = sum(c + o for c, o in full) / 2
    for chunked, other in sharded:
        assert chunked + other < 0.6 * total_full, (full, sharded)
