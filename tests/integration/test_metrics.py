"""``--ftmem-metrics-port``: a real agent serves Prometheus metrics over HTTP while it runs, with
values that match its SMP's status and its restarts."""

from __future__ import annotations

import re
import time
import urllib.request
from datetime import timedelta

from prometheus_client.parser import text_string_to_metric_families

from ftmem.protocol.smp_client import SmpClient
from ftmem.testing.harness import free_port
from tests._support.launcher import EXAMPLE, TINY, Launcher


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _committed(run_dir: str) -> dict[int, int]:
    with SmpClient(run_dir, timeout=timedelta(seconds=10)) as client:
        ranks = client.status()["ranks"]
    return {int(r): int(e["newest_committed"] or 0) for r, e in ranks.items()}


def test_metrics_show_steps_restarts_and_the_recovery(launcher_env: Launcher) -> None:
    port = free_port()
    agent = launcher_env.single_node(
        launcher_env.new_run_id(),
        2,
        [
            "--ftmem-metrics-port",
            str(port),
            "--ftmem-metrics-addr",
            "127.0.0.1",
            "--ftmem-status-interval",
            "0.2",
        ],
        [
            str(EXAMPLE),
            "--steps",
            "100000",
            *TINY,
            "--in-process",
            "--step-delay",
            "0.2",
            "--fail-at-step",
            "6",
            "--fail-rank",
            "1",
        ],
    )
    agent.wait_for(r"Prometheus metrics at http://127.0.0.1:\d+/metrics", 60)
    agent.wait_for(r"RESUMED after signal SIGKILL", 120)
    agent.wait_for(r"step 10 loss", 60, count=2)
    run_dir = str(launcher_env.tmp / "agent-rd")
    deadline = time.monotonic() + 30
    while True:  # the poller's newest status must be one fetched after the restart
        before = _committed(run_dir)
        got = _scrape(port)
        after = _committed(run_dir)
        n0 = (("node", "n0"),)
        if got.get(("ftmem_committed_step", (("node", "n0"), ("rank", "1"))), 0) > 6:
            break
        assert time.monotonic() < deadline, got
        time.sleep(0.2)
    for rank in (0, 1):
        value = got[("ftmem_committed_step", (("node", "n0"), ("rank", str(rank))))]
        # the poller's status is at most a poll (0.2 s, ~1 step) older than the scrape
        assert before[rank] - 3 <= value <= after[rank], (rank, before, value, after)
        assert got[("ftmem_snapshot_commits_total", (("node", "n0"), ("rank", str(rank))))] > 0
        assert got[("ftmem_slot_bytes", (("node", "n0"), ("rank", str(rank))))] > 0
    assert got[("ftmem_restarts_total", (("cause", "rank_exit"), ("node", "n0")))] == 1
    assert got[("ftmem_restarts_total", (("cause", "hang"), ("node", "n0")))] == 0
    assert got[("ftmem_ranks_rejoined_in_process_total", n0)] == 1
    assert 0 < got[("ftmem_recovery_seconds", n0)] < 120
    phases = {dict(k[1])["phase"] for k in got if k[0] == "ftmem_recovery_phase_seconds"}
    assert {"stop", "rendezvous", "start", "script", "load", "first_step"} <= phases
    assert got[("ftmem_smp_rss_bytes", n0)] > 1 << 20
    assert re.search(r"\[n0\] generation 1: started ranks", agent.text())
    agent.kill_all()
