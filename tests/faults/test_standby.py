"""Warm starts under real failures: the fork server (the default, which every other launcher
test uses too) and standby ranks (``--ftmem-tune standby-fork=off``) hand ranks to warm
processes. That none outlives its agent (SIGKILL, SIGTERM) is tested with the agent's other
children in test_launcher_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
from pathlib import Path
from typing import Any

import psutil

from tests._support.launcher import TINY, WORKLOAD, Launcher, digests, reference_digests

READY = r"\[n0\] standby pid (\d+) for local rank (\d+) ready"
SERVER = r"\[n0\] ranks start from a fork server \(pid (\d+)\)"
PER_RANK = ["--ftmem-standby", "1", "--ftmem-tune", "standby-fork=off"]
STARTED = r"generation (\d+): started ranks \[([0-9, ]+)\] \(pids \[([0-9, ]+)\]"


def _pids(match: re.Match[str]) -> list[int]:
    return [int(p) for p in match.group(3).split(",")]


def test_sigkilled_rank_is_replaced_by_standbys_and_a_dead_standby_by_a_cold_start(
    launcher_env: Launcher,
) -> None:
    steps = 60
    ref = reference_digests(launcher_env, steps)
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        [*PER_RANK, "--ftmem-status-interval", "0.2"],
        [
            str(WORKLOAD),
            "--steps",
            str(steps),
            *TINY,
            "--step-delay",
            "0.25",
            "--fast-after-resume",
        ],
    )
    ready = {int(m.group(2)): int(m.group(1)) for m in agent.wait_for(READY, 90, count=2)}
    assert sorted(ready) == [0, 1]
    ranks = _pids(agent.wait_for(STARTED, 5)[0])
    # local rank 0's standby dies before it is needed: that rank must start cold
    psutil.Process(ready[0]).send_signal(signal.SIGKILL)
    agent.wait_for(rf"standby pid {ready[0]} for local rank 0 died", 10)
    psutil.Process(ranks[1]).send_signal(signal.SIGKILL)
    agent.wait_for(r"RESUMED after signal SIGKILL", 60)
    assert agent.wait(120) == 0, agent.text()[-3000:]
    text = agent.text()
    # its replacement is started at once, but is not ready by the time rank 1 dies
    cold = r"(no standby|standby) for local rank 0 (is not ready yet \(pid \[(\d+)\]\))?: cold"
    found = re.search(cold, text)
    assert found, text[-3000:]
    if found.group(3):  # not ready: on these cores (none idle) it is retired, not left warming
        assert "retired, so that its warm-up does not slow the cold start" in text
        assert (
            not psutil.pid_exists(int(found.group(3)))
            or psutil.Process(int(found.group(3))).status() == psutil.STATUS_ZOMBIE
        )
    second = next(m for m in re.finditer(STARTED, text) if m.group(1) != "0")
    assert _pids(second)[1] == ready[1]  # rank 1 is the standby's process
    assert re.search(r"generation \d+: started ranks .*from standbys: ranks \[1\]", text)
    resumed = [int(s) for s in re.findall(r"\[rank \d\] resumed from step (\d+)", text)]
    assert len(resumed) == 4 and resumed[2] == resumed[3] > 0, resumed
    assert digests(text) == ref
    events = [
        json.loads(line)
        for line in (launcher_env.tmp / "agent-rd" / "events.jsonl").read_text().splitlines()
    ]
    restarted = [e for e in events if e["event"] == "ranks_started"][1]
    assert restarted["from_standby"] == [1]
    phases = next(e for e in events if e["event"] == "resumed")["phases"]
    for name in ("stop", "rendezvous", "start", "script", "load", "first_step"):
        assert phases[name] is not None and phases[name] >= 0, phases


def test_a_killed_fork_server_takes_its_ranks_along_and_a_new_one_serves_the_next_restart(
    launcher_env: Launcher,
) -> None:
    """The fork server forks the ranks; SIGKILLed, it takes them along (their parent-death
    signal): the node restarts them cold from memory, starts a new fork server once they
    step, and the next restart forks from it. The digests are the failure-free run's."""
    steps = 60
    ref = reference_digests(launcher_env, steps)
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        ["--ftmem-status-interval", "0.2"],
        [str(WORKLOAD), "--steps", str(steps), *TINY, "--step-delay", "0.4"],
    )
    server = int(agent.wait_for(SERVER, 60)[0].group(1))
    first = agent.wait_for(STARTED, 120)[0]
    assert [psutil.Process(p).ppid() for p in _pids(first)] == [server, server]
    assert re.search(r"from standbys: ranks \[0, 1\]", agent.text())
    agent.wait_for(r"\[rank 1\] \S+ INFO: step 5 loss", 60)
    os.kill(server, signal.SIGKILL)
    agent.wait_for(r"RESUMED after", 90)
    second = agent.wait_for(r"generation 1: started ranks .*", 5)[0].group(0)
    assert "from standbys" not in second  # cold: the server was gone
    fresh = agent.wait_for(r"\[n0\] fork server pid (\d+) ready", 90, count=2)
    new_server = int(fresh[-1].group(1))
    assert new_server != server
    os.kill(_pids(agent.wait_for(STARTED, 5, count=2)[1])[1], signal.SIGKILL)
    third = agent.wait_for(r"generation 2: started ranks .*", 90)[0].group(0)
    assert "from standbys: ranks [0, 1]" in third
    assert agent.wait(120) == 0, agent.text()[-3000:]
    assert digests(agent.text()) == ref


IDENTITY_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, signal, sys, time

    def streams(s):
        return [s.line_buffering, s.write_through, s.encoding, s.errors, s.fileno()]

    libc = ctypes.CDLL(None)
    death = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
    sigs = ("SIGINT", "SIGTERM", "SIGPIPE", "SIGXFSZ", "SIGCHLD", "SIGHUP", "SIGUSR1", "SIGQUIT")
    info = {
        "name": __name__,
        "file": __file__,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "spec": repr(__spec__),
        "package": __package__,
        "cached": repr(globals().get("__cached__")),
        "main_is_us": sys.modules["__main__"].__dict__ is globals(),
        "env": dict(os.environ),
        "signals": {n: repr(signal.getsignal(getattr(signal, n))) for n in sigs},
        "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "pdeathsig": death.value,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "stdout": streams(sys.stdout),
        "stderr": streams(sys.stderr),
    }
    print("IDENTITY " + json.dumps(info), flush=True)
    generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if generation == 0 and os.environ.get("WAIT_FOR_STANDBY"):
        import ftmem  # progress makes the agent start the standby; wait until it is ready
        events = os.path.join(os.environ["FTMEM_RUN_DIR"], "events.jsonl")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ftmem.heartbeat(1)
            with open(events) as f:
                if "standbys_ready" in f.read():
                    break
            time.sleep(0.2)
    if generation == 0:
        sys.exit(3)
    if generation == 1:
        raise ValueError("boom from generation 1")
    """
)

# Variables that differ between any two generations, cold or not.
PER_GENERATION = {
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    "FTMEM_GENERATION",
    "FTMEM_EXPECTED_STEP",
    "MASTER_PORT",
}


def _identities(text: str) -> list[dict[str, Any]]:
    return [json.loads(m) for m in re.findall(r"IDENTITY (\{.*\})", text)]


def _own_traceback(text: str) -> str:
    """Generation 1's traceback, without the IDENTITY lines that interleave with it.

    stdout and stderr reach the agent's log through separate pipes, so a rank's IDENTITY line
    (whose environment names this test file, test_standby.py) can land inside the traceback.
    """
    end = text.index("ValueError: boom from generation 1")
    tb = text[text.rindex("Traceback", 0, end) : end]
    return "\n".join(line for line in tb.splitlines() if "IDENTITY" not in line)


def _identity_job(launcher: Launcher, tmp_path: Path, flags: list[str], **env: str) -> str:
    script_dir = tmp_path / "job"
    script_dir.mkdir(exist_ok=True)
    script = script_dir / "identity.py"
    script.write_text(IDENTITY_SCRIPT)
    agent = launcher.single_node(
        launcher.new_run_id(),
        1,
        [*flags, "--ftmem-status-interval", "0.2", "--max-restarts", "3"],
        [str(script), "--an", "arg", "x y"],
        **env,
    )
    assert agent.wait(180) == 0, agent.text()[-3000:]
    return agent.text()


def test_a_forked_rank_runs_the_script_as_a_cold_start_would(
    launcher_env: Launcher, tmp_path: Path
) -> None:
    """Every generation of a job is forked by its fork server; each sees what the same
    generation of a cold job (``--ftmem-standby 0``) sees, but for the run's own names."""
    text = _identity_job(launcher_env, tmp_path, [])
    assert re.search(r"generation 2: started ranks \[0\] .*from standbys: ranks \[0\]", text)
    assert re.search(r"FAILED: exit code 3 \(generation 0\)", text)
    assert re.search(r"FAILED: exit code 1 \(generation 1\)", text)
    tb = _own_traceback(text)
    assert "_standby.py" not in tb and "identity.py" in tb
    cold_text = _identity_job(launcher_env, tmp_path, ["--ftmem-standby", "0"])
    assert "from standbys" not in cold_text
    for forked, cold in zip(_identities(text), _identities(cold_text), strict=True):
        for key in cold:
            if key != "env":
                assert forked[key] == cold[key], (key, forked[key], cold[key])
        assert set(forked["env"]) == set(cold["env"])
        differ = {k for k, v in cold["env"].items() if forked["env"][k] != v}
        assert differ <= RUN_OWN | PER_GENERATION, differ


# Variables whose values are the run's own (two jobs differ in them).
RUN_OWN = {"TORCHELASTIC_RUN_ID", "FTMEM_RUN_ID", "FTMEM_AGENT_PID", "MASTER_PORT"}


def test_a_standby_runs_the_script_as_a_cold_start_would(
    launcher_env: Launcher, tmp_path: Path
) -> None:
    text = _identity_job(launcher_env, tmp_path, PER_RANK, WAIT_FOR_STANDBY="1")
    cold, standby, cold_again = _identities(text)
    assert re.search(r"generation 1: started ranks \[0\] .*from standbys: ranks \[0\]", text)
    assert "from standbys" not in re.findall(r"generation 2: started ranks.*", text)[0]
    assert cold["name"] == "__main__" and cold["main_is_us"] is True
    assert cold["argv"] == [str(tmp_path / "job" / "identity.py"), "--an", "arg", "x y"]
    for key in cold:
        if key == "env":
            continue
        assert standby[key] == cold[key], (key, standby[key], cold[key])
        assert cold_again[key] == cold[key], key
    env_cold = {k: v for k, v in cold["env"].items() if k not in PER_GENERATION}
    env_standby = {k: v for k, v in standby["env"].items() if k not in PER_GENERATION}
    assert env_standby == env_cold
    assert cold["pdeathsig"] == signal.SIGKILL
    # exit codes reach elastic as for any rank; the traceback is the script's own
    assert re.search(r"FAILED: exit code 3 \(generation 0\)", text)
    assert re.search(r"FAILED: exit code 1 \(generation 1\)", text)
    tb = _own_traceback(text)
    assert "_standby.py" not in tb and "identity.py" in tb
    # the standby wrote into elastic's per-rank log file of its attempt
    logs = list((launcher_env.tmp / "agent-rd" / "logs").glob("*/attempt_1/0/stdout.log"))
    assert len(logs) == 1 and "IDENTITY" in logs[0].read_text()
