"""Pure parts of standby ranks and restart timing: command parsing and the phase split."""

from __future__ import annotations

import json
import sys

from ftmem.launch.report import Recovery, restart_phases
from ftmem.launch.standby import PythonCommand, parse_python_command, unwrap_shim
from ftmem.launch.workers import SHIM_PATH


def test_parse_python_command_accepts_scripts_and_modules() -> None:
    py = sys.executable
    cmd = parse_python_command([py, "-u", "train.py", "--lr", "1"])
    assert cmd == PythonCommand(py, ("-u",), "script", "train.py", ("--lr", "1"))
    assert cmd.argv() == ["train.py", "--lr", "1"]
    assert cmd.path0("/w") == "/w"
    mod = parse_python_command([py, "-uB", "-m", "pkg.train", "x"])
    assert mod == PythonCommand(py, ("-uB",), "module", "pkg.train", ("x",))
    assert mod.argv() == ["-m", "x"] and mod.path0("/w") == "/w"


def test_parse_python_command_refuses_what_a_standby_cannot_run() -> None:
    py = sys.executable
    for cmd in (
        ["/usr/bin/trainer", "--x"],  # not Python (--no-python)
        [py, "-c", "print(1)"],
        [py, "-X", "dev", "train.py"],  # a flag with an argument
        [py, "--check-hash-based-pycs", "always", "t.py"],
        [py, "-u"],
        [py, "-m"],
        [py, "-", "x"],  # stdin
    ):
        assert parse_python_command(cmd) is None, cmd


def test_unwrap_shim_gives_the_ranks_own_command() -> None:
    py = sys.executable
    assert unwrap_shim(py, ["-S", str(SHIM_PATH), py, "-u", "t.py"]) == [py, "-u", "t.py"]
    assert unwrap_shim(py, ["-u", "t.py"]) == [py, "-u", "t.py"]


def test_restart_phases_split_at_the_slowest_rank() -> None:
    rec = Recovery(detected=10.0, what="x", committed=5, stopped=10.2, rendezvous=10.3)
    rec.started = 10.35
    phases = restart_phases(rec, [(11.0, 11.5, 11.9), (11.2, 11.4, 12.0)])
    assert phases == {
        "stop": 0.2,
        "rendezvous": 0.1,
        "start": 0.05,
        "script": 0.85,
        "load": 0.3,
        "first_step": 0.5,
    }
    # a rank that never spoke to the SMP (no ftmem.load): those phases are unknown
    partial = restart_phases(rec, [(11.0, None, 11.9), (11.2, 11.4, 12.0)])
    assert partial["script"] == 0.85 and partial["load"] is None and partial["first_step"] is None


def test_timeline_shows_the_restart_phases_and_standby_starts() -> None:
    from ftmem.observe.timeline import marks_of, parse_line

    lines = [
        {"time": 1.0, "node": "n0", "event": "ranks_started", "generation": 0},
        {
            "time": 5.0,
            "node": "n0",
            "event": "ranks_started",
            "generation": 1,
            "from_standby": [0],
            "in_process": [1],
        },
        {
            "time": 6.0,
            "node": "n0",
            "event": "resumed",
            "step": 7,
            "detect_to_resumed_s": 1.2,
            "phases": {"stop": 0.1, "rendezvous": 0.05, "script": None},
        },
    ]
    events = [parse_line(json.dumps(x), "events.jsonl", "n0") for x in lines]
    labels = [m.label for m in marks_of([e for e in events if e is not None])]
    assert any(
        "from standbys: ranks [0], rejoined in process: ranks [1]" in label for label in labels
    ), labels
    resumed = next(label for label in labels if label.startswith("at step 7"))
    assert resumed.endswith("phases: stop 0.10 s, rendezvous 0.05 s"), resumed
