"""ftmem-launch's command line, configuration and monitor logic (no ranks; the hang test
stops a real ``sleep``)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import time
from argparse import Namespace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.run import get_args_parser as torchrun_args_parser

from ftmem.events import EventLog
from ftmem.launch.cli import apply_standalone, config_from_args, get_args_parser
from ftmem.launch.config import (
    FtmemLaunchConfig,
    apply_safe_env_defaults,
    apply_safe_rdzv_defaults,
    default_run_dir,
)
from ftmem.launch.monitor import (
    NoProgressGuard,
    RankProcess,
    all_resumed,
    find_hangs,
    min_committed,
)
from ftmem.launch.rank_watch import RankWatch
from ftmem.launch.workers import proc_state
from ftmem.protocol.status import RankProgress

FTMEM_FLAGS = {
    "--ftmem-flush-writers",
    "--ftmem-flush-direct",
    "--ftmem-run-dir",
    "--ftmem-node",
    "--ftmem-hang-timeout",
    "--ftmem-first-progress-timeout",
    "--ftmem-slots",
    "--ftmem-smp-start-timeout",
    "--ftmem-no-progress-restarts",
    "--ftmem-status-interval",
    "--ftmem-detect-timeout",
    "--ftmem-smp-log-level",
    "--ftmem-rank-assignment",
    "--ftmem-ec-parity",
    "--ftmem-ec-group-size",
    "--ftmem-ec-interval",
    "--ftmem-key-file",
    "--ftmem-ec-encrypt",
    "--ftmem-ec-encode-workers",
    "--ftmem-checkfree",
    "--ftmem-insecure-mesh",
    "--ftmem-peer-host",
    "--ftmem-rebuild-timeout",
    "--ftmem-flush-dir",
    "--ftmem-flush-persistent-dir",
    "--ftmem-flush-every",
    "--ftmem-flush-keep",
    "--ftmem-hash-threads",
    "--ftmem-standby",
    "--ftmem-standby-import",
    "--ftmem-standby-fork",
    "--ftmem-standby-cuda",
    "--ftmem-rejoin-timeout",
    "--ftmem-metrics-port",
    "--ftmem-metrics-addr",
    "--ftmem-tune",
}


def _flags(parser: object) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}  # type: ignore[attr-defined]


def test_accepts_every_torchrun_flag_plus_the_frozen_ftmem_group() -> None:
    ours, torchs = _flags(get_args_parser()), _flags(torchrun_args_parser())
    assert torchs <= ours
    assert ours - torchs == FTMEM_FLAGS, "a new --ftmem flag needs docs/launcher.md"


def test_defaults_and_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "rd"
    args = get_args_parser().parse_args(
        ["--nproc-per-node", "2", "--ftmem-run-dir", str(run_dir), "train.py", "--x", "1"]
    )
    config, ft, _cmd, cmd_args = config_from_args(args)
    assert (run_dir / "logs").is_dir() and run_dir.stat().st_mode & 0o777 == 0o700
    assert args.tee == "3" and ft.auto_run_dir is False
    assert config.max_restarts == 10  # torchrun: 0
    assert ft.hang_timeout == timedelta(seconds=120)
    assert ft.no_progress_restarts == 3 and ft.slots == 2
    assert cmd_args[-3:] == ["train.py", "--x", "1"]
    assert ft.ec_parity == -1 and ft.key_file is None  # auto: on with >= 3 nodes
    assert ft.standby == 1 and ft.standby_imports == () and ft.standby_cuda is False
    assert ft.checkfree is False
    assert ft.metrics_port == 0 and ft.metrics_addr == "127.0.0.1"  # unauthenticated: this host
    more = get_args_parser().parse_args(
        [
            *("--ftmem-run-dir", str(run_dir), "--ftmem-standby", "2"),
            *("--ftmem-standby-import", "json, xml.dom", "--ftmem-standby-cuda", "t.py"),
        ]
    )
    ft2 = config_from_args(more)[1]
    assert (ft2.standby, ft2.standby_imports, ft2.standby_cuda) == (2, ("json", "xml.dom"), True)
    assert (ft.flush_writers, ft.flush_direct) == (2, True)
    flush = get_args_parser().parse_args(
        [
            *("--ftmem-run-dir", str(run_dir), "--ftmem-flush-dir", str(tmp_path / "t")),
            *("--ftmem-flush-writers", "3", "--ftmem-flush-direct", "off", "t.py"),
        ]
    )
    settings = config_from_args(flush)[1].smp_settings()
    assert settings["flush_writers"] == 3 and settings["flush_direct"] is False


def test_tuning_knobs_are_set_with_ftmem_tune(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--ftmem-tune KEY=VALUE`` sets the knobs ``--help`` no longer lists, parsed as their
    flags parse them (the later setting wins); ``PET_FTMEM_TUNE`` is the environment's form;
    an unknown key or a bad value is refused with the keys or the reason."""
    run_dir = str(tmp_path / "rd")

    def ft(*tune: str) -> Any:
        args = get_args_parser().parse_args(["--ftmem-run-dir", run_dir, *tune, "t.py"])
        return config_from_args(args)[1]

    got = ft(
        *("--ftmem-tune", "slots=4", "--ftmem-tune", "status-interval=0.5"),
        *("--ftmem-tune", "flush-direct=off", "--ftmem-tune", "slots=5"),
        *("--ftmem-tune", "standby-import=json"),
    )
    assert (got.slots, got.status_interval, got.flush_direct) == (5, timedelta(seconds=0.5), False)
    assert got.standby_imports == ("json",)
    help_text = get_args_parser().format_help()
    assert "--ftmem-tune" in help_text and "--ftmem-slots" not in help_text
    assert ft("--ftmem-slots", "3").slots == 3  # the flag itself still works
    for bad, why in (
        ("slot=3", "KEY one of"),
        ("slots", "KEY one of"),
        ("slots=x", "is not valid"),
        ("flush-direct=maybe", "choose from"),
        ("slots=1", "must be >= 2"),
    ):
        with pytest.raises(ValueError, match=why):
            ft("--ftmem-tune", bad)
    monkeypatch.setenv("PET_FTMEM_TUNE", "hash-threads=2,ec-group-size=5")
    got = ft()
    assert (got.hash_threads, got.ec_group_size) == (2, 5)


def test_erasure_coding_defaults_follow_the_node_count(tmp_path: Path) -> None:
    from ftmem.launch.peers import resolve_parity

    def ft_for(*extra: str) -> object:
        args = get_args_parser().parse_args(
            [*extra, "--ftmem-peer-host=127.0.0.1", f"--ftmem-run-dir={tmp_path}/rd", "train.py"]
        )
        return config_from_args(args)[1]

    assert ft_for("--nnodes", "3").slots == 4  # type: ignore[attr-defined]
    assert ft_for("--nnodes", "2:4").slots == 4  # type: ignore[attr-defined]
    assert ft_for("--nnodes", "2").slots == 2  # type: ignore[attr-defined]
    assert ft_for("--nnodes", "4", "--ftmem-ec-parity", "0").slots == 2  # type: ignore[attr-defined]
    assert ft_for("--nnodes", "4", "--ftmem-slots", "5").slots == 5  # type: ignore[attr-defined]
    # One more slot for flushing and one for erasure coding: ranks keep saving every step.
    assert ft_for("--ftmem-flush-dir", "d").slots == 3  # type: ignore[attr-defined]
    assert ft_for("--nnodes", "3", "--ftmem-flush-dir", "d").slots == 5  # type: ignore[attr-defined]
    assert ft_for("--ftmem-hash-threads", "2").smp_settings()["hash_threads"] == 2  # type: ignore[attr-defined]
    assert ft_for("--ftmem-ec-parity", "2").ec_parity == 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="ec-parity"):
        ft_for("--ftmem-ec-parity", "two")
    assert [resolve_parity(-1, n) for n in (1, 2, 3, 8)] == [0, 0, 1, 1]
    assert resolve_parity(2, 3) == 0 and resolve_parity(2, 4) == 2 and resolve_parity(0, 9) == 0


def test_erasure_coding_across_hosts_needs_a_key_file(tmp_path: Path) -> None:
    from ftmem.exchange.keys import generate, write_key_file

    def ft_for(*extra: str) -> FtmemLaunchConfig:
        args = get_args_parser().parse_args(
            [*extra, "--ftmem-run-dir", str(tmp_path / "rd"), "train.py"]
        )
        return config_from_args(args)[1]

    across = ("--nnodes", "3", "--rdzv-endpoint", "10.0.0.1:29400", "--ftmem-peer-host")
    with pytest.raises(ValueError, match="needs the job's key file"):
        ft_for(*across, "10.0.0.2")
    with pytest.raises(ValueError, match="needs the job's key file"):  # the store is remote
        ft_for(*across[:4], "--ftmem-peer-host", "127.0.0.1")
    assert ft_for(*across, "10.0.0.2", "--ftmem-insecure-mesh").insecure_mesh
    key = tmp_path / "job.key"
    write_key_file(key, generate())
    assert ft_for(*across, "10.0.0.2", "--ftmem-key-file", str(key)).key_file == key
    ft_for(*across, "10.0.0.2", "--ftmem-ec-parity", "0")  # no erasure coding: no key
    ft_for("--nnodes", "2", *across[2:], "10.0.0.2")  # auto: off with 2 nodes
    local = ("--rdzv-endpoint", "localhost:29400", "--ftmem-peer-host", "127.0.0.1")
    assert not ft_for("--nnodes", "3", *local).insecure_mesh  # one host: allowed
    assert not ft_for(*local).ec_encrypt and ft_for(*local, "--ftmem-ec-encrypt").ec_encrypt


def test_pet_env_overrides_max_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_FTMEM_HANG_TIMEOUT", "7")
    args = get_args_parser().parse_args(["t.py"])
    assert args.max_restarts == 2 and args.ftmem_hang_timeout == 7.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slots": 1},
        {"hang_timeout": timedelta(seconds=-1)},
        {"no_progress_restarts": -1},
        {"node": "a/b"},
        {"run_dir": Path("/tmp/" + "x" * 100)},
        {"status_interval": timedelta(0)},
        {"rank_assignment": "random"},
    ],
)
def test_invalid_settings_raise_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FtmemLaunchConfig(**kwargs)  # type: ignore[arg-type]


def test_safe_rdzv_defaults_respect_the_user() -> None:
    conf: dict[str, object] = {"join_timeout": 30}
    filled = apply_safe_rdzv_defaults(conf)
    assert conf["join_timeout"] == 30 and "join_timeout" not in filled
    assert conf["keep_alive_max_attempt"] == 5 and conf["keep_alive_interval"] == 1
    with pytest.raises(ValueError):
        apply_safe_rdzv_defaults({"keep_alive_max_attempt": 2})


def test_separate_store_per_round_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert apply_safe_env_defaults(env) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}
    assert apply_safe_env_defaults(env) == {} and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_default_run_dir_fits_an_ipc_socket() -> None:
    d = default_run_dir("r" * 64, "n" * 64)
    assert len(str(d)) + len("/smp.sock") <= 100


def _prog(
    rank: int, pid: int | None, t: float | None, step: int | None = 1, committed: int | None = 1
) -> RankProgress:
    return RankProgress(rank, pid, t, step, committed)


def test_find_hangs_counts_only_this_incarnation_and_stalest_first() -> None:
    procs = [RankProcess(0, 100, 1000.0), RankProcess(1, 101, 1000.0)]
    hang = timedelta(seconds=10)
    # the previous generation's reports (other pid, or before the spawn) never count
    stale = {0: _prog(0, 99, 1005.0), 1: _prog(1, 101, 990.0)}
    assert find_hangs(procs, stale, 2000.0, hang) == []
    # start-up / load: no report yet -> no hang unless a first-progress timeout is set
    assert find_hangs(procs, {}, 2000.0, hang) == []
    first = find_hangs(procs, {}, 2000.0, hang, timedelta(seconds=60))
    assert [v.rank for v in first] == [0, 1]
    live = {0: _prog(0, 100, 1015.0), 1: _prog(1, 101, 1012.0, step=7)}
    assert find_hangs(procs, live, 1020.0, hang) == []
    verdicts = find_hangs(procs, live, 1023.0, hang)
    assert [(v.rank, v.last_step) for v in verdicts] == [(1, 7)]
    assert find_hangs(procs, live, 1030.0, hang)[0].rank == 1
    assert find_hangs(procs, live, 1e9, timedelta(0)) == []  # disabled


def test_a_stopped_rank_is_named_the_hang_even_when_a_blocked_peer_crossed_the_timeout_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Rank 1 stopped mid-step; rank 0, blocked in the next collective, reported its last step
    # earlier and so crosses the timeout first. The stopped rank is still the one named.
    sleepers = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        os.kill(sleepers[1].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(sleepers[1].pid) != "T":
            assert time.monotonic() < deadline, "sleep never showed as stopped"
            time.sleep(0.01)
        watch = RankWatch(
            "n0", EventLog(tmp_path / "events.jsonl", "n0"), timedelta(seconds=3), timedelta(0)
        )
        watch.started([RankProcess(r, p.pid, 1000.0) for r, p in enumerate(sleepers)])
        progress = {
            0: _prog(0, sleepers[0].pid, 1010.0, step=6),
            1: _prog(1, sleepers[1].pid, 1011.0, step=6),
        }
        with caplog.at_level(logging.ERROR, logger="ftmem.launch.rank_watch"):
            watch.check_hangs(progress, 1013.5)  # rank 0 idle 3.5 s, rank 1 only 2.5 s
        assert re.search(
            r"\[n0/1\] HANG: no progress for 2.5 s \(last step 6, process state T\)", caplog.text
        ), caplog.text
        assert set(watch.hang_killed) == {sleepers[1].pid}  # only the stopped one is killed
        assert sleepers[1].wait(10) == -signal.SIGKILL
        assert sleepers[0].poll() is None
    finally:
        for p in sleepers:
            p.kill()
            p.wait(10)


def test_all_resumed_and_min_committed() -> None:
    procs = [RankProcess(0, 100, 1000.0), RankProcess(1, 101, 1000.0)]
    prog = {0: _prog(0, 100, 1001.0, committed=5), 1: _prog(1, 101, 999.0, committed=4)}
    assert not all_resumed(procs, prog)
    prog[1] = _prog(1, 101, 1002.0, committed=4)
    assert all_resumed(procs, prog)
    assert min_committed([0, 1], prog) == 4
    assert min_committed([0, 1, 2], prog) is None


def test_no_progress_guard() -> None:
    g = NoProgressGuard(limit=2)
    assert not g.on_failure(None)  # first failure: nothing to compare with
    assert not g.on_failure(None)  # 1 restart without progress
    assert g.on_failure(None)  # 2 -> stop
    g = NoProgressGuard(limit=2)
    assert [g.on_failure(s) for s in (3, 3, 5, 5, 6)] == [False, False, False, False, False]
    assert not g.on_failure(6)
    assert g.on_failure(6) and g.best == 6
    assert not any(NoProgressGuard(limit=0).on_failure(None) for _ in range(5))


def test_preflight_refuses_the_static_backend_and_an_unreachable_host_name() -> None:
    from ftmem.launch.cli import preflight
    from ftmem.launch.config import check_host_address

    def args(*extra: str) -> Namespace:
        return get_args_parser().parse_args([*extra, "train.py"])

    with pytest.raises(ValueError, match="static cannot restart ranks"):
        preflight(args("--nnodes", "2", "--master-addr", "10.0.0.1"))
    preflight(args("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"))  # one host
    with pytest.raises(ValueError, match="does not resolve"):
        check_host_address(
            max_nodes=2,
            rdzv_host="10.0.0.1",
            local_addr=None,
            environ={},
            hostname="no-such-host.invalid",
        )
    with pytest.raises(ValueError, match="loopback"):
        check_host_address(
            max_nodes=2, rdzv_host="10.0.0.1", local_addr=None, environ={}, hostname="localhost"
        )
    env: dict[str, str] = {}
    assert check_host_address(
        max_nodes=2, rdzv_host="10.0.0.1", local_addr="127.0.0.1", environ=env
    ) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert env == {"GLOO_SOCKET_IFNAME": "lo"}
    assert (
        check_host_address(  # the user's choice stands; one node or loopback: no check
            max_nodes=2, rdzv_host="10.0.0.1", local_addr=None, environ=env, hostname="localhost"
        )
        == {}
    )
    assert check_host_address(max_nodes=1, rdzv_host="10.0.0.1", local_addr=None, environ={}) == {}


def test_standalone_keeps_a_given_rdzv_id_as_the_run_id() -> None:
    """torchrun replaces ``--rdzv-id`` under ``--standalone`` by a random id without a word,
    so ``ftmem status --run-id X`` would find nothing; ftmem-launch keeps it."""
    parser = get_args_parser()
    given = parser.parse_args(["--standalone", "--rdzv-id", "myjob", "train.py"])
    apply_standalone(given)
    assert (given.rdzv_backend, given.rdzv_endpoint, given.rdzv_id) == (
        "c10d",
        "localhost:0",
        "myjob",
    )
    random_id = parser.parse_args(["--standalone", "train.py"])
    apply_standalone(random_id)
    assert random_id.rdzv_id not in ("none", "") and len(random_id.rdzv_id) == 36
