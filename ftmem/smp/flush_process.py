"""FlushProcess: the SMP's end of its flush worker process (``python -m ftmem.tiers.flush_worker``).

The worker imports torch; the SMP does not. It is started on demand, given jobs and read back
as typed replies (protocol/flush_jobs.py) by a reader thread, so the flush thread never blocks
on the pipe. A line that is not a valid reply is logged and skipped; the end of the worker's
output (it exited or was killed) is reported as None, once.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from typing import IO

from ftmem._logging import get_logger
from ftmem.errors import ProtocolError
from ftmem.protocol.flush_jobs import Job, Reply, WorkerReady, encode, parse_reply
from ftmem.smp import drain

log = get_logger(__name__)


class FlushProcess:
    """One flush worker at a time (see the module docstring).

    Resource handling: :meth:`end` closes its stdin and waits (bounded; then SIGKILL by pid).
    Error handling: :meth:`ensure` raises OSError if the process cannot start; :meth:`send`
    returns False when it is gone.
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self.ready = threading.Event()
        """Set once the worker said it imported torch and DCP (cleared when it ends)."""
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[Reply | None] = queue.Queue()

    @property
    def exit_code(self) -> int | None:
        """The worker's exit status once it ended (None while it runs or before a start)."""
        return self._proc.poll() if self._proc is not None else None

    def ensure(self) -> None:
        """Start a worker unless one runs.

        Raises:
            OSError: the process could not be started.
        """
        if self._proc is not None and self._proc.poll() is None:
            return
        self.end()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ftmem.tiers.flush_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lines = queue.Queue()
        reader = threading.Thread(
            target=self._read,
            args=(self._proc.stdout, self._lines),
            name="ftmem-flush-reader",
            daemon=True,
        )
        reader.start()
        log.info("[%s/flush] flush worker pid %d", self.node, self._proc.pid)

    def _read(self, stream: IO[str] | None, out: queue.Queue[Reply | None]) -> None:
        if stream is not None:
            with stream:
                for line in stream:
                    try:
                        out.put(parse_reply(line))
                    except ProtocolError as exc:
                        log.warning("[%s/flush] ignoring a worker line: %s", self.node, exc)
        out.put(None)

    def send(self, job: Job) -> bool:
        """Hand ``job`` to the worker; False if it is gone (or was never started)."""
        proc = self._proc
        if proc is None or proc.stdin is None:
            return False
        try:
            proc.stdin.write(encode(job))
            proc.stdin.flush()
        except (OSError, ValueError):  # a closed pipe, or a stdin closed by end()
            return False
        return True

    def replies(self) -> list[Reply | None]:
        """The replies read since the last call (non-blocking); None: the worker's output
        ended (it exited), after which :attr:`ready` is clear."""
        out = drain(self._lines)
        for reply in out:
            if reply is None:
                self.ready.clear()
            elif isinstance(reply, WorkerReady):
                self.ready.set()
        return out

    def end(self) -> None:
        """Stop the worker: end of input, a bounded wait, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        self.ready.clear()
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
