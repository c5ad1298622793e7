"""``read_key_file``: it trusts only a regular file of this user (or root)
that nobody else can read, checked on the file it opened: a symlink, another user's file, a
FIFO or a too-open file is refused with the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ftmem.exchange import keys

NOBODY = 65534


@pytest.fixture
def key_file(tmp_path: Path) -> tuple[Path, keys.CurveKeyPair]:
    pair = keys.generate()
    path = tmp_path / "job.key"
    keys.write_key_file(path, pair)
    return path, pair


def test_a_private_key_file_of_this_user_is_read(key_file: tuple[Path, keys.CurveKeyPair]) -> None:
    path, pair = key_file
    got = keys.read_key_file(path)
    assert got == pair and got.from_file


def test_a_symlink_to_a_good_key_file_is_refused(
    key_file: tuple[Path, keys.CurveKeyPair], tmp_path: Path
) -> None:
    path, _ = key_file
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(keys.KeyFileError, match=r"link\.key.*symbolic link"):
        keys.read_key_file(link)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file to another uid")
def test_a_key_file_of_another_user_is_refused(key_file: tuple[Path, keys.CurveKeyPair]) -> None:
    path, _ = key_file
    os.chown(path, NOBODY, NOBODY)  # mode 0600: only its owner (and root) could have written it
    with pytest.raises(keys.KeyFileError, match=rf"belongs to uid {NOBODY}.*planted"):
        keys.read_key_file(path)


def test_a_fifo_or_an_open_file_is_refused_without_blocking(
    key_file: tuple[Path, keys.CurveKeyPair], tmp_path: Path
) -> None:
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(keys.KeyFileError, match="not a regular file"):
        keys.read_key_file(fifo)  # opened non-blocking: no writer needed to fail
    path, _ = key_file
    path.chmod(0o640)
    with pytest.raises(keys.KeyFileError, match="readable by others"):
        keys.read_key_file(path)
    with pytest.raises(keys.KeyFileError, match="No such file"):
        keys.read_key_file(tmp_path / "missing.key")
    with pytest.raises(keys.KeyFileError, match="not a regular file"):
        keys.read_key_file(tmp_path)  # a directory
