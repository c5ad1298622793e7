"""``FTMEM_FAULT``: the one-fault-per-process spec, read by a real process at import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ftmem import faults

_PROBE = """
import sys
from ftmem import faults
for step in range(10, 15):
    print(step, faults.maybe_inject(faults.Point.IN_COPY, int(sys.argv[1]), step), flush=True)
"""


def _probe(spec: str, rank: int = 1) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FTMEM_FAULT": spec}
    env.pop("FTMEM_FAULT_FILE", None)
    return subprocess.run(
        [sys.executable, "-c", _PROBE, str(rank)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_min_step_fires_once_at_the_first_step_at_or_above() -> None:
    out = _probe("in_copy:rank=1:min_step=12:fault=enospc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:5] == ["10 False", "11 False", "12 True", "13 False", "14 False"]


def test_kill_at_min_step_is_a_real_sigkill() -> None:
    out = _probe("in_copy:rank=1:min_step=12")
    assert out.returncode == -signal.SIGKILL
    assert out.stdout.split() == ["10", "False", "11", "False"]


def test_other_rank_and_exact_step() -> None:
    assert "True" not in _probe("in_copy:rank=0:min_step=12:fault=enospc").stdout
    out = _probe("in_copy:step=13:fault=enospc", rank=5)
    assert out.stdout.split("\n")[:5] == ["10 False", "11 False", "12 False", "13 True", "14 False"]


@pytest.mark.parametrize(
    "spec", ["in_copy:rank=1:stepp=3", "nowhere:rank=1", "in_copy:fault=melt", "in_copy:step=x"]
)
def test_malformed_spec_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError):
        faults._parse(spec)


def test_parsed_spec_is_an_armed_fault() -> None:
    f = faults._parse("before_commit:rank=2:min_step=7:fault=stop")
    assert f == faults.ArmedFault(
        id="env", point=faults.Point.BEFORE_COMMIT, rank=2, min_step=7, fault=faults.Fault.STOP
    )
    assert faults._parse("") is None
