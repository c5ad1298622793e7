"""Agreement at load across real ranks: some ranks hold snapshots and others none."""

from __future__ import annotations

import re
from pathlib import Path

from ftmem.smp.spawn import SmpProcess
from tests._support.ranks import SMALL, run_ranks


def test_partial_snapshots_are_a_clear_error_unless_fresh_start_allowed(
    run_dir: Path, smp: SmpProcess
) -> None:
    env = {"FTMEM_RUN_DIR": str(run_dir)}
    args = [*SMALL, "--steps", "4"]
    solo = run_ranks(run_dir, args, world=1, env_extra=env, tag="solo")
    assert solo.codes == [0], solo.outputs  # only rank 0 now holds snapshots
    pair = run_ranks(run_dir, args, env_extra=env, tag="pair")
    assert pair.codes[0] != 0 and pair.codes[1] != 0
    for out in pair.outputs:
        assert "InconsistentSnapshotError" in out
        assert re.search(r"steps each rank holds: rank 0: \[\d[\d, ]*\]; rank 1: none", out), out
    fresh = run_ranks(run_dir, args, env_extra={**env, "FTMEM_ALLOW_FRESH_START": "1"}, tag="fresh")
    assert fresh.codes == [0, 0], fresh.outputs
    assert fresh.resumed() == [0, 0]
