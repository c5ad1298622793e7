"""Standby ranks: processes started ahead of a failure that take over a rank at a restart.

A cold rank start pays for the interpreter, ``import torch`` and the job's other imports
before it does any rank-specific work (seconds; ``bench/recovery.py`` measures it). The agent keeps
one :class:`Standby` per local rank that has done that start-up (``ftmem/launch/_standby.py``)
and waits on a socketpair; at a restart elastic asks for a process for every local rank and
:func:`spawning_from` answers with a standby where one is ready (a cold start otherwise).

How it stays inside elastic's process management: elastic makes each rank's process through
``get_subprocess_handler`` (in ``torch.distributed.elastic.multiprocessing.api``); while the
agent starts its ranks, :func:`spawning_from` substitutes a function that returns a
:class:`StandbyHandler` (a ``SubprocessHandler`` whose ``proc`` is the standby's ``Popen``)
for ranks that have a ready standby. Elastic then polls, tails and kills that pid like any
rank's: the standby leads its own session (``killpg`` reaches its children), writes into
the per-rank log files elastic opened (their descriptors are handed over), and its exit
code or signal is elastic's ``ProcessFailure``.

Call order (the agent's main thread only: a standby's parent-death signal fires when the
thread that started it ends): :meth:`StandbyPool.spawn_missing` after the ranks are stepping,
:meth:`StandbyPool.poll` on every monitor pass, ``with spawning_from(pool): start ranks`` at
a (re)start, :meth:`StandbyPool.stop` at shutdown (SIGKILL of every standby's group).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ftmem import typed_json
from ftmem.errors import ProtocolError
from ftmem.launch.elastic_compat import subprocess_handler_replaced
from ftmem.launch.workers import SHIM_PATH
from ftmem.typed_json import Most

Text = Annotated[str, Most(4096)]


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    """What a standby says once warm (``_standby.py``'s ready message)."""

    ready: bool
    seconds: float = 0.0
    imported: Annotated[list[Text], Most(256)] = field(default_factory=list)
    failed: Annotated[dict[str, Text], Most(256)] = field(default_factory=dict)
    """What could not be warmed (a module's import, the CUDA context), and why."""
    cuda: bool = False


log = logging.getLogger(__name__)

STANDBY_PATH = Path(__file__).with_name("_standby.py")
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch._inductor.config", "ftmem.client")
"""What every standby imports (``--ftmem-tune standby-import`` adds to it). ``torch._inductor.config``
pulls in ``torch._dynamo`` (slow to import), which ``torch.compile`` and even
``torch.use_deterministic_algorithms`` import at their first call."""
STANDBY_NICE = 10
"""Nice value of a standby's warm-up thread (the rank it becomes runs at the normal one)."""

# Interpreter flags a standby can take over (it is started with the same ones); a command
# with any other flag (-c, -X, -W, ...) is cold-started.
_PLAIN_FLAGS = set("bBdEiIOqsSuvR")


@dataclass(frozen=True, slots=True)
class PythonCommand:
    """A rank command of the form ``PYTHON [flags] script.py args`` or ``... -m mod args``."""

    python: str
    flags: tuple[str, ...]
    kind: str
    """``script`` or ``module``."""
    target: str
    """The script path as given, or the module name."""
    args: tuple[str, ...]

    def argv(self) -> list[str]:
        """``sys.argv`` as the interpreter sets it at start (runpy fixes ``argv[0]`` for -m)."""
        return [self.target if self.kind == "script" else "-m", *self.args]

    def command_line(self) -> list[str]:
        """The whole command line (``sys.orig_argv`` of the rank)."""
        target = ["-m", self.target] if self.kind == "module" else [self.target]
        return [self.python, *self.flags, *target, *self.args]

    def path0(self, cwd: str) -> str:
        """``sys.path[0]`` as the interpreter sets it: the script's real directory, or cwd."""
        if self.kind == "module":
            return cwd
        return os.path.dirname(os.path.realpath(os.path.join(cwd, self.target)))


def parse_python_command(cmd: Sequence[str]) -> PythonCommand | None:
    """Parse a rank's command (without the exec shim); None if a standby cannot run it (pure).

    Accepted: an interpreter path whose name starts with ``python``, single-letter flags
    that take no argument (``-u``, ``-uB``, ...), then ``-m MODULE`` or a script path, then
    the script's arguments.
    """
    if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
        return None
    flags: list[str] = []
    i = 1
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] not in ("-", "-m"):
        flag = cmd[i]
        if flag.startswith("--") or not set(flag[1:]) <= _PLAIN_FLAGS:
            return None
        flags.append(flag)
        i += 1
    if i >= len(cmd) or cmd[i] == "-":
        return None
    if cmd[i] == "-m":
        if i + 1 >= len(cmd):
            return None
        return PythonCommand(cmd[0], tuple(flags), "module", cmd[i + 1], tuple(cmd[i + 2 :]))
    return PythonCommand(cmd[0], tuple(flags), "script", cmd[i], tuple(cmd[i + 1 :]))


def unwrap_shim(entrypoint: str, args: Sequence[str]) -> list[str]:
    """The rank's own command line: ``entrypoint args`` without the exec shim around it."""
    cmd = [entrypoint, *(str(a) for a in args)]
    if len(cmd) >= 3 and cmd[1] == "-S" and cmd[2] == str(SHIM_PATH):
        return cmd[3:]
    return cmd


@dataclass(slots=True)
class Standby:
    """One standby process and the agent's end of its control socket."""

    local_rank: int
    popen: subprocess.Popen[bytes]
    ctl: socket.socket
    spawned: float
    """``time.time()`` at the spawn."""
    ready_at: float | None = None
    report: WarmUpReport | None = None

    @property
    def pid(self) -> int:
        """The standby's pid (it leads its own process group)."""
        return int(self.popen.pid)

    def poll_ready(self) -> bool:
        """Read the ready report if it came (never blocks); True once the standby is ready."""
        if self.ready_at is None:
            try:
                data = self.ctl.recv(1 << 16, socket.MSG_DONTWAIT)
            except OSError:  # nothing yet (EAGAIN), or the socket is gone
                return False
            if not data:
                return False
            try:
                report = typed_json.parse(WarmUpReport, data, what="standby report")
            except ProtocolError as exc:
                log.warning("standby pid %d: %s; ignored", self.pid, exc)
                return False
            if report.ready:
                self.ready_at = time.time()
                self.report = report
        return self.ready_at is not None

    def kill(self) -> None:
        """SIGKILL the standby's process group and reap it (bounded)."""
        with contextlib.suppress(OSError):
            self.ctl.close()
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def _handoff(
    cmd: PythonCommand, env: dict[str, str], stdout: str | None, stderr: str | None
) -> tuple[bytes, list[Any], list[int]]:
    """The handoff message of a rank, its log files opened as elastic opens them, and the
    descriptors to pass (the files, else the agent's own stdout and stderr)."""
    files = [open(path, "w") if path else None for path in (stdout, stderr)]
    fds = [
        f.fileno() if f else std.fileno()
        for f, std in zip(files, (sys.stdout, sys.stderr), strict=True)
    ]
    env_vars = os.environ.copy()
    env_vars.update(env)
    message = {
        "kind": cmd.kind,
        "target": cmd.target,
        "argv": cmd.argv(),
        "orig_argv": cmd.command_line(),
        "env": env_vars,
        "cwd": os.getcwd(),
    }
    return json.dumps(message).encode(), files, fds


def _close_all(files: list[Any]) -> None:
    for f in files:
        if f is not None:
            f.close()


class StandbyHandler(SubprocessHandler):
    """elastic's handle of a rank that a standby became (``proc`` is the standby's Popen).

    Built instead of ``SubprocessHandler.__init__``'s spawn: it opens the per-rank log files
    as elastic does, hands the rank to the standby and keeps the files to close them in
    ``close()`` (inherited: ``killpg`` of ``proc.pid`` and closing the files).
    """

    def __init__(
        self,
        standby: Standby,
        cmd: PythonCommand,
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self.local_rank_id = local_rank_id
        message, files, fds = _handoff(cmd, env, stdout, stderr)
        self._stdout, self._stderr = files
        try:
            socket.send_fds(standby.ctl, [message], fds)
        except OSError:
            _close_all(files)
            raise
        with contextlib.suppress(OSError):
            standby.ctl.close()
        self.proc = standby.popen


@dataclass(frozen=True, slots=True)
class ForkReply:
    """What the fork server says after the warm-up: a rank forked, or a rank reaped."""

    forked: int | None = None
    exited: int | None = None
    code: int | None = None
    """The reaped rank's status as ``Popen.returncode`` (negative: killed by that signal)."""


class ForkServer:
    """The agent's side of the node's fork server (``_standby.py --fork-server``): one warm
    process that forks a rank per handoff and reports each one's exit, which it reaps.

    Its replies come on the standby's control socket after the warm-up report; every rank's
    :class:`ForkedProcess` reads them through :meth:`drain` (the agent's main thread only).
    """

    def __init__(self, standby: Standby) -> None:
        self.standby = standby
        self.exited: dict[int, int] = {}
        """pid -> exit status of the ranks it reaped."""
        self.gone = False
        """Its control socket closed: it died (and its ranks with it, by their death signal)."""

    def drain(self, block_s: float = 0.0) -> ForkReply | None:
        """Read the replies waiting (waiting up to ``block_s`` for the first); note the exits
        and return the newest ``forked`` reply, if any."""
        forked = None
        timeout = block_s
        while not self.gone:
            ready, _, _ = select.select([self.standby.ctl], [], [], timeout)
            if not ready:
                break
            timeout = 0.0
            try:
                data = self.standby.ctl.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self.gone = True
                break
            try:
                reply = typed_json.parse(ForkReply, data, what="fork server reply")
            except ProtocolError as exc:
                log.warning("fork server pid %d: %s; ignored", self.standby.pid, exc)
                continue
            if reply.exited is not None and reply.code is not None:
                self.exited[reply.exited] = reply.code
            if reply.forked is not None:
                forked = reply
                break
        return forked

    def fork(self, message: bytes, fds: list[int], args: list[str]) -> ForkedProcess:
        """Hand over one rank and wait (bounded) for its pid; OSError if that fails."""
        socket.send_fds(self.standby.ctl, [message], fds)
        deadline = time.monotonic() + FORK_REPLY_S
        while (left := deadline - time.monotonic()) > 0 and not self.gone:
            reply = self.drain(left)
            if reply is not None and reply.forked is not None:
                return ForkedProcess(self, reply.forked, args)
        raise OSError(f"fork server pid {self.standby.pid} did not fork the rank")


FORK_REPLY_S = 30.0
FORK_SERVER_WAIT_S = 120.0
"""How long a (re)start waits for the fork server's warm-up before it starts ranks cold
(about as long as a cold start would take on a loaded host: it imports the same modules)."""
"""How long a handoff waits for the fork server's pid reply."""


class ForkedProcess:
    """A rank forked by the fork server, with the part of ``Popen``'s interface elastic and
    the agent use (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status once the fork server reaped the rank (or once both are gone)."""
        if self.returncode is None:
            self.server.drain()
            code = self.server.exited.pop(self.pid, None)
            if code is None and self.server.gone and not _alive(self.pid):
                code = -signal.SIGKILL  # its death signal followed the fork server's end
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the rank exits; ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.server.drain(left)
        return code

    def send_signal(self, sig: int) -> None:
        """Signal the rank unless it is known to be gone."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the rank."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the rank."""
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is no zombie (read from ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] not in (b"Z", b"X")


class ForkedHandler(SubprocessHandler):
    """elastic's handle of a rank the fork server forked (``proc`` is a
    :class:`ForkedProcess`; ``close()`` is inherited: ``killpg`` of the rank's session)."""

    def __init__(
        self,
        server: ForkServer,
        cmd: PythonCommand,
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self.local_rank_id = local_rank_id
        message, files, fds = _handoff(cmd, env, stdout, stderr)
        self._stdout, self._stderr = files
        try:
            proc = server.fork(message, fds, cmd.command_line())
        except OSError:
            _close_all(files)
            raise
        self.proc = proc  # type: ignore[assignment]  # Popen's interface as elastic uses it


class StandbyPool:
    """The node's standby ranks: ``count`` per local rank, started and handed out here.

    Resource handling: every standby is the agent's child in its own session, with a
    parent-death signal; :meth:`stop` SIGKILLs and reaps those not handed out.
    """

    def __init__(
        self,
        *,
        count: int,
        imports: Sequence[str],
        cuda: bool,
        run_dir: Path,
        node: str,
        nice: int = STANDBY_NICE,
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
        self.nice = nice
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
        cmd = parse_python_command(unwrap_shim(entrypoint, args))
        if cmd is None:
            log.warning(
                "[%s] standby ranks are off: the rank command is not `python [-u] script.py "
                "...` or `python -m module ...`: %s",
                self.node,
                unwrap_shim(entrypoint, args),
            )
            return
        self.command = cmd
        if self.fork:
            self.cuda = False  # a CUDA context cannot cross a fork: each rank makes its own
            self._start_server()
            log.info("[%s] ranks start from a fork server (pid %d)", self.node, self._pid())
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

    def _pid(self) -> int:
        return self.server.standby.pid if self.server is not None else -1

    def _start_server(self) -> Standby:
        """Start the fork server; its warm-up runs at the normal priority: the first ranks
        wait for it (:meth:`ready_server`), so it competes with none of this node's steps."""
        standby = self._spawn(0, fork_server=True)
        self._spawned += 1
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
        with ``fork``, start a new fork server if the last one died."""
        if not self.enabled:
            return []
        if self.fork:
            if self.server is not None and not self.server.gone:
                return []
            if self.server is not None:
                self.server.standby.kill()
            return [self._start_server()]
        started = []
        for local_rank in range(self.local_world_size):
            group = self._standbys.setdefault(local_rank, [])
            while len(group) < self.count:
                standby = self._spawn(local_rank)
                self._spawned += 1
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
            str(self.nice),
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
        return Standby(local_rank=local_rank, popen=popen, ctl=ours, spawned=time.time())

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
                        "[%s] standby pid %d for local rank %d ready (warm-up %.1f s%s)",
                        self.node,
                        standby.pid,
                        local_rank,
                        standby.ready_at - standby.spawned if standby.ready_at else 0.0,
                        f"; failed: {standby.report.failed}"
                        if standby.report is not None and standby.report.failed
                        else "",
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
                        self.run_dir / f"standby-{local_rank}.log",
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
                        self.run_dir / "fork-server.log",
                    )
                return []
            log.info(
                "[%s] fork server pid %d ready (warm-up %.1f s%s)",
                self.node,
                standby.pid,
                standby.ready_at - standby.spawned if standby.ready_at else 0.0,
                f"; failed: {standby.report.failed}"
                if standby.report is not None and standby.report.failed
                else "",
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
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
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
    """While inside, elastic gets for each rank the process ``adopt`` returns (a rank kept
    alive across the restart, :mod:`ftmem.launch.in_process`), else a ready standby where
    there is one. Every rank, however started, gets ``env_update`` on top of elastic's
    environment.

    Replaces ``get_subprocess_handler`` in elastic's ``multiprocessing.api`` module for the
    duration (the agent starts ranks from its main thread only); a rank without a ready
    standby, or whose standby fails the handoff, is started cold by elastic's own function.
    """
    pool.handed = {}
    elastic_own: list[Callable[..., SubprocessHandler]] = []  # set on entering the swap

    def get_handler(
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
        cmd = parse_python_command(unwrap_shim(entrypoint, args)) if pool.enabled else None
        server = None
        if pool.fork and cmd is not None and numa_options is None:
            server = pool.ready_server(FORK_SERVER_WAIT_S)
        if server is not None and cmd is not None:
            try:
                forked = ForkedHandler(server, cmd, env, stdout, stderr, local_rank_id)
            except OSError as exc:
                log.warning(
                    "[%s] forking local rank %d failed (%s): cold start",
                    pool.node,
                    local_rank_id,
                    exc,
                )
            else:
                pool.handed[local_rank_id] = server.standby
                return forked
        take = cmd is not None and numa_options is None and not pool.fork
        standby = pool.take(local_rank_id) if take else None
        if standby is not None and cmd is not None:
            try:
                handler = StandbyHandler(standby, cmd, env, stdout, stderr, local_rank_id)
            except OSError as exc:
                log.warning(
                    "[%s] handing local rank %d to standby pid %d failed (%s): cold start",
                    pool.node,
                    local_rank_id,
                    standby.pid,
                    exc,
                )
                standby.kill()
            else:
                pool.handed[local_rank_id] = standby
                return handler
        cold: SubprocessHandler = elastic_own[0](
            entrypoint=entrypoint,
            args=args,
            env=env,
            stdout=stdout,
            stderr=stderr,
            local_rank_id=local_rank_id,
            numa_options=numa_options,
        )
        return cold

    with subprocess_handler_replaced(get_handler) as original:
        elastic_own.append(original)
        yield
