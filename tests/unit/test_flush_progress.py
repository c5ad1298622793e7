"""The progress bar of ``ftmem flush`` (pure formatting of the SMP's flush status)."""

from __future__ import annotations

from ftmem.cli.persist import _bar
from ftmem.protocol.status import FlushRunning


def test_bar_shows_bytes_written_of_the_total() -> None:
    line = _bar(FlushRunning(1, "writing", 0, 3 << 20, 12 << 20), ["/a/ckpt"])
    assert "writing" in line and "25%" in line and "3/12 MiB" in line and "(ckpt)" in line
    assert line.count("#") == 6


def test_bar_counts_ranks_while_waiting_for_parts_and_clamps() -> None:
    line = _bar(
        FlushRunning(1, "waiting for parts", 1, 5, 4, "ranks"),
        ["/l", "/shared"],
    )
    assert "100%" in line and "5/4 ranks" in line and "(shared)" in line


def test_bar_without_sizes_is_the_stage_and_tier() -> None:
    assert _bar(FlushRunning(1, "starting", 0), ["/x/t0"]) == "starting t0"
    assert _bar(FlushRunning(1, "copying", 5, 1, 0), []) == "copying ?"
