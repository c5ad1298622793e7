"""Without a key file, the agents of a mesh on one host share the job's key through a private
file of that host: it never enters the rendezvous store (torch's TCPStore listens on every
interface whatever address it is given). The file is bound to the job instance: group rank 0 names its job id in the round's store, every agent holds the file it read
(a shared lock) until it exits, and a file no live agent holds, left by a killed job of the
same run id, is replaced rather than reused; the last agent to leave removes it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ftmem.config import ENV_SHM_DIR
from ftmem.errors import FtmemError
from ftmem.exchange.keys import CurveKeyPair
from ftmem.launch.job_key import host_key_path, job_keys, release_host_key
from ftmem.launch.peers import PeerMesh, PeerSettings
from tests._support.launcher import free_port


class Spy:
    """An agent's client of a real TCPStore (a round's keys, behind its prefix) that records
    every value it sets in ``values``."""

    def __init__(self, port: int, round_: int, values: list[bytes] | None = None) -> None:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
        self._store = dist.PrefixStore(f"torch.rendezvous.r.{round_}", client)
        self.values = [] if values is None else values

    def set(self, key: str, value: str | bytes) -> None:
        self.values.append(value.encode() if isinstance(value, str) else value)
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))


@pytest.fixture
def store() -> Iterator[tuple[dist.TCPStore, int]]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    yield server, port
    del server


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "shm"
    monkeypatch.setenv(ENV_SHM_DIR, str(d))
    yield d
    for run in ("job-1", "job-2", "job-3"):  # this process's holds go too
        release_host_key(host_key_path(run), job_over=True)


def test_every_agent_gets_the_same_key_and_none_goes_through_the_store(
    shm_dir: Path, store: tuple[dist.TCPStore, int]
) -> None:
    settings = PeerSettings(host_key=host_key_path("job-1"))
    values: list[bytes] = []
    spies = [Spy(store[1], 0, values) for _ in range(3)]
    got: dict[int, str] = {}

    def agent(rank: int) -> None:
        got[rank] = job_keys(None, settings.host_key, spies[rank], rank)

    others = [threading.Thread(target=agent, args=(r,)) for r in (1, 2)]
    for t in others:
        t.start()  # they wait for the job id group rank 0 names in the store
    agent(0)
    for t in others:
        t.join(30)
    assert len(set(got.values())) == 1 and len(got) == 3
    pair = CurveKeyPair.from_json(got[0])  # a real pair
    assert len(values) == 1 and pair.secret not in values[0]  # a job id, no key
    path = host_key_path("job-1")
    assert path.parent == shm_dir and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(shm_dir.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in shm_dir.iterdir()] == [path.name]  # no temporary file left
    # A later round (another group rank 0 of this job) reads the same key.
    assert job_keys(None, settings.host_key, Spy(store[1], 1), 0) == got[0]


def test_a_key_file_others_can_read_is_refused(
    shm_dir: Path, store: tuple[dist.TCPStore, int]
) -> None:
    settings = PeerSettings(host_key=host_key_path("job-2"))
    spy = Spy(store[1], 0)
    job_keys(None, settings.host_key, spy, 0)
    os.chmod(host_key_path("job-2"), 0o644)
    with pytest.raises(FtmemError, match=r"job's host key file.*open to others"):
        job_keys(None, settings.host_key, spy, 1)


_AGENT = """
import sys
from datetime import timedelta
import torch.distributed as dist
from ftmem.launch.job_key import host_key_path, job_keys
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=timedelta(seconds=20))
round_store = dist.PrefixStore("torch.rendezvous.r.0", store)
print(job_keys(None, host_key_path("job-3"), round_store, 0),
      flush=True)
sys.stdin.read()  # hold the key (an agent of the job) until told to stop, or killed
"""


def test_a_killed_jobs_key_file_is_replaced_and_the_last_agent_removes_it(
    shm_dir: Path, store: tuple[dist.TCPStore, int]
) -> None:
    """A real second process is group rank 0 of round 0 and holds the key; this process,
    group rank 0 of round 1, reads the same key. It leaves (the other still holds the key:
    the file stays), then the other is SIGKILLed: the file it leaves is stale. A new job of
    the same run id gets a new pair in its place; its last agent's exit removes it."""
    path = host_key_path("job-3")
    settings = PeerSettings(host_key=path)
    env = {**os.environ, ENV_SHM_DIR: str(shm_dir)}
    with subprocess.Popen(
        [sys.executable, "-c", _AGENT, str(store[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    ) as agent:
        try:
            assert agent.stdout is not None
            first = agent.stdout.readline().strip()  # bounded: the agent's store times out
            CurveKeyPair.from_json(first)
            assert job_keys(None, settings.host_key, Spy(store[1], 1), 0) == first  # a live job's
            release_host_key(path, job_over=False)
            assert path.exists()  # the other agent still holds it
        finally:
            agent.kill()
            agent.wait(30)
    assert path.exists()  # the killed agent's file stays...

    port = free_port()  # a new job of the same run id: a new store, round 0 again
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    new_job = Spy(port, 0)
    again = job_keys(None, settings.host_key, new_job, 0)
    assert again != first and CurveKeyPair.from_json(again).public != (
        CurveKeyPair.from_json(first).public
    )  # ...and is not reused
    assert job_keys(None, settings.host_key, new_job, 1) == again
    release_host_key(path, job_over=False)  # the last agent of the job on this host
    assert not path.exists() and list(shm_dir.iterdir()) == []
    del server


def test_with_insecure_mesh_the_key_goes_through_the_store() -> None:
    class Store(dict):  # type: ignore[type-arg]
        def set(self, k: str, v: str) -> None:
            self[k] = v.encode()

        def get(self, k: str) -> bytes:  # type: ignore[override]
            return bytes(self[k])

    store = Store()
    mesh = PeerMesh(PeerSettings())
    assert mesh.job_keys(store, 0) == mesh.job_keys(store, 1)
    assert mesh.key_warned
