"""The warm processes ranks start from, and elastic's handles of them.

A cold rank start pays for the interpreter, ``import torch`` and the job's other imports
before any rank-specific work. ``_standby.py`` does that start-up and waits on a socketpair
with the agent, either as the node's fork server (:class:`ForkServer`: it forks every rank)
or as a standby rank (:class:`Standby`: it becomes one rank); :mod:`ftmem.launch.warm_start`
keeps them and hands elastic's rank starts to them.

Inside elastic's process management: while the agent starts its ranks, elastic's
``get_subprocess_handler`` returns a :class:`StandbyHandler` whose ``proc`` is a
:class:`ForkedProcess` (a ``Popen``-like handle whose exit status the fork server reports) or
the standby's ``Popen``. Elastic polls, tails and kills that pid like any rank's: the rank
leads its own session, writes into the per-rank log files elastic opened (their descriptors
are handed over), and its exit code or signal is elastic's ``ProcessFailure``.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ftmem import typed_json
from ftmem.errors import ProtocolError
from ftmem.launch.workers import SHIM_PATH, is_gone
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
    log_path: Path
    """Its stdout and stderr."""
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

    @property
    def warm_up_s(self) -> float:
        """Seconds from the spawn to the ready report (0 until it came)."""
        return (self.ready_at or self.spawned) - self.spawned

    def warm_up_note(self) -> str:
        """``warm-up N s`` and what failed to warm, for the ready line of the log."""
        failed = self.report.failed if self.report is not None else None
        return f"warm-up {self.warm_up_s:.1f} s" + (f"; failed: {failed}" if failed else "")

    def kill(self) -> None:
        """SIGKILL the standby's process group and reap it (bounded)."""
        with contextlib.suppress(OSError):
            self.ctl.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def _close_all(files: list[Any]) -> None:
    for f in files:
        if f is not None:
            f.close()


@dataclass(frozen=True, slots=True)
class ForkReply:
    """What the fork server says after the warm-up: a rank forked, or a rank reaped."""

    forked: int | None = None
    exited: int | None = None
    code: int | None = None
    """The reaped rank's status as ``Popen.returncode`` (negative: killed by that signal)."""
    at: float | None = None
    """When the server reaped it (wall clock); ranks are reaped in the order they died."""


class ForkServer:
    """The agent's side of the node's fork server (``_standby.py --fork-server``): one warm
    process that forks a rank per handoff and reports each one's exit, which it reaps.

    Its replies come on the standby's control socket after the warm-up report; every rank's
    :class:`ForkedProcess` reads them through :meth:`drain` (the agent's main thread only).
    """

    def __init__(self, standby: Standby) -> None:
        self.standby = standby
        self.exited: dict[int, int] = {}
        """pid -> exit status of the ranks it reaped (until their :meth:`ForkedProcess.poll`)."""
        self.reaped_at: dict[int, float] = {}
        """pid -> when it reaped the rank (the newest :data:`REAPED_KEPT`): which one died
        first, finer than elastic's whole-second failure timestamps."""
        self.gone = False
        """Its control socket closed: it died (and its ranks with it, by their death signal)."""
        self.forked: set[int] = set()
        """pids of the ranks it forked and has not reported reaped (those that died with it
        stay until :meth:`ranks_alive` finds them gone): never a pid a later process reuses."""

    def drain(self, block_s: float = 0.0) -> int | None:
        """Read the replies waiting (waiting up to ``block_s`` for the first); note the exits
        and return the pid of a rank forked meanwhile, if any."""
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
                self.forked.discard(reply.exited)
                if reply.at is not None:
                    self.reaped_at[reply.exited] = reply.at
                    while len(self.reaped_at) > REAPED_KEPT:
                        del self.reaped_at[next(iter(self.reaped_at))]
            if reply.forked is not None:
                return reply.forked
        return None

    def ranks_alive(self) -> bool:
        """Whether a rank it forked still runs: after the server's death, until its death
        signal ends the rank (its socket closes before the kernel sends that signal)."""
        self.forked = {pid for pid in self.forked if not is_gone(pid)}
        return bool(self.forked)

    def fork(self, message: bytes, fds: list[int], args: list[str]) -> ForkedProcess:
        """Hand over one rank and wait (bounded) for its pid; OSError if that fails."""
        socket.send_fds(self.standby.ctl, [message], fds)
        deadline = time.monotonic() + FORK_REPLY_S
        while (left := deadline - time.monotonic()) > 0 and not self.gone:
            pid = self.drain(left)
            if pid is not None:
                self.forked.add(pid)
                return ForkedProcess(self, pid, args)
        raise OSError(f"fork server pid {self.standby.pid} did not fork the rank")


FORK_REPLY_S = 30.0
"""How long a handoff waits for the fork server's pid reply."""
FORK_SERVER_WAIT_S = 120.0
"""How long a (re)start waits for the fork server's warm-up before it starts ranks cold
(about as long as a cold start would take on a loaded host: it imports the same modules)."""
REAPED_KEPT = 1024
"""How many reap times :class:`ForkServer` keeps (a few generations of ranks)."""


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
            if code is None and self.server.gone and is_gone(self.pid):
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

    def kill(self) -> None:
        """SIGKILL the rank."""
        self.send_signal(signal.SIGKILL)


class StandbyHandler(SubprocessHandler):
    """elastic's handle of a rank that a standby became (``proc`` is the standby's Popen) or
    that the fork server forked (``proc`` is a :class:`ForkedProcess`).

    Built instead of ``SubprocessHandler.__init__``'s spawn: it opens the per-rank log files
    as elastic does and hands the rank (``_standby.py``'s handoff message) and them over;
    ``close()`` is elastic's (``killpg`` of the rank's session, then the files).
    """

    def __init__(
        self,
        via: Standby | ForkServer,
        cmd: PythonCommand,
        env: dict[str, str],
        stdout: str | None,
        stderr: str | None,
        local_rank_id: int,
    ) -> None:
        self.local_rank_id = local_rank_id
        files = [open(path, "w") if path else None for path in (stdout, stderr)]
        self._stdout, self._stderr = files
        std = (sys.stdout, sys.stderr)  # where elastic leaves a rank's output without a file
        fds = [f.fileno() if f else out.fileno() for f, out in zip(files, std, strict=True)]
        handoff = {
            "kind": cmd.kind,
            "target": cmd.target,
            "argv": cmd.argv(),
            "orig_argv": cmd.command_line(),
            "env": {**os.environ, **env},
            "cwd": os.getcwd(),
        }
        message = json.dumps(handoff).encode()
        try:
            if isinstance(via, ForkServer):
                proc: Any = via.fork(message, fds, cmd.command_line())
            else:
                socket.send_fds(via.ctl, [message], fds)
                with contextlib.suppress(OSError):
                    via.ctl.close()
                proc = via.popen
        except OSError:
            _close_all(files)
            raise
        self.proc = proc  # a ForkedProcess has Popen's interface as elastic uses it

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """elastic's close (``killpg`` of the rank's session, then its log files). A rank the
        fork server already reaped, whose exit this agent has not read yet, is gone, not an
        error: elastic would otherwise raise ``ProcessLookupError`` out of its monitor."""
        try:
            super().close(death_sig)
        except ProcessLookupError:
            _close_all([self._stdout, self._stderr])
