"""The log tailer ftmem-launch gives elastic (ftmem.launch.elastic_compat): real files, threads."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from torch.distributed.elastic.multiprocessing import tail_log

from ftmem.launch.elastic_compat import _tail_logfile, log_tails_stop_at_once


def _tail(path: Path, dst: io.StringIO, **kw: object) -> tuple[threading.Thread, threading.Event]:
    finished = threading.Event()
    thread = threading.Thread(
        target=_tail_logfile,
        kwargs={
            "header": "[r0]:",
            "file": str(path),
            "dst": dst,
            "finished": finished,
            "interval_sec": 30.0,
            **kw,
        },
        daemon=True,
    )
    thread.start()
    return thread, finished


def test_copies_every_line_then_stops_when_told_without_waiting_its_interval(
    tmp_path: Path,
) -> None:
    path = tmp_path / "stdout.log"
    path.write_text("one\n")
    dst = io.StringIO()
    # A 30 s interval: a tailer that slept it out would fail the bounded joins below.
    thread, finished = _tail(path, dst, log_line_filter=lambda line: "skip" not in line)
    with path.open("a") as f:
        f.write("two\nskip me\nthree\n")
    finished.set()
    thread.join(10)
    assert not thread.is_alive()
    assert dst.getvalue() == "[r0]:one\n[r0]:two\n[r0]:three\n"


def test_a_file_that_never_appears(tmp_path: Path) -> None:
    dst = io.StringIO()
    thread, finished = _tail(tmp_path / "never.log", dst)
    finished.set()
    thread.join(10)
    assert not thread.is_alive() and dst.getvalue() == ""


def test_elastic_tails_with_it_while_inside(tmp_path: Path) -> None:
    """elastic's TailLog looks the function up when it starts: inside the context, ours."""
    path = tmp_path / "stderr.log"
    path.write_text("hello\n")
    dst = io.StringIO()
    original = tail_log.tail_logfile
    with log_tails_stop_at_once():
        assert tail_log.tail_logfile is _tail_logfile
        tail = tail_log.TailLog("default", {0: str(path)}, dst, interval_sec=30.0).start()
    assert tail_log.tail_logfile is original
    done = threading.Thread(target=tail.stop, daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive()
    assert dst.getvalue() == "[default0]:hello\n"
