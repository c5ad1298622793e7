"""The process harness: its ftmem-launch command line is what ftmem-launch's parser reads, an
agent's environment, and a started process stopped by pid and group within a bound."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ftmem.launch.cli import get_args_parser
from tests._support.launcher import (
    AgentProcess,
    agent_env,
    launch_args,
    launch_command,
    pid_gone,
    wait_gone,
)


def test_launch_args_parse_as_ftmem_launch_reads_them() -> None:
    args = launch_args(
        nnodes=3,
        nproc=2,
        rdzv_endpoint="127.0.0.1:2950",
        rdzv_id="r1",
        node="n1",
        run_dir=Path("/tmp/rd"),
        is_host=False,
        flags=["--ftmem-ec-parity=1"],
        script=["train.py", "--steps", "4"],
    )
    ns = get_args_parser().parse_args(args)
    assert (ns.nnodes, ns.nproc_per_node, ns.rdzv_backend) == ("3", "2", "c10d")
    assert (ns.rdzv_endpoint, ns.rdzv_id, ns.rdzv_conf) == ("127.0.0.1:2950", "r1", "is_host=0")
    assert (ns.monitor_interval, ns.ftmem_node, ns.ftmem_run_dir) == (0.1, "n1", "/tmp/rd")
    assert ns.ftmem_ec_parity == "1"
    assert (ns.training_script, ns.training_script_args) == ("train.py", ["--steps", "4"])
    assert launch_command(args)[:3] == [sys.executable, "-m", "ftmem.launch"]
    plain = launch_args(
        rdzv_endpoint="h:1", rdzv_id="r", node="n0", run_dir="d", monitor_interval=None
    )
    assert "--rdzv-conf" not in plain and "--monitor-interval" not in plain


def test_agent_env_drops_the_callers_ftmem_variables() -> None:
    base = {"FTMEM_RUN_DIR": "/x", "FTMEM_FAULT": "f", "PYTHONPATH": "/a", "PET_FTMEM_STANDBY": "1"}
    env = agent_env({"FTMEM_NODE": "n2"}, pythonpath=["/repo"], base=base)
    assert env == {
        "PYTHONPATH": "/repo:/a",
        "OMP_NUM_THREADS": "1",
        "PET_FTMEM_STANDBY": "1",  # the caller's choice
        "FTMEM_NODE": "n2",
    }


def test_a_process_that_ignores_sigterm_is_killed_with_its_children(tmp_path: Path) -> None:
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = AgentProcess([sys.executable, "-c", code], tmp_path / "p.log", {}, name="p")
    with proc:
        assert proc.wait_log(r"up", 30)
        kids = proc.descendants()
        assert len(kids) == 1
        t0 = time.monotonic()
        proc.stop(term_timeout=1.0)
        assert time.monotonic() - t0 < 20
    assert proc.poll() is not None and pid_gone(proc.pid)
    assert not wait_gone(kids, 10)
