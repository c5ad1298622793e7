"""When standbys start: with the ranks where the host has a core for each warm-up beside the
ranks and the SMP, else once the ranks step (a warm-up that competes with the ranks slowed
their steps 2x on 2 cores, and a failure meanwhile restarted cold and slower)."""

from __future__ import annotations

import os

import pytest

from ftmem.launch.warm_start import idle_cores


@pytest.mark.parametrize(
    ("cores", "ranks", "omp", "count", "idle"),
    [
        (2, 2, None, 1, False),  # these test machines
        (96, 8, None, 1, True),  # a GPU node: 8 ranks, 96 cores
        (96, 8, "8", 1, True),  # 8 x 8 threads + the SMP leave 31 cores
        (96, 8, "11", 1, False),  # 8 x 11 + 1 = 89 busy: 7 idle < 8 standbys
        (16, 4, None, 2, True),  # 16 - 5 = 11 >= 8
        (8, 4, None, 1, False),  # 3 idle < 4
    ],
)
def test_idle_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, omp: str | None, count: int, idle: bool
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    got, why = idle_cores(ranks, count)
    assert got is idle and f"{cores} cores" in why
