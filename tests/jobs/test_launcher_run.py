"""ftmem-launch on one node with real processes: clean run, env, SIGTERM, restart limits."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from tests._support.launcher import TINY, WORKLOAD, Launcher, digests, shm_files, wait_gone

ENV_SCRIPT = """
import ctypes, json, os, socket
libc = ctypes.CDLL(None)
sig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
keys = ["FTMEM_RUN_DIR", "FTMEM_RUN_ID", "FTMEM_NODE", "FTMEM_GENERATION", "RANK",
        "FTMEM_EXPECTED_STEP",
        "TORCHELASTIC_USE_AGENT_STORE"]
# No rank serves a store here: a listener on MASTER_PORT is the agent's.
with socket.socket() as s:
    s.settimeout(10)
    served = s.connect_ex((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))) == 0
print("ENV " + json.dumps({**{k: os.environ.get(k) for k in keys}, "pdeathsig": sig.value,
                           "store_served": served}), flush=True)
"""


def test_clean_run_same_digest_on_all_ranks_and_smp_stopped(launcher_env: Launcher) -> None:
    # Its own run (reference_digests caches across tests, so its log may be elsewhere).
    rid = launcher_env.new_run_id()
    run = launcher_env.single_node(
        rid, 2, [], [str(WORKLOAD), "--steps", "12", *TINY], name="clean"
    )
    assert run.wait(90) == 0, run.text()[-3000:]
    log = run.text()
    ref = digests(log)
    assert len(ref) == 2 and len(set(ref.values())) == 1
    assert re.search(r"SMP pid \d+ ready", log)
    assert re.search(r"SMP pid \d+ exited with 0", log)
    assert "FAILED" not in log


def test_ranks_get_ftmem_env_and_a_parent_death_signal(launcher_env: Launcher) -> None:
    script = launcher_env.tmp / "env.py"
    script.write_text(ENV_SCRIPT)
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(rid, 2, [], [str(script)])
    assert agent.wait(60) == 0, agent.text()[-3000:]
    import json

    envs = [json.loads(m) for m in re.findall(r"ENV (\{.*\})", agent.text())]
    assert sorted(e["RANK"] for e in envs) == ["0", "1"]
    for e in envs:
        assert e["FTMEM_RUN_DIR"] == str(launcher_env.tmp / "agent-rd")
        assert e["FTMEM_RUN_ID"] == rid and e["FTMEM_NODE"] == "n0"
        assert e["FTMEM_GENERATION"] == "0"
        assert e["FTMEM_EXPECTED_STEP"] == ""  # first start: nothing to restore
        assert e["pdeathsig"] == signal.SIGKILL
        # A fresh store per generation, served by the agent: every rank is a client of it.
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["store_served"] is True


def test_sigterm_stops_ranks_and_smp_and_frees_shared_memory(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(rid, 2, [], [str(WORKLOAD), "--steps", "100000", *TINY])
    agent.wait_for(r"step 3 loss", 60)
    assert shm_files(rid), "the ranks' arenas should exist while training"
    kids = agent.descendants()
    assert len(kids) >= 3  # SMP + 2 ranks
    # A single-node run opens no TCP port in its SMP (the peer mesh is for 3+ nodes).
    import psutil

    smps = [p for p in map(psutil.Process, kids) if "ftmem.smp" in " ".join(p.cmdline())]
    assert len(smps) == 1
    assert smps[0].net_connections(kind="tcp") == []
    agent.signal(signal.SIGTERM)
    assert agent.wait(40) == 1  # as torchrun: SignalException, its traceback printed
    assert "SignalException: Process" in agent.text()
    assert not wait_gone(kids, 10)
    assert shm_files(rid) == []
    assert re.search(r"SMP pid \d+ exited with 0", agent.text())


def _die_script(tmp: Path) -> Path:
    script = tmp / "die.py"
    script.write_text("import sys\nprint('dying now', file=sys.stderr, flush=True)\nsys.exit(3)\n")
    return script


def test_crash_loop_stops_with_a_no_progress_report(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        1,
        ["--max-restarts", "10", "--ftmem-no-progress-restarts", "2"],
        [str(_die_script(launcher_env.tmp))],
    )
    assert agent.wait(60) != 0
    text = agent.text()
    assert len(re.findall(r"FAILED: exit code 3", text)) == 3
    assert "NO PROGRESS: 2 restart(s) in a row without a newer committed step" in text
    assert "ChildFailedError" in text and "exitcode  : 3" in text  # torchrun's summary
    assert re.search(r"\[n0/0\] last failure: exit code 3; the rank's last 1 lines", text)
    assert re.search(r"^    dying now$", text, re.M)


def test_max_restarts_is_honoured(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        1,
        ["--max-restarts", "1", "--ftmem-no-progress-restarts", "0"],
        [str(_die_script(launcher_env.tmp))],
    )
    assert agent.wait(60) != 0
    text = agent.text()
    assert len(re.findall(r"FAILED: exit code 3", text)) == 2
    assert "restarting (1/1)" in text and "no restarts left (max 1)" in text
    assert "NO PROGRESS" not in text
