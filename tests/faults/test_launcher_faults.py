"""ftmem-launch on one node under faults: rank killed, rank hung, SMP killed, agent killed.

Each run restores from the node's SMP and must end with the digest of a failure-free run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests._support.launcher import (
    TINY,
    WORKLOAD,
    Launcher,
    digests,
    reference_digests,
    shm_files,
    wait_gone,
    wait_verified,
)

STEPS = 12
RESUMED = r"RESUMED after .*detect->resumed ([0-9.]+) s"


def test_rank_sigkill_restarts_all_ranks_from_memory(launcher_env: Launcher) -> None:
    ref = reference_digests(launcher_env, STEPS)
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        [],
        [str(WORKLOAD), "--steps", str(STEPS), *TINY, "--fail-at-step", "6", "--fail-rank", "1"],
    )
    assert agent.wait(90) == 0, agent.text()[-3000:]
    text = agent.text()
    assert re.search(
        r"\[n0/1\] FAILED: signal SIGKILL .* newest committed step on this node: 6", text
    ), text[-3000:]
    assert text.count("resumed from step 6") == 2
    assert re.search(RESUMED, text)
    assert re.search(r"RESUMED after .* 2 local rank\(s\) restored step 6 and are stepping", text)
    assert digests(text) == ref
    assert shm_files(rid) == []
    events = [
        json.loads(line)
        for line in (launcher_env.tmp / "agent-rd" / "events.jsonl").read_text().splitlines()
    ]
    states = [e["state"] for e in events if e["event"] == "state"]
    # (RUNNING before the failure depends on a status poll seeing every rank step first)
    restart = ["detected", "restarting", "stopped", "joining", "syncing", "started", "running"]
    assert states[:3] == ["joining", "syncing", "started"], states
    assert states[-len(restart) - 1 :] == [*restart, "done"], states
    events = [e for e in events if e["event"] != "state"]
    kinds = [e["event"] for e in events]
    assert kinds == ["ranks_started", "failed", "ranks_started", "resumed"], kinds
    assert events[1]["rank"] == 1 and events[1]["exitcode"] == -signal.SIGKILL
    assert events[3]["committed_before"] == 6 and events[3]["detect_to_resumed_s"] > 0


def test_sigstopped_rank_is_detected_as_hung_and_restarted(launcher_env: Launcher) -> None:
    ref = reference_digests(launcher_env, STEPS)
    rid = launcher_env.new_run_id()
    hang_timeout = 3.0
    agent = launcher_env.single_node(
        rid,
        2,
        ["--ftmem-hang-timeout", str(hang_timeout), "--ftmem-status-interval", "0.5"],
        [
            str(WORKLOAD),
            "--steps",
            str(STEPS),
            *TINY,
            "--fail-at-step",
            "6",
            "--fail-rank",
            "1",
            "--fail-mode",
            "hang",
        ],
    )
    agent.wait_for(r"injecting failure \(hang\)", 60)
    injected = time.monotonic()
    agent.wait_for(r"HANG: no progress", hang_timeout + 10)
    detected = time.monotonic() - injected
    assert detected < hang_timeout + 5, f"hang detected after {detected:.1f} s"
    assert agent.wait(90) == 0, agent.text()[-3000:]
    text = agent.text()
    assert re.search(
        r"\[n0/1\] HANG: no progress for [0-9.]+ s \(last step 6, process state T\)", text
    ), text[-3000:]
    assert text.count("resumed from step 6") == 2
    assert digests(text) == ref


def test_smp_sigkill_restarts_smp_and_ranks(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    # The slot files outlive the SMP: the restarted SMP adopts them and the ranks resume.
    agent = launcher_env.single_node(rid, 2, [], [str(WORKLOAD), "--steps", "100000", *TINY])
    first = agent.wait_for(r"SMP pid (\d+) ready", 60)[0]
    agent.wait_for(r"step 3 loss", 60)
    # Both ranks must hold a snapshot of step 3 before the SMP dies ("step 3 loss" is logged
    # before step 3's save is committed; the resumed step is checked against it below).
    wait_verified(launcher_env.tmp / "agent-rd", {0, 1}, 60, min_step=3)
    smp_pid = int(first.group(1))
    import os

    os.kill(smp_pid, signal.SIGKILL)
    agent.wait_for(
        rf"FAILED: SMP pid {smp_pid} died \(signal SIGKILL\).*newest committed step on this "
        r"node: (\d+|None) as last seen before the SMP died",
        15,
    )
    agent.wait_for(r"SMP pid \d+ ready in [0-9.]+ s .*start #2", 30)
    agent.wait_for(RESUMED, 60)
    later = re.findall(r"resumed from step (\d+)", agent.text())[2:]
    assert len(later) == 2 and all(int(x) >= 3 for x in later), later
    assert re.search(rf"RESUMED after .*restored step {later[0]} and are stepping", agent.text())
    # every phase accounted for, the stop and the rendezvous included
    assert re.search(r"RESUMED after .*phases: stop [0-9.]+ s, rendezvous [0-9.]+ s", agent.text())
    kids = agent.descendants()
    agent.signal(signal.SIGTERM)
    assert agent.wait(40) == 1
    assert not wait_gone(kids, 10)
    assert shm_files(rid) == []


@pytest.mark.timeout(240)
def test_smp_sigkill_without_fresh_start_stops_with_a_clear_message(launcher_env: Launcher) -> None:
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        ["--ftmem-no-progress-restarts", "1", "--ftmem-status-interval", "0.2"],
        [str(WORKLOAD), "--steps", "100000", *TINY],
    )
    first = agent.wait_for(r"SMP pid (\d+) ready", 60)[0]
    # Give the agent's status poll time to learn a committed step (what it passes to restarts).
    agent.wait_for(r"step 10 loss", 60)
    wait_verified(launcher_env.tmp / "agent-rd", {0, 1}, 60)
    time.sleep(1.0)
    # Lose the memory too: stop the SMP, remove its slot files, then kill it.
    smp_pid = int(first.group(1))
    os.kill(smp_pid, signal.SIGSTOP)
    for name in shm_files(rid):
        os.unlink(name)
    os.kill(smp_pid, signal.SIGKILL)
    code = agent.wait(200)
    text = agent.text()
    assert code != 0, text[-3000:]
    assert "no snapshot is left" in text and "FTMEM_ALLOW_FRESH_START" in text
    assert "resumed from step 0" not in text.split("SMP pid")[-1]
    assert shm_files(rid) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_agent_sigkill_leaves_no_orphans(launcher_env: Launcher, sig: signal.Signals) -> None:
    """Neither ranks nor the SMP nor the fork server outlive a SIGKILLed (or SIGTERMed)
    agent: the parent-death signals (the ranks' is tied to the fork server's), or the agent's
    own shutdown."""
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        ["--ftmem-status-interval", "0.2"],
        [str(WORKLOAD), "--steps", "100000", *TINY, "--step-delay", "0.05"],
    )
    agent.wait_for(r"\[rank 1\] \S+ INFO: step 3 loss", 90)
    kids = agent.descendants()
    assert len(kids) >= 4  # 2 ranks, the fork server, the SMP
    agent.signal(sig)  # the agent alone, not its group
    agent.popen.wait(60)  # its parent (a shell, a scheduler) reaps it
    alive = wait_gone(kids, 10)
    assert not alive, f"orphans of the agent ({sig.name}): {alive}"
    # the SMP removed its shared memory when it saw its parent go
    deadline = time.monotonic() + 5
    while shm_files(rid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert shm_files(rid) == []


def test_stopped_rank_does_not_stall_the_restart_after_a_peer_dies(
    launcher_env: Launcher,
) -> None:
    """Rank 1 is SIGSTOPped, then rank 0 is SIGKILLed: elastic would SIGTERM rank 1 and
    wait 30 s for it; the agent SIGKILLs the stopped rank at once."""
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        ["--ftmem-hang-timeout", "0"],
        [
            str(WORKLOAD),
            "--steps",
            str(STEPS),
            *TINY,
            "--fail-at-step",
            "6",
            "--fail-rank",
            "1",
            "--fail-mode",
            "hang",
        ],
    )
    agent.wait_for(r"injecting failure \(hang\)", 60)
    lines = (launcher_env.tmp / "agent-rd" / "events.jsonl").read_text().splitlines()
    started = next(e for e in map(json.loads, lines) if e["event"] == "ranks_started")
    rank0 = started["pids"][started["ranks"].index(0)]
    time.sleep(0.5)
    killed = time.monotonic()
    import os

    os.kill(rank0, signal.SIGKILL)
    agent.wait_for(r"\[n0/1\] pid \d+ is stopped .* SIGKILL", 5)
    agent.wait_for(r"RESUMED after signal SIGKILL", 30)
    assert time.monotonic() - killed < 20
    assert agent.wait(60) == 0, agent.text()[-3000:]


_HANG_ON_SIGTERM = """
import os, runpy, signal, sys, time

def hang(signum, frame):  # like Lightning's SIGTERM handler: a collective with a dead peer
    while os.path.exists(os.environ["HANG_WHILE"]):
        time.sleep(0.1)
    sys.exit(143)

signal.signal(signal.SIGTERM, hang)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_rank_whose_sigterm_handler_hangs_does_not_hold_the_restart(
    launcher_env: Launcher,
) -> None:
    """The SMP is SIGKILLed, so every rank restarts cold and gets SIGTERM; their SIGTERM
    handler does not return (Lightning's broadcasts inside DDP's backward). elastic would wait
    30 s before its SIGKILL; a restart gives the ranks RESTART_STOP_GRACE_S (3 s). At the end
    of the job the handler returns and the ranks stop on SIGTERM as usual."""
    wrapper = launcher_env.tmp / "hang_on_sigterm.py"
    wrapper.write_text(_HANG_ON_SIGTERM)
    marker = launcher_env.tmp / "hang-while"
    marker.touch()
    rid = launcher_env.new_run_id()
    agent = launcher_env.single_node(
        rid,
        2,
        [],
        [str(wrapper), str(WORKLOAD), "--steps", "100000", *TINY],
        HANG_WHILE=str(marker),
    )
    first = agent.wait_for(r"SMP pid (\d+) ready", 60)[0]
    agent.wait_for(r"step 3 loss", 60)
    wait_verified(launcher_env.tmp / "agent-rd", {0, 1}, 60, min_step=3)
    os.kill(int(first.group(1)), signal.SIGKILL)
    killed = time.monotonic()
    agent.wait_for(RESUMED, 25)  # elastic alone: 30 s, then the restart
    assert time.monotonic() - killed < 25
    marker.unlink()
    kids = agent.descendants()
    agent.signal(signal.SIGTERM)
    assert agent.wait(40) == 1, agent.text()[-4000:]  # its last lines if it aborts
    assert not wait_gone(kids, 10)
    assert shm_files(rid) == []
