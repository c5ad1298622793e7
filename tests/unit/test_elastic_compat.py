"""What ftmem-launch swaps into elastic (ftmem.launch.elastic_compat): log tailers, rendezvous waits."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from torch.distributed.elastic.multiprocessing import tail_log

from ftmem.launch.elastic_compat import (
    _tail_logfile,
    log_tails_stop_at_once,
    rendezvous_poll_s,
    restart_rendezvous_quickly,
    trust_rendezvous_state_for,
)


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


def test_rendezvous_polls_50_ms_or_at_most_1000_store_reads_a_second() -> None:
    assert rendezvous_poll_s(2) == 0.05
    assert rendezvous_poll_s(200) == 0.2  # 200 nodes, each every 0.2 s: 1000 reads a second
    assert rendezvous_poll_s(20000) == 1.0  # never less often than elastic's own 1 s


def test_a_c10d_handler_re_reads_the_state_sooner() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from tests._support.launcher import free_port

    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{free_port()}",
        run_id="trust",
        min_nodes=1,
        max_nodes=1,
        is_host=True,
    )
    handler = get_rendezvous_handler(params)
    try:
        assert trust_rendezvous_state_for(handler, 0.05)
        assert handler._state_holder._cache_duration == 0.05
    finally:
        handler.shutdown()
    assert not trust_rendezvous_state_for(object(), 0.05)  # no such cache: left alone


def test_the_swap_is_only_inside_a_restart_join() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = dynamic_rendezvous._delay
    with restart_rendezvous_quickly(restart=False):
        assert dynamic_rendezvous._delay is original
    with restart_rendezvous_quickly(restart=True):
        assert dynamic_rendezvous._delay is not original
        dynamic_rendezvous._delay(seconds=(0, 0.3))  # returns at once (nothing to assert)
    assert dynamic_rendezvous._delay is original


def test_a_node_marked_expired_is_dropped_by_every_handler_at_its_next_read() -> None:
    """Two c10d handlers form a round over a real TCPStore; one marks the other's keep-alive
    expired (the failure detector's verdict): its next read finds the other dead and gone,
    as elastic finds a node whose keep-alive stopped; a second mark is a no-op."""
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta
    from typing import Any

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from ftmem.launch.elastic_compat import rendezvous_members
    from ftmem.launch.state_guard import expire_keep_alive
    from tests._support.launcher import free_port

    endpoint = f"127.0.0.1:{free_port()}"

    def handler(host: bool) -> Any:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=endpoint,
            run_id="expire",
            min_nodes=2,
            max_nodes=2,
            is_host=host,
            join_timeout=30,
            last_call_timeout=1,
        )
        return get_rendezvous_handler(params)

    a = handler(True)
    b = handler(False)
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(h.next_rendezvous) for h in (a, b)]:
                f.result(timeout=60)
        other = repr(b._this_node)
        members = rendezvous_members(a)
        assert members is not None and other in members.participants
        assert expire_keep_alive(a, other)
        trust_rendezvous_state_for(a, 0.0)
        a._state_holder.sync()
        members = rendezvous_members(a)
        assert members is not None
        assert other in members.dead and other not in members.participants
        assert members.participants == {members.me}
        assert expire_keep_alive(a, other)  # already gone: nothing to write
        assert not expire_keep_alive(object(), other)  # no backend: nothing done
        # The restart's last call is swapped in for the join only.
        before = a.settings.timeout.last_call
        with restart_rendezvous_quickly(restart=True, handler=a, last_call=timedelta(seconds=0.5)):
            assert a.settings.timeout.last_call == timedelta(seconds=0.5)
        assert a.settings.timeout.last_call == before
    finally:
        b.shutdown()
        a.shutdown()
