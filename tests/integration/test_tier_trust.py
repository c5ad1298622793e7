"""Disk tiers trust only this job's checkpoints: signed manifests, owners and modes checked,
nothing unpickled from a checkpoint that failed a check, and pruning that deletes only what is
provably this job's.

The "attacker" writes into the tier with another tier key (a file it controls), makes the
tier or a checkpoint writable by others, swaps files for symlinks, and, when the test runs as
root, hands a checkpoint to another uid. Every planted ``.metadata`` is a pickle that creates
a marker file when it is unpickled: the marker must never appear.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ftmem.config import ENV_TIER_KEY_FILE
from ftmem.errors import CorruptSnapshotError, UnsafePathError
from ftmem.smp.spawn import SmpProcess
from ftmem.tiers import signing
from ftmem.tiers.checkpoints import (
    MANIFEST,
    checkpoint_name,
    copy_checkpoint,
    list_checkpoints,
    prune,
    read_checkpoint,
    temp_name,
    write_manifest,
)
from ftmem.tiers.dcp_meta import metadata_to_json
from ftmem.tiers.export import to_torch_save


class _Planted:
    """Unpickling this creates the marker file (stands for any code an attacker runs)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.marker, "w"))


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(8, dtype=torch.float32) * step, "meta": {"step": step}}


def _write(tier: Path, step: int, evil_metadata: Path | None = None) -> Path:
    """A checkpoint as ftmem writes one (DCP files, metadata JSON, signed manifest); with
    ``evil_metadata``, its ``.metadata`` is replaced by a pickle that creates that file."""
    tier.mkdir(mode=0o700, exist_ok=True)
    final = tier / checkpoint_name(step)
    tmp = tier / f"{final.name}.writing"
    md = dcp.save(_state(step), storage_writer=FileSystemWriter(str(tmp)), no_dist=True)
    if evil_metadata is not None:
        (tmp / ".metadata").write_bytes(pickle.dumps(_Planted(evil_metadata)))
    write_manifest(tmp, step, 1, extra={"dcp": metadata_to_json(md)})
    os.rename(tmp, final)
    return final


@pytest.fixture
def attacker_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Another tier key; ``with_key(attacker_key)`` writes as the attacker."""
    path = tmp_path / "attacker.key"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


class _Key:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        self.monkeypatch, self.path = monkeypatch, path

    def __enter__(self) -> None:
        self.monkeypatch.setenv(ENV_TIER_KEY_FILE, str(self.path))

    def __exit__(self, *exc: object) -> None:
        self.monkeypatch.delenv(ENV_TIER_KEY_FILE)


@pytest.fixture(autouse=True)
def job_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This job's tier key (made by the first write, in a private config dir)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(ENV_TIER_KEY_FILE, raising=False)
    return signing.key_path()


def test_a_checkpoint_signed_with_another_key_is_never_listed_nor_unpickled(
    tmp_path: Path, attacker_key: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = tmp_path / "tier"
    marker = tmp_path / "pwned"
    real = [_write(tier, 1), _write(tier, 2)]
    with _Key(monkeypatch, attacker_key):
        planted = _write(tier, 9, evil_metadata=marker)
    good, other = list_checkpoints(tier)
    assert [c.step for c in good] == [2, 1]
    assert [(p, why.split(":")[0]) for p, why in other] == [(planted, "incomplete")]
    assert "signature does not match" in dict(other)[planted]
    with pytest.raises(CorruptSnapshotError, match="signature"):
        to_torch_save(planted, tmp_path / "out.pt")
    assert prune(tier, keep=2) == []  # neither the real ones nor the planted one is deleted
    assert all(p.is_dir() for p in [*real, planted])
    assert not marker.exists(), "a planted .metadata was unpickled"


def test_an_unsigned_checkpoint_is_refused_and_the_job_key_is_private(
    tmp_path: Path, job_key: Path
) -> None:
    tier = tmp_path / "tier"
    ck = _write(tier, 3)
    assert job_key.stat().st_mode & 0o777 == 0o600
    assert job_key.parent.stat().st_mode & 0o777 == 0o700
    doc = json.loads((ck / MANIFEST).read_text())
    del doc[signing.SIGNATURE_FIELD]
    (ck / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(CorruptSnapshotError, match="not signed"):
        read_checkpoint(ck)
    job_key.chmod(0o644)  # a key others can read is no key
    with pytest.raises(UnsafePathError, match="open to others"):
        signing.tier_key(create=False)


def test_the_job_reads_back_its_own_checkpoint_without_its_pickle(tmp_path: Path) -> None:
    """The metadata comes from the signed manifest: a .metadata replaced after signing is
    caught by its hash before conversion, and never unpickled."""
    tier = tmp_path / "tier"
    ck = _write(tier, 4)
    to_torch_save(ck, tmp_path / "out.pt")
    whole = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(whole["w"], _state(4)["w"]) and whole["meta"] == {"step": 4}
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Planted(marker)).ljust(500, b"."))
    with pytest.raises(CorruptSnapshotError, match=r"\.metadata"):
        to_torch_save(ck, tmp_path / "out2.pt")
    assert not marker.exists()


@pytest.mark.parametrize("how", ["writable tier", "symlinked tier", "symlinked file"])
def test_tiers_and_files_others_control_are_refused(tmp_path: Path, how: str) -> None:
    tier = tmp_path / "tier"
    ck = _write(tier, 5)
    if how == "writable tier":
        tier.chmod(0o777)
        with pytest.raises(UnsafePathError, match="writable by others"):
            list_checkpoints(tier)
    elif how == "symlinked tier":
        link = tmp_path / "link"
        link.symlink_to(tier)
        with pytest.raises(UnsafePathError, match="symbolic link"):
            list_checkpoints(link)
    else:
        target = tmp_path / "elsewhere.distcp"
        data = next(ck.glob("*.distcp"))
        target.write_bytes(data.read_bytes())
        data.unlink()
        data.symlink_to(target)
        good, other = list_checkpoints(tier)
        assert good == [] and "not a regular file" in other[0][1]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another uid")
def test_a_checkpoint_of_another_uid_is_untrusted(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    ck = _write(tier, 6)
    _write(tier, 7)
    os.chown(ck, 65534, 65534)
    good, other = list_checkpoints(tier)
    assert [c.step for c in good] == [7]
    assert other[0][0] == ck and "belongs to uid 65534" in other[0][1]
    assert prune(tier, keep=1) == [] and ck.is_dir()


def test_prune_removes_only_dead_writers_of_this_host(tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    _write(tier, 1)
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = child.stdout.strip()  # the pid of a process that has exited
    mine_dead = tier / temp_name(checkpoint_name(2)).replace(str(os.getpid()), dead)
    mine_alive = tier / temp_name(checkpoint_name(3))
    other_host = tier / f"{checkpoint_name(4)}.tmp-otherhost-{dead}"
    for d in (mine_dead, mine_alive, other_host):
        d.mkdir()
    assert prune(tier, keep=2) == [mine_dead]
    assert mine_alive.is_dir() and other_host.is_dir()


def test_copy_replaces_an_existing_copy_by_rename(tmp_path: Path) -> None:
    src = _write(tmp_path / "a", 8)
    dst_tier = tmp_path / "b"
    dst_tier.mkdir(mode=0o700)
    ckpt = read_checkpoint(src)
    first = copy_checkpoint(ckpt, dst_tier)
    again = copy_checkpoint(ckpt, dst_tier)
    assert first == again and read_checkpoint(again).step == 8
    assert sorted(p.name for p in dst_tier.iterdir()) == [checkpoint_name(8)]


def test_a_manifest_nested_too_deeply_spoils_only_its_own_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """json.loads raises RecursionError (not ValueError) on deep nesting: the reader turns it
    into its one "corrupt" error, so listing, `ftmem ls` and the disk fallback keep the rest."""
    from ftmem.cli import main

    tier = tmp_path / "tier"
    _write(tier, 1)
    bad = _write(tier, 2)
    (bad / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    good, other = list_checkpoints(tier)
    assert [c.step for c in good] == [1]
    assert other == [(bad, other[0][1])] and "incomplete" in other[0][1]
    assert main(["ls", str(tier)]) == 0
    out = capsys.readouterr().out
    assert "step_1" in out or "1" in out
    # The disk fallback reads the same listing: step 1 is still restored.
    target = _state(0)
    dcp.load(target, checkpoint_id=str(good[0].path), no_dist=True)
    assert torch.equal(target["w"], _state(1)["w"])  # type: ignore[arg-type]


def test_a_shared_sticky_tier_is_read_entry_by_entry(tmp_path: Path) -> None:
    """A tier in a shared scratch directory (mode 1777): our checkpoints are read back,
    another user's planted newer step is ignored (and nobody else could rename ours)."""
    tier = tmp_path / "scratch"
    tier.mkdir()
    os.chmod(tier, 0o1777)
    ours = _write(tier, 5)
    planted = _write(tier, 9)
    os.chown(planted, 65534, 65534)
    good, other = list_checkpoints(tier)
    assert [c.path for c in good] == [ours]
    assert other[0][0] == planted and "untrusted" in other[0][1]


def test_a_world_writable_tier_without_the_sticky_bit_stops_ftmem_launch(tmp_path: Path) -> None:
    tier = tmp_path / "open"
    tier.mkdir()
    os.chmod(tier, 0o777)
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    child = subprocess.run(
        [
            *(sys.executable, "-m", "ftmem.launch", "--standalone", "--nproc-per-node", "1"),
            *("--ftmem-run-dir", str(tmp_path / "rd"), "--ftmem-flush-dir", str(tier)),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 2, child.stderr[-2000:]
    assert "without the sticky bit" in child.stderr and "chmod" in child.stderr
    assert not marker.exists()  # no rank started


def test_a_tier_that_cannot_be_read_stops_the_load_unless_a_fresh_start_is_allowed(
    tmp_path: Path, smp: SmpProcess, run_dir: Path
) -> None:
    import ftmem
    from ftmem.config import ClientConfig
    from ftmem.errors import InconsistentSnapshotError

    tier = tmp_path / "theirs"
    tier.mkdir()
    _write(tier, 3)
    os.chmod(tier, 0o777)  # anyone could have replaced what is there: not read
    state = {"w": torch.zeros(8)}
    for allow in (False, True):
        ck = ftmem.Checkpointer(ClientConfig(run_dir=run_dir, flush_dirs=[tier]))
        try:
            if allow:
                assert ck.load(state, allow_fresh_start=True) == 0
            else:
                with pytest.raises(InconsistentSnapshotError, match=str(tier)):
                    ck.load(state, allow_fresh_start=False)
        finally:
            ck.close()
