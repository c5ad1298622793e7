"""Who may hold a connection that has not proved anything yet, and how refusals are logged.

The data channel (data_channel.py) and the CURVE port (zmq_transport.py) are reachable by
anyone who can reach the host; these rules keep such a client from pushing the generation's
peers out (:func:`refusal`: quotas per source address, refusal of the new connection rather
than eviction of an open one) and from filling the log (:class:`DropLog`: counts, one line per
source and reason per interval).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Mapping

PER_SOURCE = 16
"""Connections from one address that may wait for their hello at once."""
MAX_PENDING = 64
"""Such connections in all while the generation's peer hosts are not known yet (after that,
only peer hosts are taken, each with room of its own: ``PER_SOURCE``)."""
MAX_LINES = 8
"""Lines one :meth:`DropLog.flush` writes at most (the rest are summed in one more)."""


def refusal(ip: str, pending: Mapping[str, int], peer_hosts: frozenset[str] | None) -> str:
    """Why a new connection from ``ip`` is refused ("" if it is taken), given how many
    connections from each address wait for their hello (``pending``) and the generation's peer
    hosts (None while unknown: any address may connect). A refused connection is closed at
    once; no open connection is ever closed to make room."""
    if peer_hosts is not None and ip not in peer_hosts:
        return "no peer host of this generation"
    if pending.get(ip, 0) >= PER_SOURCE:
        return f"{PER_SOURCE} connections from it wait for their hello already"
    if peer_hosts is None and sum(pending.values()) >= MAX_PENDING:
        return f"{MAX_PENDING} connections wait for their hello already"
    return ""


class DropLog:
    """Refused or closed connections, logged as counts: at most one flush per ``interval_s``,
    each at most :data:`MAX_LINES` lines ("refused N connections from X: why") plus one line
    summing the rest. Thread-safe."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self._log, self._what, self.interval_s = logger, what, interval_s
        self._counts: Counter[tuple[str, str]] = Counter()
        self._last = -math.inf
        self._lock = threading.Lock()

    def count(self, source: str, why: str) -> None:
        """One more connection from ``source`` refused or closed for ``why``."""
        with self._lock:
            self._counts[(source, why)] += 1

    def due(self) -> float:
        """When :meth:`flush` has lines to write (monotonic; inf if none)."""
        return self._last + self.interval_s if self._counts else math.inf

    def flush(self, now: float | None = None, force: bool = False) -> None:
        """Write the counts if the interval has passed since the last flush (or ``force``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._counts or (now < self._last + self.interval_s and not force):
                return
            counts, self._counts, self._last = self._counts, Counter(), now
        top = counts.most_common()
        for (source, why), n in top[:MAX_LINES]:
            self._log.warning(
                "%s: refused or closed %d connections from %s: %s", self._what, n, source, why
            )
        if len(top) > MAX_LINES:
            rest = top[MAX_LINES:]
            self._log.warning(
                "%s: and %d more connections from %d other addresses or reasons",
                self._what,
                sum(n for _, n in rest),
                len(rest),
            )
