"""No spare left: the job shrinks onto the surviving machines and grows back, from memory.

Network-namespace hosts, one rank each, ``--nnodes 3:4`` and erasure coding (m=1): a
machine dies and no spare comes within the rendezvous' last call, so the three survivors
rebuild its protected step in a guest SMP from their data and parity, form a 3-node job and
reshard that step through DCP into 3 ranks. Later a fifth machine joins and the job grows to
4 again, resharding from memory. After each reshard the ranks hold what stock ``dcp.load``
of the same step gives at the new size (bitwise). The training is an epoch of numbered
samples under ``ftmem.ElasticSampler`` (tests/_support/elastic_train.py). Also here: an FSDP2
job that shrinks and grows back, and a loss of more machines than the parity covers (the
survivors reshard the shared tier's flushed checkpoint).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.smp.spawn import SmpProcess
from tests._support.launcher import TINY, Launcher
from tests._support.machines import events, finish, machines
from tests._support.procs import REPO
from tests._support.ranks import run_ranks

ELASTIC = REPO / "tests" / "_support" / "elastic_train.py"
SAMPLES = 600


def _seen(text: str, after: int = 0, upto: int | None = None) -> list[int]:
    """The samples of the SEEN lines of ``text`` with ``after < step <= upto``."""
    out = []
    for step, line in re.findall(r"SEEN (\d+) ([\d ]+)", text):
        if int(step) > after and (upto is None or int(step) <= upto):
            out += [int(i) for i in line.split()]
    return out


@pytest.mark.timeout(600)
def test_a_lost_machine_without_a_spare_shrinks_the_job_and_a_new_one_grows_it_back(
    launcher_env: Launcher, smp: SmpProcess, run_dir: Path, tmp_path: Path
) -> None:
    command = [str(ELASTIC), "--samples", str(SAMPLES), "--step-delay", "0.2"]
    with machines(
        launcher_env,
        5,
        4,
        min_nodes=3,
        command=command,
        # No last_call_timeout: the first round waits for all 4 nodes (elastic's 30 s last
        # call), the re-join after the loss goes on with the survivors after ftmem's 1 s.
        # Protection lags the ranks' commits (as on a loaded machine): the survivors hold
        # newer steps of the 4-rank job than the one the old mesh kept.
        extra=["--ftmem-tune", "ec-interval=1.5"],
    ) as m:
        m.start(0).wait_log(r"SMP pid \d+ ready", 120)
        for i in (1, 2, 3):
            m.start(i)
        for i in range(4):
            m.agents[i].wait_log(r"generation 0: started ranks", 120)
        m.agents[0].wait_log(r"SEEN 8 ", 120)
        # Lost silently (link first, then every process): no FIN, no RST; the survivors'
        # ranks sit in a collective until the failure detectors declare the machine lost.
        m.hosts.cut(3)
        m.hosts.kill(3)
        # What the lost machine's rank printed, from its stdout file: the agent's copy to its
        # console can miss the last lines when the machine dies (they were written, and
        # trained on).
        lost_text = "".join(
            p.read_text() for p in sorted(m.run_dir(3).glob("logs/*/attempt_*/*/stdout.log"))
        )
        kept = int(m.agents[0].wait_log(r"the old mesh kept step (\d+)", 180)[0].group(1))
        for i in range(3):
            m.agents[i].wait_log(r"RESHAPE: the job shrinks from 4 to 3 nodes", 5)
            m.agents[i].wait_log(rf"LOADED {kept} ", 120)
        guest_host = next(
            i
            for i in range(3)
            if re.search(r"lost slots \[3\] rebuilt here: \[3\]", m.agents[i].text())
        )
        guest = f"h{guest_host}-guest3"
        assert f"[{guest}] REBUILT step {kept} of this node" in m.agents[guest_host].text()
        loaded = {re.findall(rf"LOADED {kept} (\w+)", m.agents[i].text())[-1] for i in range(3)}
        assert len(loaded) == 1, loaded
        # The job grows back: a fifth machine joins the running 3-node job.
        m.agents[0].wait_log(rf"SEEN {kept + 6} ", 120)
        m.start(4)
        m.agents[4].wait_log(r"RESHAPE: the job grows from 3 to 4 nodes", 180)
        grown = int(m.agents[4].wait_log(r"LOADED (\d+) ", 120)[0].group(1))
        for i in range(3):
            m.agents[i].wait_log(rf"LOADED {grown} ", 60)
        finish(m, [0, 1, 2, 4], timeout=300)
        texts = [m.agents[i].text() for i in (0, 1, 2, 4)]
        for i in range(3):
            assert events(m.run_dir(i), name="reshape"), m.agents[i].text()[-3000:]
        finals = {f for t in texts for f in re.findall(r"FINAL \d+ (\w+)", t)}
        assert len(finals) == 1, finals
        regrown = {re.findall(rf"LOADED {grown} (\w+)", t)[-1] for t in texts}
        assert len(regrown) == 1, regrown

    # The samples trained on: the 4-node steps up to the kept one, the 3-node steps up to the
    # one the grown job resharded, then the 4-node steps after it.
    first = [t.split("RESHAPE")[0] for t in [*texts[:3], lost_text]]
    middle = [t.split("RESHAPE")[1] for t in texts[:3]]
    last = [t.split("RESHAPE")[-1] for t in texts]
    seen = [i for t in first for i in _seen(t, upto=kept)]
    seen += [i for t in middle for i in _seen(t, after=kept, upto=grown)]
    seen += [i for t in last for i in _seen(t, after=grown)]
    # None twice, and all but the epoch's last samples that do not fill a round of 4 ranks
    # (dropped as DistributedSampler(drop_last=True) drops them; how many depends on where
    # the world changed): the failure-free 4-rank run sees all of them.
    from ftmem import ElasticSampler

    assert len(seen) == len(set(seen)), sorted(i for i in seen if seen.count(i) > 1)
    tail = ElasticSampler(SAMPLES, seed=7).order()[len(seen) :]
    assert set(range(SAMPLES)) - set(seen) == set(tail) and len(tail) < 4, tail

    # Right after each reshard, the ranks held what stock dcp.load of the same step, flushed,
    # gives at the new size. The same history without failures: 4 ranks to the kept step,
    # then (resharded) 3 ranks to the step the job grew at.
    from ftmem.protocol.smp_client import SmpClient
    from ftmem.tiers.export import RankSource, export_dcp, find_sources

    env = {"FTMEM_RUN_DIR": str(run_dir)}
    args = ["--samples", str(SAMPLES), "--stop-after", str(kept)]
    ref = run_ranks(run_dir, args, world=4, env_extra=env, tag="ref", script=ELASTIC)
    assert ref.codes == [0] * 4, ref.outputs
    flushed = tmp_path / f"step{kept}"
    export_dcp(find_sources([run_dir], step=kept), flushed)
    args = ["--samples", str(SAMPLES), "--stop-after", str(grown), "--compare-dcp", str(flushed)]
    cmp = run_ranks(run_dir, args, world=3, env_extra=env, tag="cmp", script=ELASTIC)
    assert cmp.codes == [0] * 3, cmp.outputs
    assert set(cmp.lines(r"DCP (\w+)")) == loaded, (cmp.outputs, loaded)
    flushed = tmp_path / f"step{grown}"
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as c:  # (rank 3: dropped, empty)
        sources = [
            RankSource(r, grown, s.path, s.capacity, s.layout)
            for r in range(3)
            for s in c.query(r)
            if s.step == grown
        ]
    export_dcp(sources, flushed)
    args = ["--samples", str(SAMPLES), "--stop-after", str(grown), "--compare-dcp", str(flushed)]
    cmp = run_ranks(run_dir, args, world=4, env_extra=env, tag="cmp4", script=ELASTIC)
    assert cmp.codes == [0] * 4, cmp.outputs
    assert set(cmp.lines(rf"LOADED {grown} (\w+)")) == regrown, (cmp.outputs, regrown)
    assert set(cmp.lines(r"DCP (\w+)")) == regrown, (cmp.outputs, regrown)


@pytest.mark.timeout(400)
def test_an_fsdp2_job_shrinks_from_3_machines_to_2_and_grows_back_from_memory(
    launcher_env: Launcher,
) -> None:
    """FSDP2 (DTensor shards, one rank per machine) on 3 machines, ``--nnodes 2:3``: a machine
    dies, a survivor's guest SMP rebuilds its shards from parity, and the 2 ranks reshard the
    kept step from memory; then a new machine joins, the job grows back to 3 and every rank
    reshards the newest step; it trains to the end, in agreement. (That such a reshard equals
    stock ``dcp.load`` at the new size is tests/faults/test_fsdp.py's.)"""
    fsdp = REPO / "examples" / "train_fsdp.py"
    command = [str(fsdp), "--steps", "200", "--step-delay", "0.1", *TINY]
    with machines(launcher_env, 4, 3, min_nodes=2, command=command) as m:
        m.start(0).wait_log(r"SMP pid \d+ ready", 120)
        m.start(1)
        m.start(2)
        m.wait_step(0, 8)
        m.hosts.cut(2)  # silently: the link first
        m.hosts.kill(2)
        kept = int(m.agents[0].wait_log(r"the old mesh kept step (\d+)", 180)[0].group(1))
        for i in (0, 1):
            m.agents[i].wait_log(r"RESHAPE: the job shrinks from 3 to 2 nodes", 5)
            m.agents[i].wait_log(rf"\[rank {i}\] resumed from step {kept}", 120)
        m.start(3)  # a new machine: it takes the free slot (ranks 2)
        m.agents[3].wait_log(r"RESHAPE: the job grows from 2 to 3 nodes", 180)
        grown = m.agents[3].wait_log(r"\[rank 2\] resumed from step (\d+)", 120)[0].group(1)
        for i in (0, 1):
            m.agents[i].wait_log(rf"\[rank {i}\] resumed from step {grown}", 60)
        assert len(set(finish(m, [0, 1, 3]).values())) == 1


@pytest.mark.timeout(400)
def test_more_machines_lost_than_parity_covers_shrinks_from_the_flushed_checkpoint(
    launcher_env: Launcher, smp: SmpProcess, run_dir: Path
) -> None:
    """4 machines, erasure coding m=1, ``--nnodes 2:4``, a shared tier flushed every 4 steps:
    two machines die together. Memory cannot serve their ranks (2 > m), so the survivors
    start no guest and their 2 ranks reshard the newest flushed (assembled) checkpoint of
    the 4-rank job; right after the load they hold what stock ``dcp.load`` of it gives at 2
    ranks, and the job ends in agreement."""
    from ftmem.tiers.checkpoints import list_checkpoints

    shared = launcher_env.tmp / "shared"
    samples = ["--samples", "240"]
    gate = launcher_env.tmp / "gate"  # the 4-rank job cannot end before the machines die
    command = [str(ELASTIC), *samples, "--step-delay", "0.2", "--gate", str(gate)]
    flags = ["--ftmem-flush-persistent-dir", str(shared), "--ftmem-flush-every", "4"]
    with machines(
        launcher_env,
        4,
        4,
        min_nodes=2,
        command=command,
        extra=[*flags, "--ftmem-flush-keep", "100"],
    ) as m:
        m.start(0).wait_log(r"SMP pid \d+ ready", 120)
        for i in (1, 2, 3):
            m.start(i)
        deadline = time.monotonic() + 120
        while not list_checkpoints(shared)[0]:  # an assembled checkpoint of all 4 ranks
            assert time.monotonic() < deadline, "no checkpoint assembled in the shared tier"
            time.sleep(0.2)
        m.hosts.cut(2)  # silently: both links first
        m.hosts.cut(3)
        m.hosts.kill(2)
        m.hosts.kill(3)
        gate.touch()
        for i in (0, 1):
            a = m.agents[i]
            # Which two slots: the machines may join in rounds of 2 to 4 nodes (min 2), and a
            # node's slot comes from the rendezvous, not from its host's number.
            a.wait_log(r"RESHAPE: the job shrinks from 4 to 2 nodes \(lost slots \[\d, \d\]\)", 180)
            a.wait_log(r"2 slots lost, erasure coding covers 1", 5)
        loaded = [m.agents[i].wait_log(r"LOADED (\d+) (\w+)", 120, count=2)[1] for i in (0, 1)]
        assert len({(x.group(1), x.group(2)) for x in loaded}) == 1, loaded
        step = int(loaded[0].group(1))
        assert "resharding the flushed checkpoint" in m.agents[0].text()
        assert "REBUILT" not in m.agents[0].text() + m.agents[1].text()
        finish(m, [0, 1], timeout=300)
        finals = {f for i in (0, 1) for f in re.findall(r"FINAL \d+ (\w+)", m.agents[i].text())}
        assert len(finals) == 1, finals

    # Stock dcp.load of that checkpoint at 2 ranks (a fresh job: nothing in memory).
    ckpt = shared / f"step_{step:010d}"
    args = [*samples, "--stop-after", "1", "--compare-dcp", str(ckpt)]
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    cmp = run_ranks(run_dir, args, world=2, env_extra=env, tag="cmp", script=ELASTIC)
    assert cmp.codes == [0, 0], cmp.outputs
    assert set(cmp.lines(r"DCP (\w+)")) == {loaded[0].group(2)}, cmp.outputs
