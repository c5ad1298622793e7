"""The SMP's settings file (``python -m ftmem.smp --settings``): what ftmem-launch hands its SMP
is read back as the same SmpConfig, a flag beside it wins, and a file that is malformed or
open to others is refused with a clear error."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest

from ftmem.errors import ProtocolError, UnsafePathError
from ftmem.launch.config import FtmemLaunchConfig
from ftmem.smp.__main__ import config_from_args, get_args_parser
from ftmem.smp.spawn import write_settings


def _private(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def _read(*argv: str) -> object:
    return config_from_args(get_args_parser().parse_args(list(argv)))


def test_the_launchers_settings_come_back_as_its_config(tmp_path: Path) -> None:
    d = _private(tmp_path)
    launch = FtmemLaunchConfig(
        flush_dir=tmp_path / "local",
        flush_persistent_dir=tmp_path / "shared",
        flush_every=5,
        flush_direct=False,
        flush_on_stop=timedelta(seconds=7.5),
        hash_threads=3,
    )
    doc = {"run_dir": str(d), "run_id": "r1", "node": "n1", "slots": 4, "parent_pid": 99}
    path = write_settings(d, doc | launch.smp_settings())
    assert path.stat().st_mode & 0o777 == 0o600
    got = _read("--settings", str(path))
    assert (got.run_dir, got.run_id, got.node, got.slots, got.parent_pid) == (d, "r1", "n1", 4, 99)
    assert got.flush_tiers == [tmp_path / "local", tmp_path / "shared"] and got.flush_shared
    assert (got.flush_every, got.flush_direct, got.hash_threads) == (5, False, 3)
    assert got.flush_on_stop == timedelta(seconds=7.5)
    # Written again (a restarted SMP): replaced whole, still 0600.
    write_settings(d, doc | {"slots": 5})
    assert _read("--settings", str(path)).slots == 5
    # A flag beside the file wins; what neither sets is SmpConfig's default.
    got = _read("--settings", str(path), "--slots", "6", "--no-adopt")
    assert (got.slots, got.adopt, got.flush_keep) == (6, False, 2)


@pytest.mark.parametrize(
    "text",
    [
        '{"run_dir": 5}',
        '{"run_dir": "/x", "slots": "2"}',
        '{"run_dir": "/x", "bogus": 1}',
        "[]",
        "{",
    ],
)
def test_a_malformed_settings_file_is_refused(tmp_path: Path, text: str) -> None:
    d = _private(tmp_path)
    path = d / "smp-settings.json"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    with pytest.raises(ProtocolError):
        _read("--settings", str(path))


def test_a_settings_file_others_can_read_or_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    d = _private(tmp_path)
    path = write_settings(d, {"run_dir": str(d)})
    path.chmod(0o644)
    with pytest.raises(UnsafePathError):
        _read("--settings", str(path))
    path.chmod(0o600)
    link = d / "link.json"
    link.symlink_to(path)
    with pytest.raises(UnsafePathError):
        _read("--settings", str(link))


def test_a_value_smpconfig_refuses_is_a_value_error(tmp_path: Path) -> None:
    d = _private(tmp_path)
    path = write_settings(d, {"run_dir": str(d), "slots": 1})
    with pytest.raises(ValueError, match="slots must be >= 2"):
        _read("--settings", str(path))


def test_a_stop_signal_during_an_smp_spawn_is_raised_after_it() -> None:
    """A SIGTERM whose handler raises (elastic's agent) does not land inside ``Popen`` while
    the SMP is spawned: it is held, then raised once the child can be stopped."""
    import signal

    from ftmem.smp.spawn import _signals_deferred

    class Stopped(Exception):
        pass

    def stop(signum: int, frame: object) -> None:
        raise Stopped

    old = signal.signal(signal.SIGTERM, stop)
    reached = False
    try:
        with pytest.raises(Stopped):
            with _signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # bytecode boundaries: a handler would run here
                    pass
                reached = True
        assert reached
        assert signal.getsignal(signal.SIGTERM) is stop
    finally:
        signal.signal(signal.SIGTERM, old)
