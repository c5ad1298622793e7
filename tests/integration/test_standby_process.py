"""One standby process and one fork server, driven directly (no launcher): ``-m module``
commands, exit statuses, bad handoffs.

The launcher-level behaviour (takeover at a restart, the same view as a cold start for a
script, exit codes, no orphans) is in tests/faults/test_standby.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftmem.launch.standby import Standby, StandbyHandler, parse_python_command
from ftmem.launch.warm_start import StandbyPool
from ftmem.launch.workers import proc_state

MODULE = """
import json, os, sys
print("MOD " + json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
    "spec": __spec__.name if __spec__ else None, "cwd": os.getcwd(),
}), flush=True)
"""


@pytest.fixture(params=[False, True], ids=["standby", "fork-server"])
def pool(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StandbyPool]:
    """A pool of standby ranks, or a fork server, that import only json (and torch)."""
    p = StandbyPool(count=1, imports=(), cuda=False, run_dir=tmp_path, node="t")
    p.fork = request.param
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
        assert standby.popen.poll() is None, _log(pool).read_text()
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
    if pool.server is not None:
        handler = StandbyHandler(pool.server, parsed, {}, str(out), str(err), 0)
        assert handler.proc.pid != standby.pid  # a child of the fork server
    else:
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
    assert "malformed handoff" in _log(pool).read_text()


def _log(pool: StandbyPool) -> Path:
    return pool.run_dir / ("fork-server.log" if pool.fork else "standby-0.log")


EXITS = """
import os, signal, sys
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "raise":
    raise ValueError("boom")
if how == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
print("done", flush=True)
"""


def test_the_fork_server_reports_each_ranks_exit_as_popen_would(tmp_path: Path) -> None:
    """Forked ranks end with the status a cold ``python script.py`` gives (code, uncaught
    exception, signal, success); a hung one is killed through its handle; the server lives on
    between them and ranks run side by side."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    p = StandbyPool(count=1, imports=(), cuda=False, run_dir=tmp_path, node="t")
    p.imports = ("json",)
    try:
        cmd = [sys.executable, "-u", str(script)]
        _ready(p, cmd)
        assert p.server is not None
        parsed = parse_python_command(cmd)
        assert parsed is not None
        want = {"code": 3, "raise": 1, "signal": -9, "ok": 0}
        handlers = {}
        for how in want:
            args = parse_python_command([*cmd, how])
            assert args is not None
            out, err = tmp_path / f"{how}.out", tmp_path / f"{how}.err"
            handlers[how] = StandbyHandler(p.server, args, {}, str(out), str(err), 0)
        for how, code in want.items():
            assert handlers[how].proc.wait(60) == code, (tmp_path / f"{how}.err").read_text()
            for f in (handlers[how]._stdout, handlers[how]._stderr):
                if f is not None:
                    f.close()
        assert "ValueError: boom" in (tmp_path / "raise.err").read_text()
        assert "_standby.py" not in (tmp_path / "raise.err").read_text()
        assert (tmp_path / "ok.out").read_text() == "done\n"
        hung = parse_python_command([sys.executable, "-u", "-c", "x"])  # refused: -c
        assert hung is None
        (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
        sleeper = parse_python_command([sys.executable, "-u", str(tmp_path / "sleep.py")])
        assert sleeper is not None
        handler = StandbyHandler(p.server, sleeper, {}, None, None, 0)
        assert handler.proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            handler.proc.wait(0.2)
        handler.close(signal.SIGKILL)  # elastic's close: killpg of the rank's session
        assert handler.proc.wait(30) == -signal.SIGKILL
        ok = parse_python_command([*cmd, "ok"])
        assert ok is not None
        quick = StandbyHandler(p.server, ok, {}, None, None, 0)
        deadline = time.monotonic() + 30
        while proc_state(quick.proc.pid) is not None:  # reaped by the server, unread here
            assert time.monotonic() < deadline
            time.sleep(0.01)
        quick.close(signal.SIGTERM)  # as elastic closes a rank its last poll saw running
        assert quick.proc.wait(30) == 0
        assert p.server.standby.popen.poll() is None  # the server lives on
        assert not p.server.forked  # every rank reported reaped: no pid kept to be reused
    finally:
        p.stop()


def test_the_fork_server_reports_ranks_in_the_order_they_died(tmp_path: Path) -> None:
    """Ranks that die while the fork server waits for a CPU (here: stopped) are reported in
    the order they died, not in the order they were forked: the agent names the first."""
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    p = StandbyPool(count=1, imports=(), cuda=False, run_dir=tmp_path, node="t")
    p.imports = ("json",)
    try:
        cmd = [sys.executable, "-u", str(tmp_path / "sleep.py")]
        server_proc = _ready(p, cmd)
        assert p.server is not None
        args = parse_python_command(cmd)
        assert args is not None
        first, second = (StandbyHandler(p.server, args, {}, None, None, i) for i in range(2))
        os.kill(server_proc.pid, signal.SIGSTOP)
        try:
            for handler in (second, first):  # the one forked second dies first
                os.kill(handler.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while proc_state(handler.proc.pid) != "Z":  # dead, not reaped: the server sleeps
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        finally:
            os.kill(server_proc.pid, signal.SIGCONT)
        assert first.proc.wait(30) == second.proc.wait(30) == -signal.SIGKILL
        died = p.server.reaped_at
        assert died[second.proc.pid] < died[first.proc.pid], died
    finally:
        p.stop()


def test_a_new_fork_server_waits_until_the_dead_ones_ranks_are_gone(tmp_path: Path) -> None:
    """A fork server's socket closes before its death signal ends its ranks: while one of
    them still runs, no new server starts (the restart comes first, cold); once it is gone,
    one does. The rank here clears its death signal, to hold that moment open."""
    script = tmp_path / "linger.py"
    script.write_text(
        "import ctypes, sys, time\n"
        "ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = StandbyPool(count=1, imports=(), cuda=False, run_dir=tmp_path, node="t")
    p.imports = ("json",)
    try:
        cmd = [sys.executable, "-u", str(script)]
        server_proc = _ready(p, cmd)
        server = p.server
        assert server is not None
        args = parse_python_command(cmd)
        assert args is not None
        out = tmp_path / "rank.out"
        handler = StandbyHandler(server, args, {}, str(out), None, 0)
        rank = handler.proc.pid
        try:
            deadline = time.monotonic() + 60
            while "ready" not in (out.read_text() if out.exists() else ""):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            os.kill(server_proc.pid, signal.SIGKILL)
            server_proc.popen.wait(30)
            server.drain(5)
            assert server.gone
            assert p.spawn_missing() == [] and p.server is server
        finally:
            os.kill(rank, signal.SIGKILL)
            if handler._stdout is not None:
                handler._stdout.close()
        deadline = time.monotonic() + 30
        while proc_state(rank) not in (None, "Z"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        started = p.spawn_missing()
        assert len(started) == 1 and p.server is not server
    finally:
        p.stop()


def test_a_retired_standby_exits_quietly(pool: StandbyPool) -> None:
    standby = _ready(pool, [sys.executable, "-u", "train.py"])
    standby.ctl.close()  # end of file: the agent no longer needs it
    assert standby.popen.wait(60) == 0


def test_the_fork_server_forks_only_once_its_warm_up_thread_is_gone_from_the_kernel() -> None:
    """``Thread.join`` returns before the thread's native exit path has run (a fork then can
    copy a lock it holds: a forked rank hung in its first ``linear``); the fork server waits
    until the kernel no longer lists the warm-up thread."""
    shim_dir = str(Path(__file__).resolve().parents[2] / "ftmem" / "launch")
    sys.path.insert(0, shim_dir)  # _standby.py imports its sibling _exec_shim
    try:
        spec = importlib.util.spec_from_file_location("ftmem_standby", f"{shim_dir}/_standby.py")
        assert spec is not None and spec.loader is not None
        standby = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(standby)
    finally:
        sys.path.remove(shim_dir)
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,))
    thread.start()
    assert thread.native_id is not None
    assert not standby._thread_gone(thread.native_id, 0.05)  # alive: the wait runs out
    release.set()
    thread.join()
    assert standby._thread_gone(thread.native_id, 30)
    assert not os.path.exists(f"/proc/self/task/{thread.native_id}")
