"""A local tier another user could move away is refused (S1): a tier whose parent is another
uid's, or that sits in a shared sticky directory under an entry of another uid (the attacker
made ``/tmp/ftmem-<user>`` first). The attack itself is run as ``nobody``: under such a parent
it moves the tier away; under the parents the check accepts, it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmem.errors import UnsafePathError
from ftmem.tiers.checkpoints import check_tier, prepare_local_tier

NOBODY = 65534
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root and runuser"
)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory ``nobody`` can reach (tmp_path's parents are private to root)."""
    d = Path(tempfile.mkdtemp(prefix="ftm-parents-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runuser", "-u", "nobody", "--", *cmd], capture_output=True, text=True, timeout=30
    )


def test_a_tier_another_user_could_move_away_is_refused(base: Path) -> None:
    # The parent belongs to another uid (and it can write it): it moves the tier away.
    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    tier = theirs / "checkpoints"
    tier.mkdir(mode=0o700)
    check_tier(tier)  # the tier alone looks fine: it is ours and private
    with pytest.raises(UnsafePathError, match="another user could move"):
        check_tier(tier, parents=True)
    with pytest.raises(UnsafePathError, match="another user could move"):
        prepare_local_tier(theirs / "new")
    assert not (theirs / "new").exists()  # refused before anything is made there
    assert _as_nobody("mv", str(tier), str(theirs / "moved")).returncode == 0  # the attack

    # /tmp-like: a sticky shared directory where the other uid made our tier's parent first.
    scratch = base / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    planted = scratch / "ftmem-root"
    assert _as_nobody("mkdir", "-m", "0777", str(planted)).returncode == 0
    with pytest.raises(UnsafePathError, match=f"uid {NOBODY}"):
        prepare_local_tier(planted / "checkpoints")
    assert not (planted / "checkpoints").exists()

    # What the check accepts cannot be moved away: our entry in the sticky directory (made
    # as the sbatch script does, mktemp -d), the tier in it.
    ours = Path(tempfile.mkdtemp(prefix="ftmem-job-", dir=scratch))
    prepare_local_tier(ours / "checkpoints")
    check_tier(ours / "checkpoints", parents=True)
    moved = _as_nobody("mv", str(ours), str(scratch / "moved"))
    assert moved.returncode != 0 and ours.is_dir(), moved
    moved = _as_nobody("mv", str(ours / "checkpoints"), str(scratch / "moved"))
    assert moved.returncode != 0 and (ours / "checkpoints").is_dir(), moved


def test_ftmem_launch_refuses_a_local_tier_under_another_users_directory(base: Path) -> None:
    """Checked before any rank starts, even where the tier does not exist yet (exit 2)."""
    from ftmem.launch.config import check_flush_tiers

    theirs = base / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"--ftmem-flush-dir: .*another user could move"):
        check_flush_tiers([theirs / "local", base / "persistent"])
    assert not (theirs / "local").exists()
    check_flush_tiers([base / "local"])  # ours (root's): accepted
