"""In-process restart (``ftmem.run``) under real failures: the survivors keep their process.

The test workload's ``--in-process`` runs its loop under ``ftmem.run``. A rank is SIGKILLed
or SIGSTOPped (then killed as hung) mid-run; the other ranks must rejoin the next generation
in the same process (same pid), only the failed rank is a new process, and the run must end
with the digest of the same run without failures. A survivor that fails during the rejoin
makes the next restart cold; ``ftmem.run`` outside ftmem-launch is a clear error. The
2-rank run also checks the agent's Prometheus metrics (``--ftmem-metrics-port``) over HTTP.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftmem.protocol.smp_client import SmpClient
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    Launch,
    Launcher,
    digests,
    free_port,
    launch_args,
)
from tests._support.nodes import STEPS, reference
from tests._support.procs import REPO

STARTED = r"\[(\w+)\] generation (\d+): started ranks \[([0-9, ]+)\] \(pids \[([0-9, ]+)\]"
SCRIPT = [str(WORKLOAD), "--steps", str(STEPS), *TINY, "--in-process", "--step-delay", "0.05"]
FLAGS = ["--ftmem-status-interval", "0.2", "--ftmem-rejoin-timeout", "60"]


def _generations(text: str) -> dict[int, dict[int, int]]:
    """generation -> {global rank: pid} from the agent's "started ranks" lines."""
    out: dict[int, dict[int, int]] = {}
    for m in re.finditer(STARTED, text):
        ranks = [int(r) for r in m.group(3).split(",")]
        pids = [int(p) for p in m.group(4).split(",")]
        out.setdefault(int(m.group(2)), {}).update(zip(ranks, pids, strict=True))
    return out


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _check_in_process(text: str, failed: int, nranks: int) -> None:
    """Generation 1 kept every rank's process but ``failed``'s."""
    gens = _generations(text)
    assert sorted(gens) == [0, 1], (gens, text[-3000:])
    first, second = gens[0], gens[1]
    assert sorted(first) == sorted(second) == list(range(nranks))
    for rank in range(nranks):
        if rank == failed:
            assert second[rank] != first[rank]
        else:
            assert second[rank] == first[rank], f"rank {rank} is a new process: {gens}"


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _committed(run_dir: Path) -> dict[int, int]:
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as client:
        ranks = client.status().ranks
    return {r: e.newest_committed or 0 for r, e in ranks.items()}


def _check_metrics(port: int, run_dir: Path) -> None:
    """The agent's Prometheus metrics (--ftmem-metrics-port) while the run goes on after the
    in-process restart: steps as the SMP reports them, the restart, the recovery's phases."""
    n0 = (("node", "n0"),)
    deadline = time.monotonic() + 30
    while True:  # the poller's status must be one fetched after the ranks stepped again
        before = _committed(run_dir)
        got = _scrape(port)
        after = _committed(run_dir)
        if got.get(("ftmem_committed_step", (*n0, ("rank", "1"))), 0) > 12:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    for rank in (0, 1):
        value = got[("ftmem_committed_step", (*n0, ("rank", str(rank))))]
        # the poller's status is at most a poll (0.2 s, a few steps) older than the scrape
        assert before[rank] - 8 <= value <= after[rank], (rank, before, value, after)
        assert got[("ftmem_snapshot_commits_total", (*n0, ("rank", str(rank))))] > 0
        assert got[("ftmem_slot_bytes", (*n0, ("rank", str(rank))))] > 0
    assert got[("ftmem_restarts_total", (("cause", "rank_exit"), *n0))] == 1
    assert got[("ftmem_restarts_total", (("cause", "hang"), *n0))] == 0
    assert got[("ftmem_ranks_rejoined_in_process_total", n0)] == 1
    assert 0 < got[("ftmem_recovery_seconds", n0)] < 120
    phases = {dict(k[1])["phase"] for k in got if k[0] == "ftmem_recovery_phase_seconds"}
    assert {"stop", "rendezvous", "start", "script", "load", "first_step"} <= phases
    assert got[("ftmem_smp_rss_bytes", n0)] > 1 << 20


def test_two_ranks_sigkill_survivor_rejoins_in_process(launcher_env: Launcher) -> None:
    ref = reference(launcher_env, 2)
    port = free_port()
    metrics = ["--ftmem-metrics-port", str(port), "--ftmem-metrics-addr", "127.0.0.1"]
    agent = launcher_env.single_node(
        launcher_env.new_run_id(),
        2,
        [*FLAGS, *metrics],
        # slower steps after the failure leave time to scrape the metrics while it runs
        [*SCRIPT, "--fail-at-step", "12", "--fail-rank", "1", "--step-delay", "0.15"],
    )
    agent.wait_for(r"RESUMED after signal SIGKILL", 120)
    _check_metrics(port, launcher_env.tmp / "agent-rd")
    assert agent.wait(180) == 0, agent.text()[-3000:]
    text = agent.text()
    _check_in_process(text, failed=1, nranks=2)
    assert re.search(r"rejoined in process: ranks \[0\]", text), text[-3000:]
    assert re.search(r"\[rank 0\] rejoined in process \(generation 1", text), text[-3000:]
    assert text.count("resumed from step 12") == 2
    assert digests(text) == ref
    events = _events(launcher_env.tmp / "agent-rd")
    started = [e for e in events if e["event"] == "ranks_started"]
    assert [e["in_process"] for e in started] == [[], [0]]
    assert any(e["event"] == "resumed" for e in events)


def test_four_ranks_sigstop_hang_is_killed_and_the_rest_rejoin(launcher_env: Launcher) -> None:
    ref = reference(launcher_env, 4)
    agent = launcher_env.single_node(
        launcher_env.new_run_id(),
        4,
        [*FLAGS, "--ftmem-hang-timeout", "6"],
        [*SCRIPT, "--fail-at-step", "12", "--fail-rank", "2", "--fail-mode", "hang"],
    )
    assert agent.wait(240) == 0, agent.text()[-3000:]
    text = agent.text()
    # only the stopped rank is killed as hung; the others fail their collective and stay
    assert re.search(r"\[n0/2\] HANG: .*process state T\); SIGKILL pid \d+\n", text), text[-3000:]
    _check_in_process(text, failed=2, nranks=4)
    assert text.count("resumed from step 12") == 4
    assert digests(text) == ref


def test_two_nodes_rank_killed_survivors_on_both_nodes_rejoin(launcher_env: Launcher) -> None:
    ref = reference(launcher_env, 4)
    rid = launcher_env.new_run_id()
    port = free_port()
    script = [*SCRIPT, "--fail-at-step", "12", "--fail-rank", "3"]

    def node(name: str, host: bool) -> Launch:
        args = launch_args(
            nnodes=2,
            nproc=2,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_id=rid,
            is_host=host,
            node=name,
            run_dir=launcher_env.tmp / f"{name}-rd",
            flags=FLAGS,
            script=script,
        )
        return launcher_env.start(args, name)

    a = node("a", True)
    a.wait_for(r"SMP pid \d+ ready", 60)
    b = node("b", False)
    assert a.wait(240) == 0 and b.wait(60) == 0, a.text()[-2500:] + b.text()[-2500:]
    gens_a, gens_b = _generations(a.text()), _generations(b.text())
    assert sorted(gens_a) == sorted(gens_b) == [0, 1], (gens_a, gens_b)
    assert gens_a[1] == gens_a[0] and sorted(gens_a[1]) == [0, 1]  # node a: both kept
    assert gens_b[1][2] == gens_b[0][2] and gens_b[1][3] != gens_b[0][3]  # node b: rank 3 new
    both = a.text() + b.text()
    assert both.count("resumed from step 12") == 4
    assert {**digests(a.text()), **digests(b.text())} == ref


def test_survivor_failing_during_its_rejoin_falls_back_to_a_cold_restart(
    launcher_env: Launcher,
) -> None:
    ref = reference(launcher_env, 2)
    agent = launcher_env.single_node(
        launcher_env.new_run_id(),
        2,
        FLAGS,
        [*SCRIPT, "--fail-at-step", "12", "--fail-rank", "1"],
        FTMEM_FAULT="in_rejoin:rank=0:fault=crash",
    )
    assert agent.wait(240) == 0, agent.text()[-3000:]
    text = agent.text()
    gens = _generations(text)
    assert sorted(gens) == [0, 1, 2], (gens, text[-3000:])
    assert gens[1][0] == gens[0][0]  # kept, then it crashed in its rejoin ...
    assert gens[2][0] != gens[0][0] and gens[2][1] != gens[1][1]  # ... so every rank is new
    assert re.search(r"\[n0/0\] FAILED: exit code 1 \(generation 1\)", text), text[-3000:]
    # its traceback is in its log of generation 0 (it crashed before it got its new one)
    logs = list((launcher_env.tmp / "agent-rd" / "logs").glob("*/attempt_0/0/stderr.log"))
    assert len(logs) == 1 and "InjectedCrash" in logs[0].read_text()
    assert digests(text) == ref


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--in-process"], "ftmem.run restarts ranks in process and needs ftmem-launch"),
        ([], "this rank was started by torchrun, not by ftmem-launch"),
    ],
    ids=["ftmem.run", "ftmem.load"],
)
def test_ftmem_under_plain_torchrun_is_a_clear_error(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    """The likeliest first mistake: the script started with torchrun, not ftmem-launch."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "1",
        str(WORKLOAD),
        "--steps",
        "2",
        *TINY,
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTMEM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode != 0
    assert says in out.stderr + out.stdout
    assert "the same command with `ftmem-launch`" in out.stderr + out.stdout
