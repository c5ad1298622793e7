"""ftmem's DCP writer (ftmem/tiers/dcp_writer.py) against stock DCP: what it writes loads with
stock ``dcp.load`` and ``torch.load``, the manifest entries it computes while writing are the
files' own, and a tensor whose bytes do not match its checksum is refused."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import HASH_PIECE, digest
from ftmem.tiers.checkpoints import file_hash
from ftmem.tiers.dcp_writer import STAGING_BYTES, SlotWriter


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(STAGING_BYTES // 4 + HASH_PIECE // 4 + 123, generator=g)  # > a buffer
    return {
        "model": {
            "w": torch.randn(300, 77, generator=g).to(torch.bfloat16),
            "big": big,
            "t": torch.randn(8, 9, generator=g).t(),  # not contiguous: cloned
            "mask": torch.rand(1000, generator=g) > 0.5,
            "idx": torch.arange(5000, dtype=torch.int64),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 4),
        },
        "extra": {"step": 17, "name": "run", "lr": [0.1, 0.01]},
    }


def _expected(state: dict[str, Any]) -> dict[int, str]:
    out = {}
    for t in state["model"].values():
        if isinstance(t, torch.Tensor) and t.nbytes and t.is_contiguous():
            out[t.data_ptr()] = digest(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return out


def _save(state: dict[str, Any], path: Path, **kw: Any) -> SlotWriter:
    writer = SlotWriter(str(path), **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


@pytest.mark.parametrize("threads,direct", [(1, False), (3, True)])
def test_written_checkpoint_loads_with_stock_dcp(
    tmp_path: Path, threads: int, direct: bool
) -> None:
    state = _state()
    out = tmp_path / "ckpt"
    out.mkdir()
    writer = _save(state, out, expected=_expected(state), threads=threads, direct=direct)
    # The entries computed while writing are the files' own.
    data_files = sorted(p.name for p in out.iterdir() if p.suffix == ".distcp")
    assert sorted(writer.files) == data_files and 1 <= len(data_files) <= threads
    for name, entry in writer.files.items():
        assert entry == {"bytes": (out / name).stat().st_size, "xxh3": file_hash(out / name)}
    # Stock DCP reads every value back bitwise.
    target = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "extra": {"step": 0, "name": "", "lr": [0.0, 0.0]},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    for k, v in state["model"].items():
        got = target["model"][k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    assert target["extra"] == state["extra"]


def test_a_tensor_that_fails_its_checksum_is_refused(tmp_path: Path) -> None:
    state = _state()
    expected = _expected(state)
    big = state["model"]["big"]
    pieces = expected[big.data_ptr()].split(".")
    pieces[1] = "0" * 16  # the second 4 MiB piece "was changed after it was verified"
    expected[big.data_ptr()] = ".".join(pieces)
    out = tmp_path / "ckpt"
    out.mkdir()
    writer = SlotWriter(str(out), expected=expected, threads=2)
    # DCP wraps the writer's error in its CheckpointException (a BaseException).
    with pytest.raises(BaseException), warnings.catch_warnings():  # noqa: B017
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert isinstance(writer.error, CorruptSnapshotError)
    assert "model.big" in str(writer.error) and "checksum" in str(writer.error)
    assert not (out / ".metadata").exists()  # never a loadable checkpoint


def test_a_tmpfs_tier_is_written_whether_or_not_it_takes_o_direct(tmp_path: Path) -> None:
    # tmpfs refuses O_DIRECT before Linux 6.6 (the writer then writes through the page cache)
    # and accepts it since; either way the checkpoint must load.
    import shutil
    import tempfile

    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    out = Path(tempfile.mkdtemp(prefix="ftmem-test-writer-", dir="/dev/shm"))
    try:
        state = {"w": torch.randn(1000, 100), "n": 3}
        _save(state, out, expected=_expected({"model": state}), threads=1, direct=True)
        target = {"w": torch.zeros(1000, 100), "n": 0}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(target, checkpoint_id=str(out), no_dist=True)
        assert torch.equal(target["w"], state["w"]) and target["n"] == 3
    finally:
        shutil.rmtree(out, ignore_errors=True)
