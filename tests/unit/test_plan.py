"""The goodput model of ``ftmem plan``: pure math, limiting cases, the table and the CLI."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from ftmem.cli import main
from ftmem.observe.plan import (
    CLUSTER_GPUS,
    HOUR_S,
    Estimate,
    PlanInputs,
    break_even_overhead,
    disk_estimate,
    disk_waste,
    format_table,
    ftmem_estimate,
    job_mtbf,
    sweep,
    young_daly_interval,
)


def inputs(**kw: Any) -> PlanInputs:
    """The figures of docs/benchmarks.md's plan plot: 2048 nodes of 6335 h MTBF each."""
    return PlanInputs(**{"node_mtbf_s": 6335 * HOUR_S, "nodes": 2048, **kw})


def test_job_mtbf_divides_by_nodes() -> None:
    assert job_mtbf(1000.0, 1) == 1000.0
    assert job_mtbf(1000.0, 8) == 125.0
    with pytest.raises(ValueError):
        job_mtbf(1000.0, 0)


def test_young_daly_interval_is_sqrt_2cm_and_minimizes_the_waste() -> None:
    assert young_daly_interval(2.0, 100.0) == pytest.approx(20.0)
    assert young_daly_interval(0.0, 100.0) == 0.0
    c, r, m = 0.45, 6.0, 11_000.0
    t = young_daly_interval(c, m)
    best = disk_waste(t, c, r, m)
    for factor in (0.25, 0.5, 0.9, 0.99, 1.01, 1.1, 2.0, 4.0):
        assert disk_waste(t * factor, c, r, m) > best
    # At the optimum the waste is sqrt(2C/M) + R/M.
    assert best == pytest.approx(math.sqrt(2 * c / m) + r / m)
    with pytest.raises(ValueError):
        young_daly_interval(1.0, 0.0)


def test_disk_estimate_uses_the_optimum_unless_an_interval_is_given() -> None:
    p = inputs()
    d = disk_estimate(p)
    m = p.job_mtbf_s
    assert d.interval_s == pytest.approx(math.sqrt(2 * p.disk_save_s * m))
    assert d.overhead == pytest.approx(p.disk_save_s / d.interval_s)
    assert d.rework_s == pytest.approx(d.interval_s / 2)
    assert d.recovery_s == pytest.approx(p.restart_s + p.disk_load_s)
    assert d.goodput == pytest.approx(1 - disk_waste(d.interval_s, p.disk_save_s, d.recovery_s, m))
    fixed = disk_estimate(inputs(disk_interval_s=10 * d.interval_s))
    assert fixed.goodput < d.goodput
    assert fixed.overhead == pytest.approx(d.overhead / 10)


def test_ftmem_estimate_overhead_recovery_and_half_a_step() -> None:
    p = inputs(snapshot_overhead=0.01, recovery_s=7.0, step_s=2.0)
    f = ftmem_estimate(p)
    assert f.interval_s == 2.0 and f.rework_s == 1.0 and f.recovery_s == 7.0
    assert f.goodput == pytest.approx(1 - 0.01 - 8.0 / p.job_mtbf_s)


@pytest.mark.parametrize("system", [ftmem_estimate, disk_estimate])
def test_goodput_falls_as_failures_get_more_frequent(
    system: Callable[[PlanInputs], Estimate],
) -> None:
    goodputs = [system(inputs(node_mtbf_s=h * HOUR_S)).goodput for h in (1e6, 1e4, 1e3, 100, 10)]
    assert goodputs == sorted(goodputs, reverse=True)
    assert goodputs[0] > goodputs[-1]
    by_size = [system(inputs(nodes=n)).goodput for n in (1, 8, 64, 512, 4096)]
    assert by_size == sorted(by_size, reverse=True)


def test_limiting_cases() -> None:
    never = inputs(node_mtbf_s=math.inf)
    assert ftmem_estimate(never).goodput == pytest.approx(1 - never.snapshot_overhead)
    d = disk_estimate(never)
    assert d.goodput == 1.0 and math.isinf(d.interval_s) and d.overhead == 0.0
    free = inputs(snapshot_overhead=0.0, recovery_s=0.0, step_s=0.0)
    assert ftmem_estimate(free).goodput == 1.0
    free_disk = disk_estimate(inputs(disk_save_s=0.0))
    assert free_disk.interval_s == 0.0 and free_disk.overhead == 0.0
    assert free_disk.goodput == pytest.approx(1 - free_disk.recovery_s / inputs().job_mtbf_s)
    # Failures faster than the recovery: nothing is kept (clipped at 0, never negative).
    hopeless = inputs(node_mtbf_s=1.0, nodes=10)
    assert ftmem_estimate(hopeless).goodput == 0.0
    assert disk_estimate(hopeless).goodput == 0.0


def test_break_even_overhead_is_where_the_goodputs_meet() -> None:
    p = inputs()
    f = break_even_overhead(p)
    assert 0 < f < 0.05
    at = ftmem_estimate(inputs(snapshot_overhead=f)).goodput
    assert at == pytest.approx(disk_estimate(p).goodput, abs=1e-12)
    assert ftmem_estimate(inputs(snapshot_overhead=f * 0.9)).goodput > disk_estimate(p).goodput
    assert ftmem_estimate(inputs(snapshot_overhead=f * 1.1)).goodput < disk_estimate(p).goodput


def test_sweep_covers_8_to_16k_gpus_in_whole_nodes() -> None:
    rows = sweep(inputs())
    assert [g for g, _, _ in rows] == list(CLUSTER_GPUS)
    assert CLUSTER_GPUS[0] == 8 and CLUSTER_GPUS[-1] == 16384
    disk = [d.goodput for _, _, d in rows]
    assert disk == sorted(disk, reverse=True)


@pytest.mark.parametrize(
    "bad",
    [
        {"node_mtbf_s": 0.0},
        {"nodes": 0},
        {"snapshot_overhead": 1.0},
        {"snapshot_overhead": -0.1},
        {"step_s": -1.0},
        {"disk_interval_s": 0.0},
    ],
)
def test_bad_inputs_are_value_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        inputs(**bad)


def test_table_names_the_model_and_the_sources() -> None:
    text = format_table(inputs(), [0.045, 0.002])
    assert "MODEL" in text and "Young/Daly" in text
    assert "16384 GPUs" in text and "break-even" in text
    assert "overhead 4.50%" in text and "overhead 0.20%" in text
    assert "dcp.save to local disk + fsync, 0.52 GiB: 0.4542 s" in text


def test_cli_prints_the_table_and_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--mtbf-hours", "6335", "--nodes", "128", "--disk-save-s", "30"]) == 0
    out = capsys.readouterr().out
    assert "1024 GPUs" in out and "disk_save_s = 30.0: given" in out
    assert main(["plan", "--mtbf-hours", "100", "--nodes", "1", "--snapshot-overhead", "2"]) == 2
    assert "fraction" in capsys.readouterr().err
