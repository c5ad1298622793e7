"""SlotMappings (ftmem/client/slot_maps.py) on real slot files: mapping a new slot, which takes
seconds for a slot of GiBs, holds up no caller that needs another mapping, and a second caller
of the same file waits for the first one's mapping instead of mapping it again."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from ftmem.client import slot_maps
from ftmem.client.slot_maps import SlotMappings
from ftmem.shm import MappedSegment, create_segment
from ftmem.smp.allocation import SlotFiles

SIZE = 2 << 20


def test_a_slot_being_mapped_holds_up_only_callers_of_that_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm_dir = tmp_path / "shm"
    files = SlotFiles(shm_dir, "r", "n")
    files.prepare()
    slow, other = files.path(0, 0, 1), files.path(0, 1, 1)
    create_segment(slow, SIZE)
    create_segment(other, SIZE)
    maps = SlotMappings()
    maps.shm_dir = shm_dir

    # The mapping of `slow` takes until the test releases it (a slot of GiBs being populated).
    entered, release = threading.Event(), threading.Event()
    made: list[Path] = []

    class SlowToMap(MappedSegment):
        def __init__(self, path: Path, nbytes: int, directory: Path | None = None) -> None:
            made.append(path)
            if path == slow:
                entered.set()
                assert release.wait(30)
            super().__init__(path, nbytes, directory)

    monkeypatch.setattr(slot_maps, "MappedSegment", SlowToMap)
    got: dict[str, Any] = {}

    def segment(key: str, path: Path) -> threading.Thread:
        t = threading.Thread(target=lambda: got.__setitem__(key, maps.segment(str(path), SIZE)))
        t.start()
        return t

    try:
        first = segment("first", slow)
        assert entered.wait(30)
        second = segment("second", slow)  # waits for the first caller's mapping
        segment("other", other).join(30)
        assert "other" in got, "mapping another slot waited for the slot being mapped"
        assert "first" not in got and "second" not in got
    finally:
        release.set()
    first.join(30)
    second.join(30)
    assert got["first"] is got["second"], "the slot was mapped twice"
    assert made.count(slow) == 1
    assert maps.segment(str(slow), SIZE) is got["first"]
    maps.close()
