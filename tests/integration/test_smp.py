"""The SMP as a real process: readiness, hostile input on its socket, shutdown, loss."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import zmq

from ftmem.config import AUTH_KEY_NAME, SOCKET_NAME, default_shm_dir
from ftmem.errors import ErrorKind, SmpRequestError, SmpStartError, SmpUnavailableError
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.protocol.wire import decode, encode
from ftmem.shm import parse_slot_name
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import pid_gone, shm_files


def raw_socket(run_dir: Path) -> zmq.Socket[bytes]:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{run_dir / SOCKET_NAME}")
    return s


def test_ready_status_and_private_files(smp: SmpProcess, run_dir: Path) -> None:
    assert (run_dir.stat().st_mode & 0o777) == 0o700
    assert ((run_dir / AUTH_KEY_NAME).stat().st_mode & 0o777) == 0o600
    with SmpClient(run_dir) as c:
        st = c.status()
    assert st.pid == smp.pid and st.ranks == {}


def test_hostile_messages_get_errors_and_smp_keeps_serving(smp: SmpProcess, run_dir: Path) -> None:
    key = (run_dir / AUTH_KEY_NAME).read_bytes()
    s = raw_socket(run_dir)
    good = encode(m.Ping(), 1, key)
    bad = [
        b"",
        b"garbage",
        b"FTMQ" + os.urandom(40),
        good[:-5],  # truncated
        encode(m.Ping(), 2, None),  # unauthenticated
        encode(m.Ping(), 3, b"w" * 32),  # wrong key
        good[:4] + b"\x09\x00" + good[6:],  # wrong version
        encode(
            m.Commit(
                rank=0,
                slot=9,
                gen=0,
                step=1,
                layout_id=1,
                objects_offset=0,
                objects_nbytes=0,
                layout="{}",
            ),
            4,
            key,
        ),  # out of place
        encode(m.Begin(rank=-1, step=1, nbytes=1), 5, key),
        encode(m.Begin(rank=0, step=1, nbytes=1 << 50), 6, key),
    ]
    for frame in bad:
        s.send(frame)
        assert s.poll(10_000), "no reply to a bad message"
        _rid, kind, reply = decode(s.recv(), key)
        assert kind is m.Kind.REPLY and reply.ok is False and reply.error
        assert reply.kind is ErrorKind.BAD_REQUEST, reply
    # multi-frame message: error reply
    s.send_multipart([good, b"extra"])
    assert s.poll(10_000)
    assert decode(s.recv(), key)[2].ok is False
    # oversized: dropped by ZeroMQ (MAXMSGSIZE) without harming the SMP
    s.send(b"x" * (17 << 20))
    s.close()
    with SmpClient(run_dir) as c:
        assert c.call(m.Ping()).pid == smp.pid
        assert c.status().bad_messages >= len(bad)
    assert smp.poll() is None


def test_refusals_carry_their_kind(smp: SmpProcess, run_dir: Path) -> None:
    """A COMMIT into a slot never granted is a bad request; one naming a layout the SMP does
    not hold, into a granted slot, is refused as UNKNOWN_LAYOUT (the rank sends the layout
    again): callers tell the two apart by the kind, never by the text."""
    commit = m.Commit(
        rank=0, slot=0, gen=0, step=1, layout_id=7, objects_offset=0, objects_nbytes=0
    )
    with SmpClient(run_dir) as c:
        with pytest.raises(SmpRequestError) as refused:
            c.request(dataclasses.replace(commit, layout_id=1, layout="[]"))
        assert refused.value.kind is ErrorKind.BAD_REQUEST, refused.value
        c.request(m.Hello(rank=0, pid=os.getpid()))
        c.request(m.Prepare(rank=0, slot=-1, nbytes=4096), timeout=timedelta(seconds=60))
        grant = c.call(m.Begin(rank=0, step=1, nbytes=4096))
        assert grant.action is m.Decision.WRITE
        with pytest.raises(SmpRequestError) as refused:
            c.request(dataclasses.replace(commit, slot=grant.slot, gen=grant.gen))
        assert refused.value.kind is ErrorKind.UNKNOWN_LAYOUT, refused.value


def test_sigterm_removes_shared_memory(run_dir: Path, run_id: str) -> None:
    smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    try:
        with SmpClient(run_dir) as c:
            c.request(m.Hello(rank=0, pid=os.getpid()))
            begin = m.Begin(rank=0, step=1, nbytes=1000)
            assert c.call(begin).action is m.Decision.RESIZE
            c.request(m.Prepare(rank=0, slot=0, nbytes=1000), timeout=timedelta(seconds=60))
        assert len(shm_files(run_id)) == 2
        for f in shm_files(run_id):
            assert (os.stat(f).st_mode & 0o777) == 0o600
    finally:
        code = smp.stop()
    assert code == 0
    assert shm_files(run_id) == []
    assert not (run_dir / SOCKET_NAME).exists()


def test_killed_smp_gives_clear_error_quickly(run_dir: Path, run_id: str) -> None:
    smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    c = SmpClient(run_dir, timeout=timedelta(seconds=60))
    try:
        smp.kill()
        t0 = time.monotonic()
        with pytest.raises(SmpUnavailableError, match="gone"):
            c.request(m.Ping())
        assert time.monotonic() - t0 < 5
    finally:
        c.close()
        smp.stop()
        for f in shm_files(run_id):
            os.unlink(f)


def test_no_smp_is_a_clear_error(run_dir: Path) -> None:
    with pytest.raises(SmpUnavailableError, match="no SMP serves"):
        SmpClient(run_dir)


def test_second_smp_on_same_dir_refuses(smp: SmpProcess, run_dir: Path, run_id: str) -> None:
    with pytest.raises(SmpStartError):
        start_smp(run_dir=run_dir, run_id=run_id, start_timeout=timedelta(seconds=60))
    with SmpClient(run_dir) as c:
        assert c.call(m.Ping()).pid == smp.pid


def test_exits_with_parent(run_dir: Path, run_id: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        smp = start_smp(run_dir=run_dir, run_id=run_id, parent_pid=parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert smp.popen.wait(timeout=20) == 0
    finally:
        parent.kill()
        parent.wait(10)
    assert pid_gone(smp.pid) and shm_files(run_id) == []


def test_restarted_smp_adopts_committed_slots_of_a_killed_one(run_dir: Path, run_id: str) -> None:
    import torch

    import ftmem
    from ftmem.config import ClientConfig

    smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    model = torch.nn.Linear(64, 64)
    try:
        c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        c.save({"model": model}, step=1)  # skipped while the slots are allocated
        assert c.wait(60)  # ...so wait() commits it
        c.save({"model": model}, step=2).wait(30)
        expect = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1)
        c.save({"model": model}, step=3)
        c.close()  # the newest step is always committed (saved again if it was skipped)
        smp.kill()  # perhaps before it verified step 3: the next SMP hashes what it adopts
        left = _slot_files(run_id)
        assert left != []  # a SIGKILLed SMP cannot clean up
        smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
        with SmpClient(run_dir) as sc:
            steps = sc.status().ranks[0].committed_steps
        assert steps == [3, 2]
        # Each SMP names its files with a nonce of its own; the new one adopted the old
        # one's files where they are, under the old nonce.
        nonces = re.findall(r"nonce ([0-9a-f]{16})", (run_dir / "smp.log").read_text())
        assert len(nonces) == 2 and nonces[0] != nonces[1]
        assert {f"@{nonces[0]}@" in Path(p).name for p in left} == {True}
        assert _slot_files(run_id) == left
        # Roll back to step 2 explicitly through a second run's view: corrupt nothing, load.
        c2 = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        target = torch.nn.Linear(64, 64)
        got = c2.load({"model": target})
        c2.close()
        assert got == 3 and torch.equal(target.weight, expect + 1)
    finally:
        smp.stop()
    assert shm_files(run_id) == []


def _slot_files(run_id: str) -> list[str]:
    """The slot files (not their records) of ``run_id``, in the user's private directory."""
    out = []
    for p in shm_files(run_id):
        name = parse_slot_name(Path(p).name)
        assert name is not None and Path(p).parent == default_shm_dir()
        if not name.suffix:
            out.append(p)
    return out


def test_no_adopt_discards_left_slots(run_dir: Path, run_id: str) -> None:
    import torch

    import ftmem
    from ftmem.config import ClientConfig

    smp = start_smp(run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log")
    try:
        c = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        c.save({"t": torch.ones(10)}, step=1)
        c.close()  # commits step 1 (skipped while the slots were allocated)
        smp.kill()
        smp = start_smp(
            run_dir=run_dir, run_id=run_id, log_path=run_dir / "smp.log", extra_args=["--no-adopt"]
        )
        assert shm_files(run_id) == []
        with SmpClient(run_dir) as sc:
            assert sc.status().ranks == {}
    finally:
        smp.stop()
