"""The node's warm starts: the fork server or the standby ranks, and the hook that hands
elastic's rank starts to them.

:class:`StandbyPool` owns the warm processes of :mod:`ftmem.launch.standby`;
:func:`spawning_from` is the window in which elastic's ``get_subprocess_handler`` answers
with them. Every call comes from the agent's main thread (a warm process's parent-death
signal fires when the thread that started it ends): ``configure`` at the agent's start,
``spawn_missing`` once the ranks step, ``poll`` at every monitor pass, ``spawning_from`` at
each (re)start, ``stop`` at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ftmem.launch.elastic_compat import subprocess_handler_replaced
from ftmem.launch.standby import (
    DEFAULT_IMPORTS,
    FORK_SERVER_WAIT_S,
    STANDBY_NICE,
    STANDBY_PATH,
    ForkServer,
    PythonCommand,
    Standby,
    StandbyHandler,
    parse_python_command,
    unwrap_shim,
)

log = logging.getLogger(__name__)


class StandbyPool:
    """The node's warm processes: its fork server (``fork``), or ``count`` standby ranks per
    local rank. Each is the agent's child in its own session, with a parent-death signal;
    :meth:`stop` SIGKILLs and reaps those not handed out."""

    def __init__(
        self,
        *,
        count: int,
        imports: Sequence[str],
        cuda: bool,
        run_dir: Path,
        node: str,
        fork: bool = True,
    ) -> None:
        self.count = count
        self.fork = fork
        """One fork server per node instead of a standby per local rank."""
        self.server: ForkServer | None = None
        """The fork server (``fork`` only), from :meth:`configure` until :meth:`stop`."""
        self.imports = tuple(dict.fromkeys([*DEFAULT_IMPORTS, *imports]))
        self.cuda = cuda
        self.run_dir = run_dir
        self.node = node
        self.command: PythonCommand | None = None
        """The ranks' command; None until :meth:`configure` (or when standbys cannot run it)."""
        self.local_world_size = 0
        self._standbys: dict[int, list[Standby]] = {}
        self._spawned = 0
        self.handed: dict[int, Standby] = {}
        """Local rank -> the standby that became it at the newest start."""
        self.idle = False
        """The host has a core for every standby's warm-up beside the ranks and the SMP
        (:func:`idle_cores`): standbys then start with the ranks, and a standby not ready at a
        restart keeps warming up; without, they start once the ranks step, and one not ready
        at a restart is retired so that it does not slow the cold start."""

    @property
    def enabled(self) -> bool:
        """Standbys are on and the ranks' command can run in one."""
        return self.count > 0 and self.command is not None

    def configure(self, entrypoint: Any, args: Sequence[str], local_world_size: int) -> None:
        """Learn the ranks' command; log once why standbys are off if they cannot run it."""
        self.local_world_size = local_world_size
        if self.count <= 0:
            return
        if not isinstance(entrypoint, str):
            log.warning("[%s] standby ranks are off: the entrypoint is a function", self.node)
            return
        line = unwrap_shim(entrypoint, args)
        cmd = parse_python_command(line)
        if cmd is None:
            log.warning(
                "[%s] standby ranks are off: the rank command is not `python [-u] script.py "
                "...` or `python -m module ...`: %s",
                self.node,
                line,
            )
            return
        self.command = cmd
        if self.fork:
            self.cuda = False  # a CUDA context cannot cross a fork: each rank makes its own
            pid = self._start_server().pid
            log.info("[%s] ranks start from a fork server (pid %d)", self.node, pid)
            return
        self.idle, why = idle_cores(local_world_size, self.count)
        log.info(
            "[%s] standby ranks start %s (%s)",
            self.node,
            "with the ranks" if self.idle else "once the ranks are stepping",
            why,
        )

    def standbys(self) -> list[Standby]:
        """Every standby not handed out yet (the fork server, while it lives)."""
        if self.fork:
            server = self.server
            return [server.standby] if server is not None and not server.gone else []
        return [s for group in self._standbys.values() for s in group]

    def _start_server(self) -> Standby:
        """Start the fork server; its warm-up runs at the normal priority: the first ranks
        wait for it (:meth:`ready_server`), so it competes with none of this node's steps."""
        standby = self._spawn(0, fork_server=True)
        self.server = ForkServer(standby)
        return standby

    def ready_server(self, wait_s: float) -> ForkServer | None:
        """The fork server once warm (waiting up to ``wait_s``), else None (logged)."""
        deadline = time.monotonic() + wait_s
        while (server := self.server) is not None and not server.gone:
            self._poll_server()
            if server.standby.ready_at is not None:
                return server
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "[%s] fork server pid %d is not warm yet: cold start",
                    self.node,
                    server.standby.pid,
                )
                return None
            select.select([server.standby.ctl], [], [], min(left, 0.5))
        return None

    def spawn_missing(self) -> list[Standby]:
        """Start standbys until every local rank has ``count`` (call from the main thread);
        with ``fork``, start a new fork server if the last one died and its ranks are gone."""
        if not self.enabled:
            return []
        if self.fork:
            if self.server is not None and not self.server.gone:
                return []
            if self.server is not None:
                if self.server.ranks_alive():
                    return []  # they die with it: the restart comes first, and starts cold
                self.server.standby.kill()
            return [self._start_server()]
        started = []
        for local_rank in range(self.local_world_size):
            group = self._standbys.setdefault(local_rank, [])
            while len(group) < self.count:
                standby = self._spawn(local_rank)
                group.append(standby)
                started.append(standby)
        if started:
            log.info(
                "[%s] started standby ranks (pids %s) for the next restart",
                self.node,
                [s.pid for s in started],
            )
        return started

    def _spawn(self, local_rank: int, fork_server: bool = False) -> Standby:
        assert self.command is not None
        cmd = self.command
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [
            cmd.python,
            *cmd.flags,
            str(STANDBY_PATH),
            "--ctl-fd",
            str(theirs.fileno()),
            "--agent-pid",
            str(os.getpid()),
            "--local-rank",
            str(local_rank),
            "--path0",
            cmd.path0(os.getcwd()),
            "--nice",
            str(STANDBY_NICE),
        ]
        if self.imports:
            argv += ["--import", ",".join(self.imports)]
        if self.cuda:
            argv.append("--cuda")
        if fork_server:
            argv += ["--fork-server", "--idle", "0"]
        log_path = self.run_dir / (
            "fork-server.log" if fork_server else f"standby-{local_rank}.log"
        )
        try:
            with open(log_path, "ab") as out:
                popen = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=out,
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        finally:
            theirs.close()
        self._spawned += 1
        return Standby(local_rank, popen, ours, time.time(), log_path)

    def poll(self) -> list[Standby]:
        """Read ready reports (return the standbys that became ready now, logged); drop (and
        log) standbys that died before they were needed."""
        if self.fork:
            return self._poll_server()
        ready = []
        for local_rank, group in self._standbys.items():
            for standby in list(group):
                if standby.ready_at is None and standby.poll_ready():
                    ready.append(standby)
                    log.info(
                        "[%s] standby pid %d for local rank %d ready (%s)",
                        self.node,
                        standby.pid,
                        local_rank,
                        standby.warm_up_note(),
                    )
                code = standby.popen.poll()
                if code is not None:
                    group.remove(standby)
                    standby.kill()
                    log.warning(
                        "[%s] standby pid %d for local rank %d died (exit %s) before it was "
                        "needed; see %s",
                        self.node,
                        standby.pid,
                        local_rank,
                        code,
                        standby.log_path,
                    )
        return ready

    def _poll_server(self) -> list[Standby]:
        server = self.server
        if server is None:
            return []
        standby = server.standby
        if standby.ready_at is None:
            if not standby.poll_ready():
                if standby.popen.poll() is not None:
                    server.gone = True
                    log.warning(
                        "[%s] fork server pid %d died warming up (exit %s); see %s",
                        self.node,
                        standby.pid,
                        standby.popen.returncode,
                        standby.log_path,
                    )
                return []
            log.info(
                "[%s] fork server pid %d ready (%s)", self.node, standby.pid, standby.warm_up_note()
            )
            return [standby]
        server.drain()
        if server.gone and standby.popen.poll() is not None:
            log.warning(
                "[%s] fork server pid %d died (exit %s)",
                self.node,
                standby.pid,
                standby.popen.returncode,
            )
        return []

    def take(self, local_rank: int) -> Standby | None:
        """A ready, live standby for ``local_rank`` (removed from the pool), or None (logged)."""
        self.poll()
        group = self._standbys.get(local_rank, [])
        for standby in group:
            if standby.poll_ready():
                group.remove(standby)
                return standby
        if group:
            log.warning(
                "[%s] standby for local rank %d is not ready yet (pid %s): cold start%s",
                self.node,
                local_rank,
                [s.pid for s in group],
                "" if self.idle else "; retired, so that its warm-up does not slow the cold start",
            )
            if not self.idle:
                for standby in group:
                    standby.kill()
                group.clear()
        elif self.enabled and self._spawned:  # not at the job's first start: none is due then
            log.warning("[%s] no standby for local rank %d: cold start", self.node, local_rank)
        return None

    def stop(self) -> None:
        """SIGKILL and reap every standby not handed out and the fork server (idempotent)."""
        if self.server is not None:
            self.server.standby.kill()
            self.server.gone = True
        for group in self._standbys.values():
            for standby in group:
                standby.kill()
            group.clear()


def idle_cores(local_ranks: int, count: int) -> tuple[bool, str]:
    """Whether this host has a core for each of ``count`` standbys per local rank beside the
    ranks (``OMP_NUM_THREADS`` threads each, 1 if unset, as torchrun sets it) and the SMP;
    with the reason, for the log."""
    cores = len(os.sched_getaffinity(0))
    try:
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        threads = 1
    spare = cores - local_ranks * threads - 1
    why = f"{cores} cores, {local_ranks} ranks x {threads} threads + the SMP: {max(spare, 0)} idle"
    return spare >= local_ranks * count, why


Adopt = Callable[[int, dict[str, str], Any, Any], SubprocessHandler | None]
"""``adopt(local_rank, env, stdout, stderr)``: a process kept alive for that local rank, or None."""


@contextlib.contextmanager
def spawning_from(
    pool: StandbyPool, adopt: Adopt | None = None, env_update: Mapping[str, str] | None = None
) -> Iterator[None]:
    """While inside, elastic's ``get_subprocess_handler`` gives each rank the process
    ``adopt`` returns (kept alive across the restart, :mod:`ftmem.launch.in_process`), else a
    ready standby or the fork server's fork, else (also when the handoff fails) elastic's own
    cold start. Every rank, however started, gets ``env_update`` on top of elastic's
    environment.
    """
    pool.handed = {}

    def get_handler(
        elastic_own: Callable[..., SubprocessHandler],
        entrypoint: str,
        args: tuple[Any, ...],
        env: dict[str, str],
        stdout: Any,
        stderr: Any,
        local_rank_id: int,
        numa_options: Any = None,
    ) -> SubprocessHandler:
        env = {**env, **(env_update or {})}
        kept = adopt(local_rank_id, env, stdout, stderr) if adopt is not None else None
        if kept is not None:
            return kept
        warm = numa_options is None and pool.enabled
        cmd = parse_python_command(unwrap_shim(entrypoint, args)) if warm else None
        via: Standby | ForkServer | None = None
        if cmd is not None:
            via = pool.ready_server(FORK_SERVER_WAIT_S) if pool.fork else pool.take(local_rank_id)
        if cmd is not None and via is not None:
            standby = via.standby if isinstance(via, ForkServer) else via
            try:
                handler = StandbyHandler(via, cmd, env, stdout, stderr, local_rank_id)
            except OSError as exc:
                log.warning(
                    "[%s] handing local rank %d to %s pid %d failed (%s): cold start",
                    pool.node,
                    local_rank_id,
                    "the fork server" if pool.fork else "standby",
                    standby.pid,
                    exc,
                )
                if not pool.fork:
                    standby.kill()
            else:
                pool.handed[local_rank_id] = standby
                return handler
        return elastic_own(
            entrypoint=entrypoint,
            args=args,
            env=env,
            stdout=stdout,
            stderr=stderr,
            local_rank_id=local_rank_id,
            numa_options=numa_options,
        )

    with subprocess_handler_replaced(get_handler):
        yield
