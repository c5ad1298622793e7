"""The machine-readable event logs: one JSON object per line, appended by one process each.

Two files live in a node's run directory:

- ``events.jsonl`` (:data:`AGENT_EVENTS_NAME`), written by ``ftmem-launch``'s agent: ranks
  started, failures, hangs, restarts, recoveries;
- ``smp-events.jsonl`` (:data:`SMP_EVENTS_NAME`), written by the node's SMP: every commit,
  every restore, protection rounds, rebuilds, the SMP's start and stop (and flushes).

Each line is ``{"time": <time.time()>, "node": <node name>, "event": <kind>, ...fields}``;
docs/api.md lists every kind and its fields and ``ftmem timeline`` draws them. This module is
imported by the SMP, so it must never import torch (standard library only).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

AGENT_EVENTS_NAME = "events.jsonl"
"""The agent's event log in the run directory."""
SMP_EVENTS_NAME = "smp-events.jsonl"
"""The SMP's event log in the run directory."""
MAX_EVENT_LOG_BYTES = 64 << 20
"""A log that reaches this size is renamed to its :func:`previous` (replacing the one there)
and begun again: the SMP writes lines at every commit and verification of every rank, so a
long job's log would otherwise grow without end; it keeps the newest 64-128 MiB."""


def previous(path: Path) -> Path:
    """Where the log at ``path`` goes when it is full: ``<name>.1``."""
    return path.with_name(path.name + ".1")


def _close_quietly(f: IO[str]) -> None:
    try:
        f.close()
    except OSError:
        pass


class EventLog:
    """Appends one JSON object per event to a file, e.g. ``<run dir>/smp-events.jsonl``.

    Each line has ``time`` (``time.time()``), ``node``, ``event`` and the event's fields
    (values JSON cannot hold are written as ``str(value)``), so a timeline can be plotted.
    Writes are thread-safe: one lock guards the file, and each line is written and flushed
    whole, so lines of different threads never interleave.

    Resource handling: the file is opened (append, line-buffered) at the first
    :meth:`write` and kept open; at ``max_bytes`` it is renamed to :func:`previous` and a new
    one is begun; :meth:`close` (idempotent, also on context exit, at garbage
    collection and at interpreter exit) closes it. A write after :meth:`close` opens it again.
    Error handling: a failed open or write is logged (once until a write succeeds again),
    never raised, so an unwritable log never stops training or the SMP.
    """

    def __init__(self, path: Path, node: str, max_bytes: int = MAX_EVENT_LOG_BYTES) -> None:
        self.path = path
        """The file appended to."""
        self.node = node
        """The ``node`` field of every line."""
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._finalizer: weakref.finalize[[IO[str]], EventLog] | None = None
        self._failing = False
        self._max_bytes = max_bytes
        self._size = 0
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []
        """Called with each event and its fields after it was written (e.g. metrics); an
        error in one is logged, never raised."""

    def write(self, event: str, **fields: Any) -> None:
        """Append ``event`` with ``fields`` (one line, flushed before returning)."""
        record = {"time": time.time(), "node": self.node, "event": event, **fields}
        try:
            line = json.dumps(record, default=str) + "\n"
        except (TypeError, ValueError) as exc:  # e.g. a circular structure
            log.warning("event %r not logged: %s", event, exc)
            return
        with self._lock:
            try:
                f = self._open()
                f.write(line)
                f.flush()
                self._size += len(line)  # ASCII: json.dumps escapes the rest
                if self._size >= self._max_bytes:
                    self._drop()
                    os.replace(self.path, previous(self.path))
            except (OSError, ValueError) as exc:  # ValueError: the file was closed under us
                if not self._failing:
                    log.warning("cannot write the event log %s: %s", self.path, exc)
                self._failing = True
                self._drop()
                return
            if self._failing:
                log.info("event log %s writable again", self.path)
            self._failing = False
        for listener in self.listeners:
            try:
                listener(event, fields)
            except Exception:
                log.exception("event listener failed on %r", event)

    def close(self) -> None:
        """Close the file (idempotent)."""
        with self._lock:
            self._drop()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> IO[str]:
        if self._file is None:
            f = open(self.path, "a", buffering=1, encoding="utf-8")
            self._file = f
            self._size = os.fstat(f.fileno()).st_size
            # Closes the file if the owner forgets to (no ResourceWarning at exit).
            self._finalizer = weakref.finalize(self, _close_quietly, f)
        return self._file

    def _drop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # closes the file once and detaches
            self._finalizer = None
        self._file = None
