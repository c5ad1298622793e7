"""Event logs and ``ftmem timeline``: the EventLog writer, synthetic logs of two nodes (with
malformed lines), and a real SMP whose commits and restore end up in ``smp-events.jsonl``."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import ftmem
from ftmem.cli import main
from ftmem.config import ClientConfig
from ftmem.events import AGENT_EVENTS_NAME, SMP_EVENTS_NAME, EventLog, previous
from ftmem.observe.timeline import marks_of, parse_line, read_events, since_filter
from ftmem.smp.spawn import start_smp
from tests._support.launcher import pid_gone, shm_files

T0 = 1_700_000_000.0

# -- EventLog ---------------------------------------------------------------------------------


def test_event_log_lines_from_many_threads_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, "n0")
    per_thread, threads = 500, 4

    def write(i: int) -> None:
        for k in range(per_thread):
            log.write("committed", rank=i, step=k, payload="x" * 300)

    ts = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == per_thread * threads
    docs = [json.loads(line) for line in lines]
    assert {d["node"] for d in docs} == {"n0"}
    for i in range(threads):
        assert [d["step"] for d in docs if d["rank"] == i] == list(range(per_thread))


def test_event_log_appends_reopens_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "ev.jsonl"
    path.write_text('{"time": 1.0, "node": "old", "event": "x"}\n')
    with EventLog(path, "n1") as log:
        log.write("a", when=timedelta(seconds=2), obj=object())  # not JSON: written as str
    log.write("b")  # after close: opened again
    log.close()
    log.close()
    docs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["event"] for d in docs] == ["x", "a", "b"]
    assert docs[1]["when"] == "0:00:02" and docs[1]["obj"].startswith("<object")
    bad = EventLog(tmp_path / "missing-dir" / "ev.jsonl", "n1")
    with caplog.at_level(logging.WARNING, logger="ftmem.events"):
        bad.write("a")
        bad.write("b")
    assert sum("cannot write the event log" in r.message for r in caplog.records) == 1
    bad.close()


def test_a_full_event_log_is_begun_again_and_read_with_its_older_part(tmp_path: Path) -> None:
    # A job's SMP writes lines at every commit: its log keeps the newest 1-2x max_bytes.
    path = tmp_path / SMP_EVENTS_NAME
    path.write_text('{"time": 1.0, "node": "n0", "event": "old"}\n' * 50)  # a former SMP's
    with EventLog(path, "n0", max_bytes=4096) as log:
        for k in range(100):
            log.write("committed", rank=0, step=k)
    older = previous(path)
    assert older.is_file() and path.is_file()
    assert os.path.getsize(older) >= 4096 > os.path.getsize(path)
    steps = [
        json.loads(line)["step"]
        for f in (older, path)
        for line in f.read_text().splitlines()
        if "step" in line
    ]
    assert steps == list(range(steps[0], 100))  # the newest lines, whole, in order
    got = read_events([tmp_path]).events
    assert [e.fields["step"] for e in got if e.event == "committed"] == steps


def test_event_log_write_is_cheap(tmp_path: Path) -> None:
    import time

    log = EventLog(tmp_path / "ev.jsonl", "n0")
    n = 2000
    t = time.perf_counter()
    for k in range(n):
        log.write("committed", rank=0, step=k, stall_s=0.001, copy_s=0.01, bytes=1 << 20)
    per = (time.perf_counter() - t) / n
    log.close()
    assert per < 1e-3, f"{per * 1e6:.0f} us per event"


# -- synthetic logs ---------------------------------------------------------------------------

MALFORMED = [
    "garbage",
    "[1, 2]",
    '{"event": "x"}',
    '{"time": "now", "event": "x"}',
    '{"time": true, "event": "x"}',
    '{"time": NaN, "event": "x"}',
    '{"time": 1.0, "event": ""}',
    '{"time": 12.0, "ev',  # cut short by a kill
]


def _line(t: float, node: str, event: str, **fields: Any) -> str:
    return json.dumps({"time": T0 + t, "node": node, "event": event, **fields})


def _node_a(run_dir: Path) -> None:
    agent = [
        _line(0.0, "a", "ranks_started", generation=0, ranks=[0, 1], pids=[10, 11]),
        _line(10.5, "a", "failed", rank=1, what="signal SIGKILL", exitcode=-9, committed=10),
        _line(11.0, "a", "ranks_started", generation=1, ranks=[0, 1], pids=[12, 13]),
        _line(
            15.0,
            "a",
            "resumed",
            after="signal SIGKILL",
            generation=1,
            step=11,
            committed_before=10,
            detect_to_resumed_s=4.5,
            detect_to_spawn_s=0.5,
            spawn_to_stepping_s=4.0,
        ),
    ]
    smp = [_line(-0.5, "a", "smp_start", pid=99, slots=2, adopted={})]
    for step in range(1, 21):
        t = step if step <= 10 else 5 + step
        for rank in (0, 1):
            smp.append(
                _line(
                    t + 0.1 * rank,
                    "a",
                    "committed",
                    rank=rank,
                    step=step,
                    stall_s=0.002,
                    copy_s=0.01,
                    bytes=1 << 20,
                )
            )
    smp += [_line(t, "a", "protected", step=s, seconds=0.3) for t, s in ((5.5, 5), (9.5, 9))]
    smp += [_line(9.8, "a", "flushed", step=9, seconds=1.0)]
    smp += [_line(14.0, "a", "discard_newer", rank=r, step=10, dropped=[]) for r in (0, 1)]
    smp += [_line(26.0, "a", "smp_stop", by_signal=True, uptime_s=26.5)]
    (run_dir / AGENT_EVENTS_NAME).write_text("\n".join(agent[:2] + MALFORMED + agent[2:]) + "\n")
    (run_dir / SMP_EVENTS_NAME).write_text("\n".join(smp) + "\n\n")


def _node_b(run_dir: Path) -> None:
    agent = [
        _line(0.2, "b", "ranks_started", generation=0, ranks=[2, 3], pids=[20, 21]),
        _line(10.8, "b", "restart", reason="membership", generation=0, committed=10),
        _line(12.0, "b", "hang", rank=3, pid=21, idle_s=3.0, last_step=12, killed=[3]),
    ]
    (run_dir / AGENT_EVENTS_NAME).write_text("\n".join(agent) + "\n")


@pytest.fixture
def two_nodes(tmp_path: Path) -> list[Path]:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    _node_a(dirs[0])
    _node_b(dirs[1])
    return dirs


def test_parse_line_rejects_what_is_not_an_event() -> None:
    for bad in MALFORMED:
        assert parse_line(bad, "agent", "n") is None, bad
    ev = parse_line('{"time": 3, "event": "committed", "rank": 1}', "smp", "fallback")
    assert ev is not None and ev.node == "fallback" and ev.time == 3.0
    assert ev.fields == {"rank": 1} and ev.source == "smp"


def test_read_events_counts_malformed_lines_and_sorts(two_nodes: list[Path]) -> None:
    loaded = read_events([*two_nodes, two_nodes[0] / "nothing-here"])
    assert loaded.malformed == len(MALFORMED)
    assert len(loaded.files) == 3
    assert loaded.missing == [two_nodes[0] / "nothing-here"]
    times = [e.time for e in loaded.events]
    assert times == sorted(times)
    assert {e.source for e in loaded.events} == {"agent", "smp"}


def test_marks_place_failures_detection_restart_restore_resume(two_nodes: list[Path]) -> None:
    marks = marks_of(read_events(two_nodes).events)
    by = {(m.node, m.category) for m in marks}
    for want in [
        ("a", "start"),
        ("a", "commit"),
        ("a", "protected"),
        ("a", "flushed"),
        ("a", "failure"),
        ("a", "detection"),
        ("a", "restart"),
        ("a", "restore"),
        ("a", "resume"),
        ("b", "failure"),
        ("b", "detection"),
    ]:
        assert want in by, want
    hang = [m for m in marks if m.node == "b" and m.category == "failure" and "hung" in m.label]
    assert len(hang) == 1 and hang[0].time == pytest.approx(T0 + 9.0)  # detected 12.0, idle 3 s
    resume = next(m for m in marks if m.category == "resume")
    assert resume.start == pytest.approx(T0 + 10.5) and resume.step == 11
    assert [m.time for m in marks] == sorted(m.time for m in marks)
    t0 = min(m.time for m in marks)
    late = since_filter(marks, t0, 14.0)
    assert late and all(m.time >= t0 + 14.0 for m in late)
    last = since_filter(marks, t0, -2.0)
    assert {m.category for m in last} == {"commit", "info"}


def test_text_summary(two_nodes: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["timeline", *map(str, two_nodes), "--text"]) == 0
    out = capsys.readouterr().out
    assert f"{len(MALFORMED)} malformed line(s) skipped" in out
    assert "node a:" in out and "node b:" in out
    assert "commits: 40 by ranks 0,1, 40 (steps 1-20)" not in out  # steps are counted once
    assert "commits: 40 by ranks 0,1, 20 (steps 1-20)" in out
    assert "protected: 2 (steps 5-9); flushed: 1 (steps 9-9)" in out
    assert "FAILURE    rank 1: signal SIGKILL" in out
    assert "RESTORE    rank 0 restored step 10" in out
    assert "RESUME     at step 11 after signal SIGKILL: detect->resumed 4.5 s" in out
    assert "FAILURE    rank 3 hung (last step 12)" in out
    assert "restart (membership)" in out
    assert main(["timeline", *map(str, two_nodes), "--text", "--since", "14"]) == 0
    out = capsys.readouterr().out
    assert "FAILURE" not in out and "RESUME" in out


def test_no_events_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / AGENT_EVENTS_NAME).write_text("garbage\n")
    assert main(["timeline", str(tmp_path), "--text"]) == 1
    assert "no events" in capsys.readouterr().err


def test_png_without_matplotlib_is_a_clear_error(
    two_nodes: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "t.png"
    assert main(["timeline", *map(str, two_nodes), "-o", str(out)]) == 2
    assert "pip install 'ftmem[plot]'" in capsys.readouterr().err
    assert not out.exists()


def test_png_is_drawn(two_nodes: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    assert main(["timeline", *map(str, two_nodes), "-o", str(out), "--title", "two nodes"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- a real SMP -------------------------------------------------------------------------------


def test_real_smp_logs_commits_and_restores(
    run_dir: Path, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    smp = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        node="nodeX",
        start_timeout=timedelta(seconds=60),
        log_path=run_dir / "smp.log",
    )
    try:
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"model": model, "optim": opt}
        ckpt = ftmem.Checkpointer(ClientConfig(run_dir=run_dir))
        try:
            for step in (1, 2, 3):
                model(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
                ckpt.save(state, step=step)  # the first is skipped while slots are made
                assert ckpt.wait(60) is True  # ...and committed by wait()
            assert ckpt.load(state) == 3
        finally:
            ckpt.close()
    finally:
        assert smp.stop() == 0
    assert pid_gone(smp.pid) and shm_files(run_id) == []
    docs = [json.loads(line) for line in (run_dir / SMP_EVENTS_NAME).read_text().splitlines()]
    kinds = [d["event"] for d in docs]
    assert kinds[0] == "smp_start" and kinds[-1] == "smp_stop", kinds
    assert {d["node"] for d in docs} == {"nodeX"}
    commits = [d for d in docs if d["event"] == "committed"]
    assert [(d["rank"], d["step"]) for d in commits] == [(0, 1), (0, 2), (0, 3)]
    for d in commits:
        assert d["bytes"] >= 64 * 64 * 4 and d["stall_s"] >= 0 and d["copy_s"] >= 0
    assert any(d["event"] == "hello" and d["pid"] == os.getpid() for d in docs)
    assert [(d["rank"], d["step"]) for d in docs if d["event"] == "discard_newer"] == [(0, 3)]
    assert main(["timeline", str(run_dir), "--text"]) == 0
    out = capsys.readouterr().out
    assert "node nodeX:" in out and "commits: 3 by ranks 0, 3 (steps 1-3)" in out
    assert "RESTORE    rank 0 restored step 3" in out and "0 malformed" in out


def test_machine_loss_marks_the_lost_machine_the_spare_and_the_agent_states() -> None:
    lines = [
        '{"time": 1, "node": "h0", "event": "state", "state": "running", "previous": "started"}',
        '{"time": 2, "node": "h3", "event": "state", "state": "spare", "previous": "joining"}',
        '{"time": 5, "node": "h0", "event": "machine_lost", "peer": "h2_7_0", "bound_s": 5.0}',
        '{"time": 6, "node": "h3", "event": "state", "state": "syncing", "previous": "joining"}',
        '{"time": 9, "node": "h2", "event": "fenced", "slot": 2, "why": "went on"}',
        '{"time": 9, "node": "h0", "event": "not_enough_machines", "need": 3, "have": 2}',
    ]
    events = [e for e in (parse_line(x, "agent", "?") for x in lines) if e is not None]
    marks = marks_of(events)
    labels = {(m.node, m.category, m.label.split(":")[0]) for m in marks}
    assert ("h0", "failure", "machine h2_7_0 lost") in labels
    assert ("h0", "info", "agent started -> running") in labels
    assert ("h3", "info", "agent joining -> syncing") in labels
    assert ("h3", "info", "agent joining -> spare") in labels
    assert any(m.node == "h2" and m.label.startswith("fenced") for m in marks)
    assert any(m.category == "stop" and "not enough machines" in m.label for m in marks)
