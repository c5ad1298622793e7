"""Two ranks + one SMP as real processes: a rank is SIGKILLed, both restart, and the run ends
bitwise equal to a run without failure (the test restarts the ranks as a launcher would)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftmem.smp.spawn import SmpProcess
from tests._support.ranks import SMALL, RankRun, run_ranks


@pytest.fixture
def env(run_dir: Path, smp: SmpProcess) -> dict[str, str]:
    return {"FTMEM_RUN_DIR": str(run_dir)}


def baseline(workdir: Path, extra: list[str]) -> str:
    return baseline_run(workdir, extra).digests().pop()


def baseline_run(workdir: Path, extra: list[str]) -> RankRun:
    # The reference is plain torch (no ftmem). Under heavy concurrent load we saw its gloo
    # ranks hang twice in ~40 runs; it is not what is tested, so it gets one retry.
    for attempt in range(2):
        run = run_ranks(
            workdir, [*SMALL, *extra, "--no-ftmem"], tag=f"baseline{attempt}", timeout=45.0
        )
        if run.codes == [0, 0]:
            break
    assert run.codes == [0, 0], run.outputs
    assert len(run.digests()) == 1
    return run


def test_kill_after_commit_resumes_from_that_step_bitwise(
    run_dir: Path, env: dict[str, str]
) -> None:
    expect = baseline(run_dir, [])
    args = [*SMALL, "--fail-at-step", "12", "--fail-rank", "1"]
    first = run_ranks(run_dir, args, env_extra=env, tag="first")
    assert first.codes[1] == -9, first.outputs
    assert first.codes[0] != 0  # its peer died under it
    second = run_ranks(run_dir, args, env_extra=env, tag="second")
    assert second.codes == [0, 0], second.outputs
    assert second.resumed() == [12, 12]
    assert second.digests() == {expect}


def test_kill_inside_copy_restores_previous_step_bitwise_with_batchnorm(
    run_dir: Path, env: dict[str, str]
) -> None:
    ref = baseline_run(run_dir, ["--batchnorm"])
    expect = ref.digests().pop()
    expect_buffers = sorted(ref.lines(r"(\[rank \d\] buffers sha256 [0-9a-f]+)"))
    assert len(expect_buffers) == 2
    args = [*SMALL, "--batchnorm"]
    # The first copy at or after step 12: a save skipped under load (both slots held by the
    # SMP's hasher) has no copy, and an exact step would then never fire.
    fault = {**env, "FTMEM_FAULT": "in_copy:rank=1:min_step=12"}
    first = run_ranks(run_dir, args, env_extra=fault, tag="first")
    assert first.codes[1] == -9, first.outputs
    second = run_ranks(run_dir, args, env_extra=env, tag="second")
    assert second.codes == [0, 0], second.outputs
    # rank 1 died inside the copy of step 12 (or of the first step it saved after) before
    # committing it: both ranks resume from the newest step both committed (11 unless a save was
    # skipped), from memory; the digests below show that nothing torn was restored.
    resumed = second.resumed()
    assert len(resumed) == 2 and resumed[0] == resumed[1] >= 1, resumed
    assert second.digests() == {expect}
    # BatchNorm running statistics (mutated by every forward) match per rank too.
    assert sorted(second.lines(r"(\[rank \d\] buffers sha256 [0-9a-f]+)")) == expect_buffers
