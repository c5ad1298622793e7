"""Every dependency of ftmem-launch on torch.distributed.elastic's private API, in one file.

ftmem-launch is elastic's ``LocalElasticAgent`` with ftmem's hooks: :mod:`ftmem.launch.agent`
overrides its four abstract methods (``_start_workers``, ``_stop_workers``,
``_monitor_workers``, ``_shutdown``). Everything else that reaches into elastic's internals is
here, so moving to a new torch means reviewing this file (and running the launcher tests):

1. ``SimpleElasticAgent``'s ``_rendezvous``, ``_assign_worker_ranks`` and ``_restart_workers``
   (forwarded to hooks of :class:`ElasticAgentBase`), ``_rdzv_handler``, ``_pcontext`` and
   ``_remaining_restarts`` (read and set through its accessors).
2. The c10d handler's ``_state_holder``: its round, cache duration and last read
   (:func:`trust_rendezvous_state_for`, :func:`rendezvous_members`) and its timeout's
   ``_last_call``. Its ``_backend`` and the state classes (``_RendezvousState``,
   ``_NodeDesc``) are known only to :mod:`ftmem.launch.state_guard`.
3. Four functions swapped while elastic runs: ``dynamic_rendezvous._delay``
   (:func:`restart_rendezvous_quickly`), ``RendezvousStoreInfo.build``
   (:func:`awaiting_group_rank_0`), ``multiprocessing.api.get_subprocess_handler``
   (:func:`subprocess_handler_replaced`) and ``tail_log.tail_logfile``
   (:func:`log_tails_stop_at_once`).
4. ``SubprocessContext``'s ``subprocess_handlers`` and ``_running_local_ranks``, for ranks
   kept alive across a restart (:func:`detach_handlers`, :func:`failed_after_detach`).
5. torch 2.13 added ``shutdown_timeout`` to the agent, ``LaunchConfig`` and ``_shutdown``
   (:meth:`~ElasticAgentBase.stop_ranks`, :func:`launch_shutdown_timeout`).

Supported: torch 2.11 up to (not including) 2.15 (docs/launcher.md).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

import torch
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as elastic_mp_api
from torch.distributed.elastic.multiprocessing import tail_log as elastic_tail_log
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from ftmem.errors import FtmemError, RoundAbandoned

log = logging.getLogger(__name__)

OLDEST = (2, 11)
"""The oldest torch whose elastic internals this module matches."""
NEWEST = (2, 14)
"""The newest minor version read against this module."""

_HAS_SHUTDOWN_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
"""torch >= 2.13: ``_shutdown(death_sig, timeout)`` and a ``shutdown_timeout`` argument."""


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch older than :data:`OLDEST`; warn about one newer than :data:`NEWEST`.

    Raises:
        FtmemError: ``version`` (default: the running torch's) is too old for ftmem-launch.
    """
    text = version if version is not None else torch.__version__
    major, minor = text.split("+")[0].split(".")[:2]
    have = int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    if have < OLDEST:
        raise FtmemError(
            f"ftmem-launch needs torch >= {OLDEST[0]}.{OLDEST[1]} (it extends elastic's "
            f"agent); this is torch {text}"
        )
    if have > NEWEST:
        log.warning(
            "torch %s is newer than the newest version ftmem-launch was read against "
            "(%d.%d): review ftmem/launch/elastic_compat.py if the launcher misbehaves",
            text,
            *NEWEST,
        )


def launch_shutdown_timeout(config: Any) -> int:
    """The ``LaunchConfig``'s shutdown timeout (seconds): torch < 2.13 has none, 30 s."""
    value = getattr(config, "shutdown_timeout", None)
    return int(value) if value is not None else 30


@contextlib.contextmanager
def replaced(module: Any, name: str, replacement: Callable[..., Any]) -> Iterator[Any]:
    """Swap ``module.name`` for ``replacement`` while inside (only the agent's main thread
    starts ranks and joins rendezvous); yields the original, or None where the attribute is
    missing (another torch: the module is left alone)."""
    original = getattr(module, name, None)
    if original is None:
        yield None
        return
    setattr(module, name, replacement)
    try:
        yield original
    finally:
        setattr(module, name, original)


ELASTIC_POLL_S = 1.0
"""elastic's wait between two reads of the rendezvous state (its ``_Action.SYNC``), and how
long its c10d handler trusts a state it read (``cache_duration``)."""
STORE_READS_PER_S = 1000.0
"""What the nodes' polls may ask of the c10d store together, at most (with quick polls)."""


def rendezvous_poll_s(max_nodes: int) -> float:
    """How often each node re-reads the rendezvous state: 50 ms, longer with many nodes so
    that all of them together read it at most :data:`STORE_READS_PER_S` times a second, and
    never less often than elastic's 1 s."""
    return min(ELASTIC_POLL_S, max(0.05, max_nodes / STORE_READS_PER_S))


def rendezvous_join_timeout_s(handler: Any) -> float:
    """The handler's join timeout in seconds (the c10d/etcd-v2 handlers' ``settings``), 0
    for a handler without one: how long a round may wait for a replacement node."""
    join = getattr(getattr(getattr(handler, "settings", None), "timeout", None), "join", None)
    return join.total_seconds() if isinstance(join, timedelta) else 0.0


def trust_rendezvous_state_for(handler: Any, seconds: float) -> bool:
    """Make the c10d handler re-read the rendezvous state once it is ``seconds`` old.

    elastic's handler serves a state younger than 1 s from its cache, to every poll of a join
    and to the agent's check for waiting nodes, so each step of a restart's rendezvous could
    see the others up to 1 s late. Returns False where this handler has no such cache
    (another backend, another torch).
    """
    holder = getattr(handler, "_state_holder", None)
    if holder is None or not isinstance(getattr(holder, "_cache_duration", None), int | float):
        return False
    holder._cache_duration = seconds
    return True


@dataclass(frozen=True, slots=True)
class RendezvousMembers:
    """What the c10d handler's newest read of the rendezvous state says about the nodes.

    Nodes are named by elastic's descriptors (``host_pid_id``)."""

    round: int
    participants: frozenset[str]
    heartbeat_age_s: dict[str, float]
    """Seconds since each node's last keep-alive, as of the read."""
    me: str
    spare: bool
    """This node waits in elastic's redundancy list (the round has all its nodes)."""
    waiting: int
    """Nodes waiting outside the round (wait list and redundancy list)."""
    dead: frozenset[str] = frozenset()
    """Nodes the read dropped because their keep-alive had expired."""


def rendezvous_members(handler: Any) -> RendezvousMembers | None:
    """The members of the rendezvous as the handler last read them (no store access); None
    where the handler has no such state (another backend, another torch)."""
    holder = getattr(handler, "_state_holder", None)
    state = getattr(holder, "state", None)
    me = getattr(handler, "_this_node", None)
    participants = getattr(state, "participants", None)
    beats = getattr(state, "last_heartbeats", None)
    redundant = getattr(state, "redundancy_list", None)
    wait_list = getattr(state, "wait_list", None)
    if state is None or me is None or not isinstance(participants, dict):
        return None
    now = datetime.now(timezone.utc)
    beats = beats if isinstance(beats, dict) else {}
    return RendezvousMembers(
        round=int(getattr(state, "round", -1)),
        participants=frozenset(repr(n) for n in participants),
        heartbeat_age_s={repr(n): (now - t).total_seconds() for n, t in beats.items()},
        me=repr(me),
        spare=isinstance(redundant, set) and me in redundant,
        waiting=(len(redundant) if isinstance(redundant, set) else 0)
        + (len(wait_list) if isinstance(wait_list, set) else 0),
        dead=frozenset(repr(n) for n in getattr(holder, "_dead_nodes", None) or ()),
    )


def round_abandoned(handler: Any, nodes: int | None) -> str | None:
    """Why the round of ``nodes`` nodes is over before its ranks started (None: it is not,
    or ``handler`` cannot say): a node waits for the next round, or one left this round (its
    keep-alive expired). Reads the state from the store."""
    if handler.num_nodes_waiting() > 0:
        return "a node waits to join the next round"
    members = rendezvous_members(handler)
    if members is not None and nodes is not None and len(members.participants) < nodes:
        return f"{nodes - len(members.participants)} node(s) left the round"
    return None


def keep_alive_bound_s(handler: Any) -> float:
    """After how long without a keep-alive elastic drops a node (interval x attempts)."""
    settings = getattr(handler, "settings", None)
    interval = getattr(settings, "keep_alive_interval", None)
    attempts = getattr(settings, "keep_alive_max_attempt", None)
    if isinstance(interval, timedelta) and isinstance(attempts, int):
        return interval.total_seconds() * attempts
    return 15.0


@contextlib.contextmanager
def restart_rendezvous_quickly(
    restart: bool,
    poll_s: float = ELASTIC_POLL_S,
    between_polls: Callable[[], bool] | None = None,
    handler: Any = None,
    last_call: timedelta | None = None,
) -> Iterator[None]:
    """At a restart, join the rendezvous without elastic's start delay and with quick polls.

    - ``next_rendezvous`` sleeps a random 0-0.3 s "if this is our first run", tested as
      ``round == 0``, which still holds at the first restart: that (tuple) delay is skipped.
    - Its 1 s wait between two reads of the state becomes ``poll_s``
      (:func:`rendezvous_poll_s`): at a restart the nodes re-join almost together.
    - ``last_call`` replaces the timeout's ``_last_call`` for this join, so that a round below
      its maximum size (a shrink) completes that long after the minimum joined.

    ``between_polls`` (any join) runs before each wait between two reads; when it returns
    True (a hot spare) that wait is ``poll_s`` too, so that a spare sees a free place at once.
    Swapped for the join: ``dynamic_rendezvous._delay`` and the timeout's ``_last_call``.
    """
    if not restart and between_polls is None:
        yield
        return
    original: Callable[[Any], None] | None = getattr(dynamic_rendezvous, "_delay", None)

    def delay(seconds: float | tuple[float, float]) -> None:
        if isinstance(seconds, tuple):
            if not restart and original is not None:
                original(seconds)  # the first join's spread is elastic's
            return
        quick = (between_polls is not None and between_polls()) or restart
        if original is not None:
            original(poll_s if quick and seconds == ELASTIC_POLL_S else seconds)

    timeout: Any = getattr(getattr(handler, "settings", None), "timeout", None)
    before = getattr(timeout, "_last_call", None)
    swap = restart and last_call is not None and isinstance(before, timedelta)
    if swap:
        timeout._last_call = last_call
    try:
        with replaced(dynamic_rendezvous, "_delay", delay):
            yield
    finally:
        if swap:
            timeout._last_call = before


def wait_for_keys(
    store: Any, keys: list[str], poll_s: float, between_polls: Callable[[], None]
) -> None:
    """Wait until every one of ``keys`` is set in ``store`` (the store's own wait: back as
    soon as they are), in waits of ``poll_s``, running ``between_polls`` after each that ends
    without them (it may raise to stop waiting); ``DistStoreError`` after the store's
    timeout, as a blocking read."""
    deadline = time.monotonic() + store.timeout.total_seconds()
    while True:
        try:
            store.wait(keys, timedelta(seconds=poll_s))
            return
        except torch.distributed.DistStoreError as exc:
            missing = exc
        between_polls()
        if time.monotonic() >= deadline:
            raise missing


class RoundStore:
    """A rendezvous round's store whose blocking reads end when the round does.

    ``get``, ``multi_get`` and ``wait`` (without a timeout) wait for their keys in 1 s slices
    (:func:`wait_for_keys`) and ask ``abandoned`` between two. A reason (a node waits for the
    next round, or one left this round: :func:`round_abandoned`) raises
    :class:`~ftmem.errors.RoundAbandoned` instead of waiting, up to the store's timeout, for a
    node that will not write. Everything else is the store's own.
    """

    def __init__(self, store: Any, abandoned: Callable[[], str | None]) -> None:
        self.store = store
        self.abandoned = abandoned

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def clone(self) -> RoundStore:
        """A clone of the store (for another thread), ending with the same round."""
        return RoundStore(self.store.clone(), self.abandoned)

    def _await(self, keys: list[str]) -> None:
        def ask() -> None:
            why = self.abandoned()
            if why is not None:
                raise RoundAbandoned(f"{why}: stopped waiting for {keys}")

        wait_for_keys(self.store, keys, 1.0, ask)

    def get(self, key: str) -> bytes:
        """The value of ``key``, once it is set (RoundAbandoned: the round ended first)."""
        self._await([key])
        return bytes(self.store.get(key))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, once all are set (RoundAbandoned: the round ended first)."""
        self._await(keys)
        return list(self.store.multi_get(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Wait until ``keys`` are set: ``timeout``, or the round's end (RoundAbandoned)."""
        if timeout is not None:
            self.store.wait(keys, timeout)
        else:
            self._await(keys)


@contextlib.contextmanager
def awaiting_group_rank_0(between_polls: Callable[[], None], poll_s: float) -> Iterator[None]:
    """While inside, a node other than group rank 0 waits for group rank 0's
    MASTER_ADDR/PORT (elastic's ``RendezvousStoreInfo.build``) in waits of ``poll_s``,
    running ``between_polls`` after each that ends without them; ``DistStoreError`` after the
    store's timeout, as elastic's blocking read.

    Why: elastic's read blocks with the heartbeat lock held. If a store writer erased the
    complete state and another node wrote its older view back, group rank 0 waits for a round
    this node believes complete; ``between_polls`` re-reads the state, so this node writes the
    complete round back (:func:`~ftmem.launch.state_guard.reread_state`).
    """
    original = RendezvousStoreInfo.build
    keys = [RendezvousStoreInfo.MASTER_ADDR_KEY, RendezvousStoreInfo.MASTER_PORT_KEY]

    def build(rank: int, store: Any, local_addr: str | None, server_port: int | None = None) -> Any:
        if rank != 0:
            wait_for_keys(store, keys, poll_s, between_polls)
        return original(rank, store, local_addr, server_port)

    saved = RendezvousStoreInfo.__dict__["build"]  # the staticmethod itself, restored as is
    RendezvousStoreInfo.build = staticmethod(build)  # type: ignore[method-assign]
    try:
        yield
    finally:
        RendezvousStoreInfo.build = saved  # type: ignore[method-assign]


def _tail_logfile(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Copy the lines of ``file`` to ``dst``, each after ``header``, until ``finished`` is
    set and the file is read to its end; an idle wait ends as soon as ``finished`` is set."""
    while not os.path.exists(file):
        if finished.wait(interval_sec):
            return
    with open(file, errors="replace") as fp:
        while True:
            # Read before the line is read: whatever was written before ``finished`` was set
            # is copied (checked after an empty read, a line written meanwhile was lost).
            done = finished.is_set()
            line = fp.readline()
            if line:
                if log_line_filter is None or log_line_filter(line):
                    dst.write(f"{header}{line}")
            elif done:
                return
            else:
                finished.wait(interval_sec)


@contextlib.contextmanager
def log_tails_stop_at_once() -> Iterator[None]:
    """While inside, the log tailers elastic starts (``--tee``) stop as soon as they are told.

    elastic's tailer sleeps its whole 0.1 s interval at the end of a file, and the stdout
    tailers stop before the stderr ones, which delays every restart; the replacement waits on
    the tailer's own stop event, and copies the same lines with the same headers.
    """
    with replaced(elastic_tail_log, "tail_logfile", _tail_logfile):
        yield


@contextlib.contextmanager
def subprocess_handler_replaced(make: Callable[..., Any]) -> Iterator[None]:
    """While inside, elastic builds each rank's ``SubprocessHandler`` with ``make``.

    ``make`` takes elastic's own function (for a cold start), then elastic's keyword arguments
    (``entrypoint, args, env, stdout, stderr, local_rank_id``, and ``numa_options`` on torch
    >= 2.6).
    """
    original = getattr(elastic_mp_api, "get_subprocess_handler", None)
    if original is None:
        raise FtmemError("this torch has no multiprocessing.api.get_subprocess_handler")
    with replaced(elastic_mp_api, "get_subprocess_handler", functools.partial(make, original)):
        yield


def live_handlers(pcontext: Any) -> dict[int, Any]:
    """Local rank -> ``SubprocessHandler`` of the ranks ``pcontext`` still manages ({} for a
    function entrypoint's multiprocessing context, which has none)."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    return dict(handlers) if isinstance(handlers, dict) else {}


def detach_handlers(pcontext: Any, local_ranks: list[int]) -> dict[int, Any]:
    """Take the handlers of ``local_ranks`` out of ``pcontext``: elastic neither polls nor
    closes (kills) them any more. Returns them by local rank; the caller owns them now."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    running = getattr(pcontext, "_running_local_ranks", None)
    if not isinstance(handlers, dict) or not isinstance(running, set):
        return {}
    out = {}
    for local_rank in local_ranks:
        handler = handlers.pop(local_rank, None)
        if handler is not None:
            running.discard(local_rank)
            out[local_rank] = handler
    return out


def failed_after_detach(pcontext: Any, worker_group: WorkerGroup) -> RunResult:
    """What ``LocalElasticAgent._monitor_workers`` returns for a failed rank, for a context
    that ranks were just detached from (its pid check would answer UNKNOWN): FAILED with
    the failures by global rank. The caller saw a rank exit with an error."""
    result = pcontext.wait(0)
    failures = {}
    if result is not None:
        for local_rank, failure in result.failures.items():
            failures[worker_group.workers[local_rank].global_rank] = failure
    return RunResult(state=WorkerState.FAILED, failures=failures)


class ElasticAgentBase(LocalElasticAgent):
    """``LocalElasticAgent`` whose private hooks call methods that subclasses override.

    Resource handling: as ``LocalElasticAgent``; :meth:`stop_ranks` stops the ranks only.
    """

    def __init__(self, *args: Any, shutdown_timeout: int = 30, **kwargs: Any) -> None:
        if _HAS_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(*args, **kwargs)
        self.shutdown_timeout_s = shutdown_timeout
        """Seconds between SIGTERM and SIGKILL when the ranks are stopped."""

    # -- hooks for subclasses -----------------------------------------------------------------

    def initialize_workers(self, start: Callable[[], None]) -> None:
        """Rendezvous and start this node's ranks: call ``start`` (elastic's) and add to it."""
        start()

    def join_rendezvous(self, worker_group: WorkerGroup, join: Callable[[], None]) -> None:
        """Join the next rendezvous round: call ``join`` (elastic's join) and add to it."""
        join()

    def assign_worker_ranks(
        self,
        store: Any,
        group_rank: int,
        group_world_size: int,
        spec: WorkerSpec,
        elastic_default: Callable[[], list[Worker]],
    ) -> list[Worker]:
        """This node's workers with their global ranks; default: elastic's numbering.
        ``store``: the round's (:meth:`round_store`)."""
        return elastic_default()

    def before_restart(self, worker_group: WorkerGroup) -> None:
        """Called when elastic is about to restart the ranks (any cause)."""

    # -- elastic internals --------------------------------------------------------------------

    def round_store(self, store: Any) -> Any:
        """``store`` (None: none) whose blocking reads end when the current round does: a
        node waits for the next round, or one left this one (:class:`RoundStore`)."""
        if store is None:
            return None
        group = self.get_worker_group()  # (its size is the current round's)
        return RoundStore(
            store, lambda: round_abandoned(self._rdzv_handler, group.group_world_size)
        )

    @property
    def rdzv_handler(self) -> Any:
        """The rendezvous handler elastic uses (``_rdzv_handler``)."""
        return self._rdzv_handler

    def process_context(self) -> Any:
        """The ranks' ``PContext`` of the running generation (``_pcontext``; None before)."""
        return self._pcontext

    def rank_stderr_paths(self) -> dict[int, str]:
        """Local rank -> its stderr file (empty if the output is not in files)."""
        paths = getattr(self._pcontext, "stderrs", None)
        return dict(paths) if isinstance(paths, dict) else {}

    @property
    def restarts_left(self) -> int:
        """How many more restarts elastic allows (``_remaining_restarts``)."""
        return int(self._remaining_restarts)

    def stop_restarting(self) -> None:
        """elastic restarts the ranks no more: the next failure ends the agent."""
        self._remaining_restarts = 0

    def rendezvous_round(self) -> int | None:
        """The c10d handler's round number (the same on every node), None if unknown."""
        holder = getattr(self._rdzv_handler, "_state_holder", None)
        round_ = getattr(getattr(holder, "state", None), "round", None)
        return round_ if isinstance(round_, int) else None

    def stop_ranks(self, death_sig: signal.Signals, timeout: int | None = None) -> None:
        """``LocalElasticAgent``'s own shutdown of the ranks (not this class's override)."""
        if _HAS_SHUTDOWN_TIMEOUT:
            wait = self.shutdown_timeout_s if timeout is None else timeout
            LocalElasticAgent._shutdown(self, death_sig, wait)
        else:
            LocalElasticAgent._shutdown(self, death_sig)

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        self.initialize_workers(lambda: LocalElasticAgent._initialize_workers(self, worker_group))

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self.join_rendezvous(
            worker_group, lambda: LocalElasticAgent._rendezvous(self, worker_group)
        )

    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        elastic = LocalElasticAgent._assign_worker_ranks
        return self.assign_worker_ranks(
            self.round_store(store),
            group_rank,
            group_world_size,
            spec,
            lambda: elastic(self, store, group_rank, group_world_size, spec),
        )

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.before_restart(worker_group)
        super()._restart_workers(worker_group)
