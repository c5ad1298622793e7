"""Hostile files where the SMP looks for slots to adopt (its shared-memory directory).

A restarted SMP adopts the committed slots a killed one left (``records.scan``). Files with
the run's prefix that are not a consistent slot + commit record (random bytes, truncated or
mismatched records, sizes that differ) must be removed, not adopted, and the SMP must start
and serve. Two bugs found here earlier are pinned by ``test_fixed_*`` (see docs/security.md).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.format.layout import layout_json, tensors_json
from ftmem.format.record import RECORD_VERSION, record_text
from ftmem.protocol import messages as m
from ftmem.protocol.smp_client import SmpClient
from ftmem.smp import records
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.launcher import pid_gone

SEED = 7


NONCE = "0123456789abcdef"  # the killed SMP's; the new one names its files with its own


@pytest.fixture
def shm_dir(run_dir: Path) -> Iterator[Path]:
    """A private shared-memory directory for the test (``--shm-dir``), emptied afterwards."""
    d = run_dir / "shm"
    d.mkdir(mode=0o700)
    yield d
    for p in d.iterdir():
        p.unlink()


def _slot(shm_dir: Path, name: str, nonce: str = NONCE) -> Path:
    """``shm_dir / "fz@n0@<nonce>@<name>"``: a slot name of run fz, node n0."""
    return shm_dir / f"fz@n0@{nonce}@{name}"


def _start(run_dir: Path, shm: Path) -> SmpProcess:
    return start_smp(
        run_dir=run_dir / "rd",
        run_id="fz",
        node="n0",
        slots=2,
        start_timeout=timedelta(seconds=60),
        log_path=run_dir / "smp.log",
        extra_args=["--shm-dir", str(shm)],
    )


def _record(path: Path, **fields: object) -> None:
    rec = {
        "version": RECORD_VERSION,
        "rank": 0,
        "slot": 0,
        "gen": 1,
        "capacity": 4096,
        "step": 5,
        "seq": 1,
    }
    step = fields.get("step", rec["step"])
    valid = layout_json(tensors_json([]), step if isinstance(step, int) else 0, (0, 0))
    rec.update({"layout": valid, **fields})
    records.record_path(path).write_text(record_text(rec))


def test_hostile_leftovers_are_removed_and_the_smp_serves(run_dir: Path, shm_dir: Path) -> None:
    rng = random.Random(SEED)
    good = _slot(shm_dir, "r0-s0-g1")
    good.write_bytes(b"\0" * 4096)
    _record(good)
    hostile = []
    for i in range(40):
        nonce = rng.choice([NONCE, "fedcba9876543210"])  # two SMPs died before this one
        p = _slot(shm_dir, f"r{rng.randrange(3)}-s{rng.randrange(3)}-g{i + 2}", nonce)
        p.write_bytes(rng.randbytes(rng.choice([0, 100, 4096])))
        case = i % 5
        if case == 0:
            records.record_path(p).write_bytes(rng.randbytes(rng.randrange(200)))
        elif case == 1:
            _record(p, capacity=12345)  # the file's size differs
        elif case == 2:
            _record(p, rank=7, slot=1, gen=1)  # the name differs
        elif case == 3:
            _record(p, step=-1)
        hostile.append(p)
    hostile.append(_slot(shm_dir, "r0-s0-g99.commit"))  # a record without its slot
    hostile[-1].write_text("{}")
    hostile.append(_slot(shm_dir, "r0-s0-g98.commit.tmp"))  # a record being written
    hostile[-1].write_text("{")
    junk = _slot(shm_dir, "rx-junk")  # not a slot name: left alone
    junk.write_bytes(b"junk")
    proc = _start(run_dir, shm_dir)
    try:
        with SmpClient(run_dir / "rd", timeout=timedelta(seconds=10)) as c:
            assert [s.step for s in c.query(0)] == [5]  # only the consistent slot
            assert c.call(m.Ping()).pid == proc.pid
    finally:
        proc.stop()
    assert pid_gone(proc.pid)
    assert not any(p.exists() for p in hostile)
    assert junk.exists()


def test_fixed_an_out_of_range_record_does_not_stop_the_smp(run_dir: Path, shm_dir: Path) -> None:
    p = _slot(shm_dir, f"r{1 << 20}-s0-g1")
    p.write_bytes(b"\0" * 4096)
    _record(p, rank=1 << 20)
    proc = _start(run_dir, shm_dir)
    proc.stop()
    assert not p.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_fixed_slot_files_of_another_user_are_not_adopted(run_dir: Path, shm_dir: Path) -> None:
    """Only root can put them in the private directory, but they are still never served."""
    p = _slot(shm_dir, "r0-s0-g1")
    p.write_bytes(b"\0" * 4096)
    _record(p)
    for f in (p, records.record_path(p)):
        os.chown(f, 65534, 65534)
        os.chmod(f, 0o666)
    proc = _start(run_dir, shm_dir)
    try:
        with SmpClient(run_dir / "rd", timeout=timedelta(seconds=10)) as c:
            assert c.query(0) == []
    finally:
        proc.stop()
