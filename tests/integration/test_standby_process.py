"""One standby process, driven directly (no launcher): ``-m module`` commands and bad handoffs.

The launcher-level behaviour (takeover at a restart, the same view as a cold start for a
script, exit codes, no orphans) is in tests/faults/test_standby.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmem.launch.standby import Standby, StandbyHandler, StandbyPool, parse_python_command

MODULE = """
import json, os, sys
print("MOD " + json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
    "spec": __spec__.name if __spec__ else None, "cwd": os.getcwd(),
}), flush=True)
"""


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[StandbyPool]:
    """A pool whose standbys import only json (torch is always imported)."""
    p = StandbyPool(count=1, imports=(), cuda=False, run_dir=tmp_path, node="t")
    p.imports = ("json",)
    try:
        yield p
    finally:
        p.stop()


def _ready(pool: StandbyPool, cmd: list[str]) -> Standby:
    pool.configure(cmd[0], cmd[1:], 1)
    pool.spawn_missing()
    (standby,) = pool.standbys()
    deadline = time.monotonic() + 120
    while not standby.poll_ready():
        assert standby.popen.poll() is None, (pool.run_dir / "standby-0.log").read_text()
        assert time.monotonic() < deadline, "the standby was not ready in 120 s"
        time.sleep(0.05)
    return standby


def test_a_module_command_runs_as_python_dash_m_would(
    pool: StandbyPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "modx.py").write_text(MODULE)
    monkeypatch.chdir(work)  # the agent's cwd is the rank's
    cmd = [sys.executable, "-u", "-m", "modx", "a", "b c"]
    cold = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    standby = _ready(pool, cmd)
    parsed = parse_python_command(cmd)
    assert parsed is not None
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    handler = StandbyHandler(standby, parsed, {}, str(out), str(err), 0)
    assert handler.proc.pid == standby.pid
    assert handler.proc.wait(60) == 0, err.read_text()
    for f in (handler._stdout, handler._stderr):  # elastic closes them only via close()
        if f is not None:
            f.close()
    assert json.loads(out.read_text().split("MOD ", 1)[1]) == json.loads(cold.split("MOD ", 1)[1])


def test_a_malformed_handoff_is_refused_with_a_clear_line(pool: StandbyPool) -> None:
    standby = _ready(pool, [sys.executable, "-u", "train.py"])
    r, w = os.pipe()
    try:
        socket.send_fds(standby.ctl, [b"{not json"], [w, w])
    finally:
        os.close(r)
        os.close(w)
    assert standby.popen.wait(60) == 70
    assert "malformed handoff" in (pool.run_dir / "standby-0.log").read_text()


def test_a_retired_standby_exits_quietly(pool: StandbyPool) -> None:
    standby = _ready(pool, [sys.executable, "-u", "train.py"])
    standby.ctl.close()  # end of file: the agent no longer needs it
    assert standby.popen.wait(60) == 0
