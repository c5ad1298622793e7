"""Prometheus metrics of one node (``--ftmem-metrics-port``), served by the ftmem-launch agent.

Nothing is sampled for them: a scrape builds them from the newest SMP status the agent's
poller fetched and from counters of the agent's events (:meth:`AgentMetrics.observe` is an
:class:`~ftmem.events.EventLog` listener). The metrics are ``prometheus_client``'s (optional:
``pip install ftmem[metrics]``); the HTTP server is ours (:class:`MetricsServer`). Every
metric has a ``node`` label, per-rank ones a ``rank`` label (docs/launcher.md, "Metrics").
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from ftmem.protocol.status import SmpStatus

log = logging.getLogger(__name__)

RESTART_CAUSES = ("rank_exit", "hang", "smp_died", "protection_failed", "membership")
"""The ``cause`` label of ``ftmem_restarts_total``."""

StatusSource = Callable[[], "tuple[float, SmpStatus] | None"]
"""Returns the newest SMP status and when it was fetched, or None."""


class AgentMetrics:
    """The node's metrics: counters from the agent's events, gauges from the SMP's status.

    Thread-safety: :meth:`observe` runs in the agent's threads, :meth:`collect` in the HTTP
    server's; one lock guards the counters.
    """

    def __init__(self, node: str, status: StatusSource) -> None:
        self.node = node
        self._status = status
        self._lock = threading.Lock()
        self._restarts: Counter[str] = Counter()
        self._in_process = 0
        self._from_standby = 0
        self._recovery_s: float | None = None
        self._phases: dict[str, float] = {}

    def observe(self, event: str, fields: dict[str, Any]) -> None:
        """Count what an event of the agent's event log says (an EventLog listener)."""
        with self._lock:
            if event == "failed":
                hang = str(fields.get("what", "")).startswith("HANG")
                self._restarts["hang" if hang else "rank_exit"] += 1
            elif event in ("smp_died", "protection_failed"):
                self._restarts[event] += 1
            elif event == "restart" and fields.get("reason") == "membership":
                self._restarts["membership"] += 1
            elif event == "ranks_started":
                self._in_process += len(fields.get("in_process") or ())
                self._from_standby += len(fields.get("from_standby") or ())
            elif event == "resumed":
                total = fields.get("detect_to_resumed_s")
                self._recovery_s = float(total) if isinstance(total, int | float) else None
                phases = fields.get("phases") or {}
                self._phases = {
                    k: float(v) for k, v in phases.items() if isinstance(v, int | float)
                }

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (prometheus_client's custom-collector protocol)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        node = self.node

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["node", *labels])

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["node", *labels])

        with self._lock:
            restarts = dict(self._restarts)
            in_process, from_standby = self._in_process, self._from_standby
            recovery_s, phases = self._recovery_s, dict(self._phases)
        c = counter("ftmem_restarts", "Restarts of this node's ranks, by cause", ("cause",))
        for cause in RESTART_CAUSES:
            c.add_metric([node, cause], restarts.get(cause, 0))
        yield c
        c = counter("ftmem_ranks_rejoined_in_process", "Ranks kept alive across a restart")
        c.add_metric([node], in_process)
        yield c
        c = counter("ftmem_ranks_from_standby", "Ranks started from a standby at a restart")
        c.add_metric([node], from_standby)
        yield c
        if recovery_s is not None:
            g = gauge("ftmem_recovery_seconds", "Last recovery: detection -> all ranks stepping")
            g.add_metric([node], recovery_s)
            yield g
        g = gauge("ftmem_recovery_phase_seconds", "Last recovery, by phase", ("phase",))
        for phase, seconds in phases.items():
            g.add_metric([node, phase], seconds)
        yield g
        latest = self._status()
        if latest is None:
            return
        fetched, status = latest
        g = gauge("ftmem_status_time_seconds", "When the SMP status behind these was fetched")
        g.add_metric([node], fetched)
        yield g
        yield from _rank_metrics(node, status, gauge, counter)
        yield from _smp_metrics(node, status, gauge, counter)


def _rank_metrics(node: str, status: SmpStatus, gauge: Any, counter: Any) -> Iterator[Any]:
    per_rank = {
        "newest_committed": gauge("ftmem_committed_step", "Newest committed step", ("rank",)),
        "newest_verified": gauge("ftmem_verified_step", "Newest checksummed step", ("rank",)),
        "last_progress_step": gauge(
            "ftmem_progress_step", "Step of the last save or heartbeat", ("rank",)
        ),
        "last_stall_s": gauge(
            "ftmem_snapshot_stall_seconds", "Last snapshot: save + fence time", ("rank",)
        ),
        "last_copy_s": gauge(
            "ftmem_snapshot_copy_seconds", "Last snapshot: background copy time", ("rank",)
        ),
        "bytes_held": gauge("ftmem_slot_bytes", "Bytes of the rank's snapshot slots", ("rank",)),
    }
    commits = counter("ftmem_snapshot_commits", "Committed snapshots", ("rank",))
    skips = counter("ftmem_snapshots_skipped", "Skipped snapshots, by reason", ("rank", "reason"))
    for rank, entry in sorted(status.ranks.items()):
        for key, family in per_rank.items():
            value = getattr(entry, key)
            if value is not None:
                family.add_metric([node, str(rank)], float(value))
        commits.add_metric([node, str(rank)], float(entry.commits))
        for reason, count in entry.skips.items():
            skips.add_metric([node, str(rank), reason], float(count))
    yield from per_rank.values()
    yield commits
    yield skips


def _smp_metrics(node: str, status: SmpStatus, gauge: Any, counter: Any) -> Iterator[Any]:
    try:
        rss = psutil.Process(status.pid).memory_info().rss
    except (psutil.Error, OSError):
        rss = None
    if rss is not None:
        g = gauge("ftmem_smp_rss_bytes", "Resident memory of the node's SMP process")
        g.add_metric([node], rss)
        yield g
    ex = status.protection
    if ex is not None and ex.enabled:
        for value, name, what in (
            (ex.protected_step, "ftmem_protected_step", "Newest step protected by erasure coding"),
            (ex.parity_bytes, "ftmem_parity_bytes", "Parity bytes this node holds"),
            (ex.last_protect_s, "ftmem_protect_seconds", "Last protection round's time"),
        ):
            if value is not None:
                g = gauge(name, what)
                g.add_metric([node], float(value))
                yield g
    flush = status.flush
    if flush.enabled:
        if flush.last_step is not None:
            g = gauge("ftmem_flushed_step", "Newest step flushed to the disk tiers")
            g.add_metric([node], float(flush.last_step))
            yield g
        for value, name, what in (
            (flush.flushes, "ftmem_flushes", "Flushes completed"),
            (flush.failures, "ftmem_flush_failures", "Flushes failed"),
        ):
            c = counter(name, what)
            c.add_metric([node], float(value))
            yield c


@dataclass(eq=False)
class MetricsServer:
    """``GET /metrics`` for one :class:`AgentMetrics` on ``addr:port``, from one daemon thread.

    An event loop (not ``prometheus_client``'s thread per connection) holds the connections:
    an idle one costs a socket, never a thread. Each has ``timeout`` seconds to send its
    request (at most 16 KiB of head) and take the answer; at most ``max_connections`` are
    open and a new one closes the oldest, so a scraper is answered while others idle.

    Resource handling: :meth:`start` binds (raises OSError if the port is taken; port 0 picks
    one, then in ``port``), :meth:`stop` closes the socket, the connections and the loop
    (idempotent).
    """

    metrics: AgentMetrics
    port: int
    addr: str = "127.0.0.1"
    timeout: float = 5.0
    max_connections: int = 64
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _server: Any = field(default=None, init=False)
    _conns: dict[asyncio.StreamWriter, None] = field(default_factory=dict, init=False)
    """The open connections, oldest first."""

    def start(self) -> None:
        """Bind and serve from a daemon thread."""
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.metrics)
        loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(
                asyncio.start_server(
                    lambda r, w: self._serve(r, w, registry), self.addr, self.port, limit=16384
                )
            )
        except BaseException:
            loop.close()
            raise
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="ftmem-metrics", daemon=True)
        self._thread.start()
        log.info(
            "[%s] Prometheus metrics at http://%s:%d/metrics",
            self.metrics.node,
            self.addr,
            self.port,
        )

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, registry: Any
    ) -> None:
        from prometheus_client.exposition import choose_encoder

        self._conns[writer] = None
        if len(self._conns) > self.max_connections:  # the oldest goes: its _serve ends
            oldest = next(iter(self._conns))
            self._conns.pop(oldest)
            oldest.close()
        try:
            async with asyncio.timeout(self.timeout):
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                method, path, *_ = [*head.split("\r\n", 1)[0].split(" "), "", ""]
                if method != "GET" or path.split("?")[0] not in ("/", "/metrics"):
                    status, ctype, body = "404 Not Found", "text/plain", b"GET /metrics\n"
                else:
                    accept = re.search(r"^accept:(.*)$", head, re.I | re.M)
                    encoder, ctype = choose_encoder(accept[1].strip() if accept else "")
                    status, body = "200 OK", encoder(registry)
                writer.write(
                    f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: "
                    f"{len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (
            TimeoutError,
            ValueError,
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass  # silent, slow, oversized or gone: closed below
        finally:
            self._conns.pop(writer, None)
            writer.close()

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def close() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(close(), loop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not loop.is_running():
            loop.close()
