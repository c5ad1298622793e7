"""`ftmem export`: a step of a 2-rank DDP run, held in a real SMP, written as a DCP directory
that stock torch.distributed.checkpoint loads into 1 process and into 4 (gloo), and that
``dcp_to_torch_save`` converts; values checked with the example's own digest."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests._support.example import LOAD_SCRIPT, example, fresh_state, load_digests, same_as_saved
from tests._support.launcher import running_smp
from tests._support.procs import REPO
from tests._support.ranks import SMALL, run_ranks


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[Path, str]]:
    """A 2-rank run of the example whose last step stays committed in the SMP: one for the
    module (the tests read it; the two that alter a byte of a slot put it back)."""
    run_dir = Path(tempfile.mkdtemp(prefix="ftm-", dir="/tmp"))
    try:
        with running_smp(run_dir, "t" + uuid.uuid4().hex[:10]):
            run = run_ranks(run_dir, SMALL, env_extra={"FTMEM_RUN_DIR": str(run_dir)})
            assert run.codes == [0, 0], run.outputs
            (digest,) = run.digests()
            yield run_dir, digest
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _flipped(path: str | Path, offset: int, mask: int) -> Iterator[None]:
    """One byte of ``path`` at ``offset`` XORed with ``mask``, put back on leaving."""

    def flip() -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ mask]))

    flip()
    try:
        yield
    finally:
        flip()


def test_export_loads_with_stock_dcp_at_other_world_sizes(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    run_dir, digest = trained
    out = tmp_path / "ckpt"
    flat = tmp_path / "all.pt"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmem.cli",
            "export",
            "--run-dir",
            str(run_dir),
            "--out",
            str(out),
            "--torch-save",
            str(flat),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert re.search(r"exported step 20 of 2 ranks", cli.stdout), cli.stdout
    assert (out / ".metadata").is_file() and not list(tmp_path.glob("*.tmp-*"))

    # One process, no process group.
    import torch.distributed.checkpoint as dcp

    ex = example()
    model, opt, sd = fresh_state(ex)
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert ex.state_digest(model, opt) == digest

    # Four processes with a gloo group.
    store = tmp_path / "pg.store"
    script = LOAD_SCRIPT.format(repo=str(REPO), store=str(store), ckpt=str(out))
    load = run_ranks(tmp_path, [], world=4, code=script, tag="load")
    assert load.codes == [0] * 4, [t[-2000:] for t in load.outputs]
    got = [re.findall(r"DIGEST (\w+)", t) for t in load.outputs]
    assert got == [[digest]] * 4, [t[-2000:] for t in load.outputs]

    # dcp_to_torch_save's single file: read back with weights_only=True.
    whole = torch.load(flat, weights_only=True)
    ref = model.state_dict()
    assert set(ref) <= set(whole["model"])
    assert all(torch.equal(whole["model"][k], v) for k, v in ref.items())
    assert whole["ftmem_meta"]["step"] == 20 and whole["ftmem_meta"]["world_size"] == 2
    # Per-rank state (RNG, data position) kept for rank 1, not deduplicated away.
    per1 = whole["ftmem_per_rank"]["1"]
    assert any("rng" in k for k in per1["tensors"]), sorted(per1["tensors"])


def test_export_refuses_an_existing_dir_and_a_missing_step(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    from ftmem.tiers.export import ExportError, export_dcp, find_sources

    run_dir, _ = trained
    with pytest.raises(ExportError, match="not committed by every rank"):
        find_sources([run_dir], step=7)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="exists"):
        export_dcp(find_sources([run_dir]), tmp_path / "taken")


def test_each_rank_reads_back_exactly_what_it_saved(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    from ftmem.errors import CorruptSnapshotError
    from ftmem.tiers.checkpoints import MANIFEST, list_checkpoints, read_checkpoint
    from ftmem.tiers.disk_restore import load_rank
    from ftmem.tiers.export import export_dcp, find_sources

    run_dir, _ = trained
    sources = find_sources([run_dir])
    out = tmp_path / "step_0000000020"
    export_dcp(sources, out)
    ck = read_checkpoint(out)
    assert [c.step for c in list_checkpoints(tmp_path)[0]] == [20]
    same_as_saved(ck, sources)
    # One flipped byte in the data file: detected before any byte is used.
    data = next(p for p in out.iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptSnapshotError, match="fails its checksum"):
        load_rank(read_checkpoint(out), 0)
    # A truncated file is not even listed as complete.
    data.write_bytes(bytes(raw[:-10]))
    assert list_checkpoints(tmp_path)[0] == []
    assert (out / MANIFEST).exists()


def test_parts_of_two_nodes_assemble_into_one_stock_dcp_checkpoint(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    """Each rank written as a node's part (as a 2-node run does), then assembled by the
    coordinator: every rank reads back what it saved, stock dcp.load gives the run's digest,
    dcp_to_torch_save works, and a missing part is a clear error at the deadline."""
    import torch.distributed.checkpoint as dcp

    from ftmem.tiers.assemble import AssembleError, assemble
    from ftmem.tiers.checkpoints import (
        list_checkpoints,
        part_name,
        read_checkpoint,
        read_manifest,
    )
    from ftmem.tiers.export import export_dcp, find_sources, to_torch_save

    run_dir, digest = trained
    sources = find_sources([run_dir])
    tier = tmp_path / "shared"
    tier.mkdir()
    export_dcp([sources[1]], tier / part_name(20, 1), world_size=2)
    part1 = read_checkpoint(tier / part_name(20, 1))
    assert part1.is_part and part1.ranks == (1,)
    # A part is not a checkpoint: never listed as one, never loaded as one.
    assert list_checkpoints(tier)[0] == []
    with pytest.raises(AssembleError, match=r"no part of ranks \[0\]"):
        assemble(tier, 20, 2, timeout_s=0.5)
    same_as_saved(part1, [sources[1]])  # a node restores its ranks from its own part

    export_dcp([sources[0]], tier / part_name(20, 0), world_size=2)
    parts = [read_manifest(tier / part_name(20, r)).chunked or [] for r in (0, 1)]
    ck = assemble(tier, 20, 2, timeout_s=10)
    assert not ck.is_part and ck.path.name == "step_0000000020"
    # The tensors the parts hold as chunks, for a reshard of the assembled checkpoint.
    assert read_manifest(ck.path).chunked == sorted({*parts[0], *parts[1]})
    assert [c.path for c in list_checkpoints(tier)[0]] == [ck.path]
    assert sorted(p.name for p in ck.path.iterdir() if p.is_dir()) == [
        "part-r000000",
        "part-r000001",
    ]
    same_as_saved(read_checkpoint(ck.path), sources)

    ex = example()
    model, opt, sd = fresh_state(ex)
    dcp.load(sd, checkpoint_id=str(ck.path), no_dist=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert ex.state_digest(model, opt) == digest
    flat = tmp_path / "all.pt"
    to_torch_save(ck.path, flat)
    whole = torch.load(flat, weights_only=True)
    assert whole["ftmem_meta"]["world_size"] == 2
    assert any("rng" in k for k in whole["ftmem_per_rank"]["1"]["tensors"])

    # The same checkpoint as one safetensors file, through the CLI (verified first).
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    st_file = tmp_path / "all.safetensors"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmem.cli",
            "export",
            "--checkpoint",
            str(ck.path),
            "--safetensors",
            str(st_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    flat_st = load_file(str(st_file))
    for k, v in model.state_dict().items():
        assert torch.equal(flat_st[f"model.{k}"], v), k
    # A part alone is refused with a clear message.
    one = ck.path / "part-r000001"
    part = subprocess.run(
        [
            sys.executable,
            "-m",
            "ftmem.cli",
            "export",
            "--checkpoint",
            str(one),
            "--torch-save",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert part.returncode == 1 and "assemble the parts first" in part.stderr, part.stderr


def test_the_writer_checkpoint_loads_with_stock_dcp_at_two_and_three_processes(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    # One and four processes: test_export_loads_with_stock_dcp_at_other_world_sizes.
    from ftmem.tiers.export import export_dcp, find_sources

    run_dir, digest = trained
    out = tmp_path / "ckpt"
    export_dcp(find_sources([run_dir]), out, threads=3)
    assert len(list(out.glob("*.distcp"))) == 3  # written by three threads
    assert load_digests(tmp_path, out, (2, 3)) == [[digest]] * 5


def test_a_sigkill_mid_write_or_a_changed_slot_never_leaves_a_listed_checkpoint(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    from ftmem.format.layout import parse_layout
    from ftmem.tiers.checkpoints import list_checkpoints
    from ftmem.tiers.export import ExportError, export_dcp, find_sources

    run_dir, _ = trained
    tier = tmp_path / "tier"
    tier.mkdir(mode=0o700)
    out = tier / "step_0000000020"
    cmd = [sys.executable, "-m", "ftmem.cli", "export", "--run-dir", str(run_dir)]
    cmd += ["--out", str(out)]
    env = dict(os.environ, FTMEM_FAULT="in_dcp_write:rank=0")
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (left,) = tier.iterdir()  # the half-written directory, under its temporary name
    assert ".tmp-" in left.name and any(p.suffix == ".distcp" for p in left.iterdir())
    assert not (left / ".metadata").exists()
    good, other = list_checkpoints(tier)
    assert good == [] and [p for p, _ in other] == [left]
    # A full disk while the second file is written: a clear error, the other file's writer
    # is cancelled, and nothing more is left in the tier.
    env = dict(os.environ, FTMEM_FAULT="in_dcp_write:rank=1:fault=enospc")
    full = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert full.returncode == 1, full.stderr
    assert re.search(r"No space left on device.*: '\S+__0_1\.distcp'", full.stderr), full.stderr
    assert list(tier.iterdir()) == [left] and list_checkpoints(tier)[0] == []
    # The same export without the fault completes and is listed.
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [c.step for c in list_checkpoints(tier)[0]] == [20]

    # A slot changed after the SMP verified it (what a rank reusing it meanwhile would do):
    # the writer refuses it as it copies it, and leaves nothing.
    sources = find_sources([run_dir])
    src = sources[1]
    big = max(parse_layout(src.layout, src.capacity).tensors, key=lambda t: t.nbytes)
    other_dir = tmp_path / "other"
    other_dir.mkdir(mode=0o700)
    with _flipped(src.path, big.offset + big.nbytes // 2, 0x40):
        with pytest.raises(ExportError, match=f"{re.escape(big.name)}.*fail their checksum"):
            export_dcp(sources, other_dir / "step_0000000020")
    assert list(other_dir.iterdir()) == []


def test_a_step_in_memory_loads_through_dcp_as_its_flush_does(
    trained: tuple[Path, str], tmp_path: Path
) -> None:
    """The 2-rank step (each rank saved 1/2 of the replicated state: chunks) read by DCP from
    the SMP's memory into one process: every tensor equals the flushed checkpoint's. (Into
    more processes, across hosts: test_memory_reshard.py.)"""
    import torch.distributed.checkpoint as dcp

    from ftmem.tiers.export import export_dcp, find_sources
    from ftmem.tiers.memory_dcp import MemoryCheckpoint

    run_dir, digest = trained
    sources = find_sources([run_dir])
    export_dcp(sources, tmp_path / "ckpt")
    ex = example()
    _, _, from_disk = fresh_state(ex)
    dcp.load(from_disk, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    model, opt, sd = fresh_state(ex)
    with MemoryCheckpoint(sources) as ckpt:
        assert (ckpt.step, ckpt.world_size) == (20, 2)
        dcp.load(sd, storage_reader=ckpt.reader(), no_dist=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    assert ex.state_digest(model, opt) == digest
    for key, value in from_disk["model"].items():
        assert torch.equal(sd["model"][key], value), key


def test_a_step_in_memory_whose_bytes_were_altered_is_refused(
    trained: tuple[Path, str],
) -> None:
    from ftmem.errors import CorruptSnapshotError
    from ftmem.format.layout import parse_layout
    from ftmem.tiers.export import find_sources
    from ftmem.tiers.memory_dcp import MemoryCheckpoint

    run_dir, _ = trained
    sources = find_sources([run_dir])
    src = sources[1]
    snap = parse_layout(src.layout, src.capacity)
    t = max(snap.tensors, key=lambda t: t.nbytes)  # a chunk of a weight: DCP reads it
    with _flipped(src.path, t.offset + t.nbytes // 2, 0xFF):
        with pytest.raises(CorruptSnapshotError, match="fails its checksum"):
            MemoryCheckpoint(sources)
