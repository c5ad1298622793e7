"""The ranks' TCPStore served by the agent (ftmem.launch.rank_store): real stores, real ranks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from ftmem.launch.config import ENV_DISABLE_SHARED_STORE
from ftmem.launch.rank_store import ENV_USE_AGENT_STORE, RankStore
from tests._support.launcher import free_port

RANK = """
import os, sys, time
import torch, torch.distributed as dist
time.sleep(float(sys.argv[1]))  # rank 0 comes last: nobody but the agent serves the store
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("SUM", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISABLE_SHARED_STORE, "1")


def test_a_fresh_store_per_generation_and_the_old_one_closed(per_round: None) -> None:
    store = RankStore("n0")
    p1, p2 = free_port(), free_port()
    try:
        store.serve("127.0.0.1", p1, 0)
        assert store.port == p1
        assert store.rank_env() == {ENV_USE_AGENT_STORE: "True"}
        first = _client(p1)
        first.set("generation-0-key", "stale")
        store.serve("127.0.0.1", p2, 1)
        assert store.port == p2
        assert not _client(p2).check(["generation-0-key"])  # no key of an earlier generation
        assert _refused(p1)
        del first
    finally:
        store.close()
    assert store.port is None and _refused(p2)


def test_a_taken_port_leaves_rank_0_to_serve(per_round: None) -> None:
    store = RankStore("n0")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        store.serve("127.0.0.1", taken.getsockname()[1], 3)  # logged, not raised
    assert store.port is None
    assert store.rank_env() == {ENV_USE_AGENT_STORE: "False"}
    store.close()  # the next generation, on a node without rank 0: a client again
    assert store.rank_env() == {ENV_USE_AGENT_STORE: "True"}


def test_elastic_shared_store_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISABLE_SHARED_STORE, "0")
    assert RankStore("n0").rank_env() == {}


def test_ranks_meet_at_the_served_store_and_no_rank_serves_it(
    per_round: None, tmp_path: Path
) -> None:
    """Rank 1 calls init_process_group first; rank 0 a second later; the store they meet at
    is this process's, never rank 0's."""
    store = RankStore("n0")
    port = free_port()
    store.serve("127.0.0.1", port, 0)
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    procs = []
    try:
        for rank, delay in ((0, "1.0"), (1, "0")):
            env = {
                **os.environ,
                **store.rank_env(),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), delay],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert all("SUM 3" in out for out in outs), outs
        listeners = {
            c.pid
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
        }
        assert listeners == {os.getpid()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        store.close()
