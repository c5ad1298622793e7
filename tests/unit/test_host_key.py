"""Without a key file, the agents of a mesh on one host share the job's key through a private
file of that host: it never enters the rendezvous store (torch's TCPStore listens on every
interface whatever address it is given)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from ftmem.config import ENV_SHM_DIR
from ftmem.errors import FtmemError
from ftmem.exchange.keys import CurveKeyPair
from ftmem.launch.peers import PeerSettings, host_key_path, job_keys


class NoStore:
    """A store that fails the test if the key is put into it or read from it."""

    def set(self, *args: object) -> None:
        raise AssertionError("the key went into the store")

    def get(self, *args: object) -> bytes:
        raise AssertionError("the key was read from the store")


@pytest.fixture
def shm_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "shm"
    monkeypatch.setenv(ENV_SHM_DIR, str(d))
    return d


def test_every_agent_gets_the_same_key_and_none_goes_through_the_store(shm_dir: Path) -> None:
    settings = PeerSettings(host_key=host_key_path("job-1"))
    got: dict[int, str] = {}

    def agent(rank: int) -> None:
        got[rank] = job_keys(settings, NoStore(), rank, [False])

    others = [threading.Thread(target=agent, args=(r,)) for r in (1, 2)]
    for t in others:
        t.start()  # they wait for the file group rank 0 makes
    agent(0)
    for t in others:
        t.join(30)
    assert len(set(got.values())) == 1 and len(got) == 3
    CurveKeyPair.from_json(got[0])  # a real pair
    path = host_key_path("job-1")
    assert path.parent == shm_dir and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(shm_dir.stat().st_mode & 0o777) == "0o700"
    # A later generation (or a restarted agent) reads the same key.
    assert job_keys(settings, NoStore(), 0, [False]) == got[0]


def test_a_key_file_others_can_read_is_refused(shm_dir: Path) -> None:
    settings = PeerSettings(host_key=host_key_path("job-2"))
    job_keys(settings, NoStore(), 0, [False])
    os.chmod(host_key_path("job-2"), 0o644)
    with pytest.raises(FtmemError, match="job's host key file"):
        job_keys(settings, NoStore(), 1, [False])


def test_with_insecure_mesh_the_key_goes_through_the_store() -> None:
    class Store(dict):  # type: ignore[type-arg]
        def set(self, k: str, v: str) -> None:
            self[k] = v.encode()

        def get(self, k: str) -> bytes:  # type: ignore[override]
            return bytes(self[k])

    store = Store()
    warned = [False]
    assert job_keys(PeerSettings(), store, 0, warned) == job_keys(PeerSettings(), store, 1, warned)
    assert warned == [True]
