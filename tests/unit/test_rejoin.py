"""The pieces of in-process restart that need no process: the rejoin order file (its format
and its trust checks), the rank's verdict on an exception, and the kept ranks' deadline."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ftmem.client.in_process import (
    InProcessUnavailable,
    RejoinError,
    is_peer_failure,
    require_launcher,
    wait_for_order,
)
from ftmem.errors import ProtocolError, UnsafePathError
from ftmem.launch.monitor import RankProcess, find_hangs
from ftmem.protocol.rejoin import RejoinOrder, order_path, read_order, write_order
from ftmem.protocol.status import RankProgress, SmpStatus

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1955: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def _order(**kw: object) -> RejoinOrder:
    fields: dict[str, object] = {
        "generation": 3,
        "rank": 1,
        "env": {"RANK": "1", "MASTER_PORT": "29500"},
        "agent_pid": 42,
        "stdout": "/tmp/x/stdout.log",
        "stderr": "",
    }
    fields.update(kw)
    return RejoinOrder(**fields)  # type: ignore[arg-type]


def test_order_round_trips_through_its_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "rd"
    run_dir.mkdir(mode=0o700)
    assert read_order(run_dir, 1) is None
    order = _order()
    path = write_order(run_dir, order)
    assert path == order_path(run_dir, 1)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_order(run_dir, 1) == order
    newer = _order(generation=4)
    write_order(run_dir, newer)  # replaces the older one
    assert read_order(run_dir, 1) == newer


@pytest.mark.parametrize(
    "doc",
    [
        b"not json",
        b"[]",
        json.dumps({"generation": 1, "rank": 1, "env": {}, "agent_pid": 1}).encode(),  # fields
        json.dumps({**json.loads(_order().to_json()), "extra": 1}).encode(),
        json.dumps({**json.loads(_order().to_json()), "generation": "3"}).encode(),
        json.dumps({**json.loads(_order().to_json()), "generation": -1}).encode(),
        json.dumps({**json.loads(_order().to_json()), "rank": True}).encode(),
        json.dumps({**json.loads(_order().to_json()), "env": {"A B": "1"}}).encode(),
        json.dumps({**json.loads(_order().to_json()), "env": {"A": 1}}).encode(),
        json.dumps({**json.loads(_order().to_json()), "env": ["A"]}).encode(),
        json.dumps({**json.loads(_order().to_json()), "stdout": "relative/path"}).encode(),
    ],
)
def test_malformed_orders_are_refused(doc: bytes) -> None:
    with pytest.raises(ProtocolError):
        RejoinOrder.from_json(doc)


def test_planted_or_foreign_orders_are_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "rd"
    run_dir.mkdir(mode=0o700)
    path = write_order(run_dir, _order())
    os.chmod(path, 0o644)  # readable by others: not an order this agent wrote
    with pytest.raises(UnsafePathError):
        read_order(run_dir, 1)
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(_order().to_json())
    os.chmod(target, 0o600)
    path.symlink_to(target)  # a link planted in the directory is never followed
    with pytest.raises(UnsafePathError):
        read_order(run_dir, 1)
    path.unlink()
    write_order(run_dir, _order(rank=2))
    os.replace(order_path(run_dir, 2), path)  # rank 2's order under rank 1's name
    with pytest.raises(ProtocolError, match="for rank 2"):
        read_order(run_dir, 1)


def test_wait_for_order_takes_only_a_newer_generation_from_the_agent(tmp_path: Path) -> None:
    run_dir = tmp_path / "rd"
    run_dir.mkdir(mode=0o700)
    me = os.getppid()  # wait_for_order checks that the agent is this process's parent
    write_order(run_dir, _order(generation=3, agent_pid=me))
    t0 = time.monotonic()
    with pytest.raises(RejoinError, match="no new generation within"):
        wait_for_order(str(run_dir), 1, 3, me, timeout_s=0.2)  # only generation 3: too old
    assert time.monotonic() - t0 < 5
    write_order(run_dir, _order(generation=4, agent_pid=me))
    assert wait_for_order(str(run_dir), 1, 3, me, timeout_s=5).generation == 4
    write_order(run_dir, _order(generation=5, agent_pid=me + 1))
    with pytest.raises(RejoinError, match="not the agent"):
        wait_for_order(str(run_dir), 1, 4, me, timeout_s=5)
    with pytest.raises(RejoinError, match="is gone"):
        wait_for_order(str(run_dir), 1, 4, me + 1, timeout_s=5)


def test_peer_failures_are_told_from_other_errors() -> None:
    assert is_peer_failure(RuntimeError(GLOO_RESET))
    assert is_peer_failure(RuntimeError("... Connection closed by peer [127.0.0.1]:9954 ..."))
    try:  # raised while handling a peer failure (e.g. in DDP's backward hook)
        try:
            raise RuntimeError(GLOO_RESET)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_peer_failure(outer)
    assert not is_peer_failure(ValueError("a bug in the training code"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(RuntimeError("CUDA error: an illegal memory access; NCCL error"))
    assert not is_peer_failure(KeyboardInterrupt())
    assert issubclass(dist.DistNetworkError, RuntimeError)


def test_run_outside_ftmem_launch_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTMEM_AGENT_PID", raising=False)
    with pytest.raises(InProcessUnavailable, match="needs ftmem-launch"):
        require_launcher()
    monkeypatch.setenv("FTMEM_AGENT_PID", str(os.getpid()))  # not the parent
    monkeypatch.setenv("FTMEM_RUN_DIR", "/tmp")
    with pytest.raises(InProcessUnavailable, match="is neither the ftmem-launch agent"):
        require_launcher()
    monkeypatch.setenv("FTMEM_AGENT_PID", str(os.getppid()))
    assert require_launcher() == os.getppid()
    # the parent of our parent: the agent, where its fork server forked this rank
    with open(f"/proc/{os.getppid()}/stat") as f:
        grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
    monkeypatch.setenv("FTMEM_AGENT_PID", str(grandparent))
    assert require_launcher() == grandparent


def test_a_kept_rank_that_does_not_rejoin_in_time_is_hung() -> None:
    now = 1000.0
    kept = RankProcess(rank=0, pid=10, start_time=now - 30, kept=True)
    fresh = RankProcess(rank=1, pid=11, start_time=now - 30)
    old = RankProgress(0, 10, now - 35, 12, 12, in_process=True)  # before this generation
    progress = {0: old, 1: RankProgress(1, 11, None, None, None)}
    hangs = find_hangs(
        [kept, fresh], progress, now, timedelta(seconds=5), rejoin_timeout=timedelta(seconds=20)
    )
    assert [(h.rank, h.reason) for h in hangs] == [(0, "did not rejoin in 30.0 s")]
    assert find_hangs([kept], progress, now, timedelta(5), rejoin_timeout=timedelta(60)) == []
    rejoined = {0: RankProgress(0, 10, now - 1, 13, 12, in_process=True)}
    assert find_hangs([kept], rejoined, now, timedelta(5), rejoin_timeout=timedelta(20)) == []
    status = {"pid": 9, "ranks": {"0": {"pid": 10, "in_process": True}, "1": {"pid": 11}}}
    parsed = SmpStatus.from_json(status).ranks
    assert parsed[0].in_process and not parsed[1].in_process
