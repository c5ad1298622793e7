"""Starting, watching and reaping ``ftmem-launch`` agents: the one process harness of the
tests, the chaos runner (:mod:`tests._support.chaos.cluster`) and the benchmarks.

- :func:`launch_args` is the one builder of an agent's command line (torchrun's flags, then
  the ``--ftmem-*`` flags, then the training script); :func:`launch_command` puts
  ``python -m ftmem.launch`` (what the ``ftmem-launch`` console script runs) in front.
- :func:`agent_env` is an agent's environment: one OpenMP thread per rank, none of the
  caller's own ftmem variables.
- :class:`AgentProcess` is one started process (an agent, or any job) in a session of its
  own, logging to a file, stopped by SIGTERM, a bounded wait, then SIGKILL.
- :func:`free_port`, :func:`pid_gone`, :func:`wait_gone`, :func:`shm_files` and
  :func:`remove_shm` are the small helpers every caller needed.
- For tests: :class:`Launch` is an agent whose waits fail the test when they run out; the
  ``launcher_env`` fixture (tests/conftest.py) gives a test a :class:`Launcher`, which
  remembers every descendant it ever saw (ranks lead their own sessions, so killing the
  agent's group does not reach them), kills what is left after the test and asserts that all
  of them are gone.

Processes are only ever signalled by pid or process group, never by name. Timeouts are a
:class:`~datetime.timedelta` or seconds. Only the test parts import pytest (when they fail a
test), so the benchmarks use this module without it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import NoReturn, Self

import psutil

from ftmem.config import ENV_FAULT, ENV_RUN_DIR, ENV_RUN_ID, default_shm_dir
from ftmem.launch.job_key import host_key_path
from ftmem.protocol.smp_client import SmpClient
from ftmem.shm import parse_slot_name
from ftmem.smp.spawn import SmpProcess, start_smp
from tests._support.procs import REPO, WORKLOAD, python_stacks  # noqa: F401 (WORKLOAD: re-exported)
from tests._support.workload import TINY_ARGS, digests

log = logging.getLogger(__name__)

LAUNCH_MODULE = "ftmem.launch"
"""The module that ``python -m`` runs as ``ftmem-launch``."""

Timeout = timedelta | float
"""A bounded wait: a timedelta, or seconds."""


def _seconds(timeout: Timeout) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pid_gone(pid: int) -> bool:
    """True if ``pid`` no longer exists (a zombie counts as gone)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def rank_pids(run_dir: Path) -> dict[int, int]:
    """Global rank -> pid of an agent's live ranks, as its newest ``ranks_started`` event
    says (a rank's ``/proc`` command line and environment are its fork server's)."""
    from ftmem.observe.timeline import read_events

    started = [e for e in read_events([run_dir]).events if e.event == "ranks_started"]
    if not started:
        return {}
    fields = started[-1].fields
    pairs = zip(fields.get("ranks", []), fields.get("pids", []), strict=True)
    return {int(r): int(p) for r, p in pairs if not pid_gone(int(p))}


def wait_gone(pids: Iterable[int], timeout: Timeout) -> set[int]:
    """Wait (polling) until every pid is gone; return those still alive at the deadline."""
    deadline = time.monotonic() + _seconds(timeout)
    alive = {p for p in pids if not pid_gone(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = {p for p in alive if not pid_gone(p)}
    return alive


def wait_slots_made(run_dir: Path, rank: int, timeout: float = 60.0) -> None:
    """Wait until the SMP of ``run_dir`` has made every slot of ``rank`` (after the first
    one, which the rank's first save waits for, the SMP makes the others in the background,
    and a save that finds no free slot meanwhile is skipped)."""
    deadline = time.monotonic() + timeout
    with SmpClient(run_dir) as c:
        while any(s.state == "allocating" for s in c.status().ranks[rank].slots):
            assert time.monotonic() < deadline, f"rank {rank}'s slots not made in {timeout} s"
            time.sleep(0.02)


def shm_files(run_id: str, node: str | None = None, shm_dir: Path | None = None) -> list[str]:
    """Slot files and commit records of ``run_id`` (of one node if given, any SMP's nonce)
    in the user's private shared-memory directory (``shm_dir``, default
    :func:`ftmem.config.default_shm_dir`), as sorted absolute paths (so
    ``os.path.join("/dev/shm", p)`` is ``p`` itself). Names are parsed, so run ``a`` never
    lists run ``a-b``'s files, nor node ``n1`` node ``n1-x``'s."""
    d = default_shm_dir() if shm_dir is None else shm_dir
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        parsed = parse_slot_name(name)
        if parsed is None or parsed.run_id != run_id:
            continue
        if node is None or parsed.node == node:
            out.append(str(d / name))
    return sorted(out)


@contextlib.contextmanager
def running_smp(
    run_dir: Path, run_id: str, extra_args: list[str] | None = None
) -> Iterator[SmpProcess]:
    """A running SMP for ``run_id`` in ``run_dir`` (with the SMP flags ``extra_args``);
    stopped on leaving, which then checks it left no process and no shared memory behind."""
    proc = start_smp(
        run_dir=run_dir,
        run_id=run_id,
        start_timeout=timedelta(seconds=60),
        log_path=run_dir / "smp.log",
        extra_args=extra_args,
    )
    try:
        yield proc
    finally:
        proc.stop()
        assert pid_gone(proc.pid)
        assert shm_files(run_id) == [], "the SMP left shared memory behind"


def remove_shm(run_id: str, node: str | None = None, shm_dir: Path | None = None) -> list[str]:
    """Remove the shared-memory files of ``run_id`` (of one node if given), as a killed SMP
    or a lost machine leaves them; return the paths that were there (see :func:`shm_files`)."""
    left = shm_files(run_id, node, shm_dir)
    for path in left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return left


def launch_args(
    *,
    nnodes: int = 1,
    min_nodes: int | None = None,
    nproc: int = 1,
    rdzv_endpoint: str,
    rdzv_id: str,
    node: str,
    run_dir: Path | str,
    is_host: bool | None = None,
    monitor_interval: float | None = 0.1,
    flags: Sequence[str] = (),
    script: Sequence[str] = (),
) -> list[str]:
    """The arguments of one ``ftmem-launch`` agent, in this order: ``--nnodes`` (``MIN:MAX``
    with ``min_nodes``),
    ``--nproc-per-node``, c10d rendezvous at ``rdzv_endpoint`` (host:port) with id
    ``rdzv_id`` (and ``--rdzv-conf is_host=`` when ``is_host`` is given), the agent's
    ``--monitor-interval`` (unless None: the launcher's default), ``--ftmem-node``, ``--ftmem-run-dir``, then ``flags`` (more
    torchrun or ``--ftmem-*`` flags) and last the training script and its arguments."""
    if nnodes < 1 or nproc < 1 or (min_nodes is not None and not 1 <= min_nodes <= nnodes):
        raise ValueError("nnodes and nproc must be >= 1, min_nodes in 1..nnodes")
    args = [
        "--nnodes",
        str(nnodes) if min_nodes is None else f"{min_nodes}:{nnodes}",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
    ]
    if is_host is not None:
        args += ["--rdzv-conf", f"is_host={int(is_host)}"]
    if monitor_interval is not None:
        args += ["--monitor-interval", f"{monitor_interval:g}"]
    args += ["--ftmem-node", node, "--ftmem-run-dir", str(run_dir)]
    return [*args, *flags, *script]


def launch_command(args: Sequence[str], python: str = sys.executable) -> list[str]:
    """The command that starts an agent with ``args``: ``python -m ftmem.launch ARGS``."""
    return [python, "-m", LAUNCH_MODULE, *args]


_NOT_INHERITED = (
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    ENV_FAULT,
    ENV_RUN_DIR,
    ENV_RUN_ID,
)


def agent_env(
    extra: Mapping[str, str] | None = None,
    *,
    pythonpath: Sequence[str | Path] = (),
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """An agent's environment: ``base`` (default: this process's) with ``pythonpath``
    prepended to PYTHONPATH, one OpenMP thread per rank, none of the caller's ``FTMEM_FAULT``/``FTMEM_RUN_DIR``/
    ``FTMEM_RUN_ID`` nor ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (ftmem-launch sets its own),
    then ``extra``."""
    env = dict(os.environ if base is None else base)
    paths = [str(p) for p in pythonpath]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH", "")) if p)
    if not env["PYTHONPATH"]:
        del env["PYTHONPATH"]
    env["OMP_NUM_THREADS"] = "1"
    for key in _NOT_INHERITED:
        env.pop(key, None)
    env.update(extra or {})
    return env


class AgentProcess:
    """One started process (an ``ftmem-launch`` agent, or any job) in a session of its own,
    its stdout and stderr in ``log_path``.

    Elastic starts every rank in a session of its own, so killing the agent's process group
    does not reach them: every wait here notes the agent's descendants by pid (:attr:`seen`)
    and :meth:`kill_rest` SIGKILLs each of them.

    Resource handling: :meth:`stop` (idempotent, bounded; also on leaving a ``with`` block)
    sends SIGTERM (an agent then stops its ranks and its SMP, which frees its arenas), waits,
    then :meth:`kill_rest`; :meth:`lose` SIGKILLs the agent and its descendants at once.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        *,
        name: str = "",
        cwd: Path | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.log_path = log_path
        self.name = name or log_path.stem
        self.seen: set[int] = set()
        """Every descendant ever seen."""
        with open(log_path, "wb") as f:
            self.popen = subprocess.Popen(
                self.cmd,
                env=dict(env),
                cwd=cwd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        self.started = time.monotonic()
        self._log = bytearray()
        self._text = ""
        self._noted_at = 0.0

    @classmethod
    def launch(
        cls,
        args: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        *,
        name: str = "",
        cwd: Path | None = None,
    ) -> Self:
        """Start ``python -m ftmem.launch ARGS`` (see :func:`launch_args`)."""
        return cls(launch_command(args), log_path, env, name=name, cwd=cwd)

    def text(self) -> str:
        """The log so far (only what was appended since the last call is read; the same
        object comes back while nothing was)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(len(self._log))
                new = f.read()
        except FileNotFoundError:
            return self._text
        if new:
            self._log += new
            self._text = self._log.decode(errors="replace")
        return self._text

    def _note_children(self) -> None:
        """:meth:`children` at most every 0.5 s (it walks every process of the machine)."""
        if time.monotonic() - self._noted_at >= 0.5:
            self._noted_at = time.monotonic()
            self.children()

    def children(self) -> list[psutil.Process]:
        """The live descendants (their pids are remembered in :attr:`seen`)."""
        try:
            kids = list(psutil.Process(self.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            kids = []
        self.seen |= {k.pid for k in kids}
        return kids

    def descendants(self) -> set[int]:
        """The pids of the live descendants (also remembered in :attr:`seen`)."""
        return {k.pid for k in self.children()}

    def stacks(self) -> str:
        """The stacks of the process and its live descendants (:func:`python_stacks`)."""
        return python_stacks([self.pid, *(k.pid for k in self.children())])

    def poll(self) -> int | None:
        """The exit code, or None while the process runs."""
        return self.popen.poll()

    def wait(self, timeout: Timeout) -> int | None:
        """Wait up to ``timeout`` for the process to exit (noting descendants meanwhile);
        its exit code, or None if it still runs."""
        deadline = time.monotonic() + _seconds(timeout)
        while self.popen.poll() is None and time.monotonic() < deadline:
            self._note_children()
            time.sleep(0.1)
        return self.popen.poll()

    def wait_log(self, pattern: str, timeout: Timeout, count: int = 1) -> list[re.Match[str]]:
        """Wait until ``pattern`` matched ``count`` times in the log; the matches.

        Error handling: RuntimeError (with the log's tail) when the process exits first or
        ``timeout`` runs out.
        """
        rx = re.compile(pattern)
        deadline = time.monotonic() + _seconds(timeout)
        searched, found = None, []
        while True:
            self._note_children()
            text = self.text()
            if text is not searched:  # the log grew
                searched, found = text, list(rx.finditer(text))
            if len(found) >= count:
                return found
            if time.monotonic() > deadline or self.popen.poll() is not None:
                if len(found := list(rx.finditer(self.text()))) >= count:
                    return found
                stacks = self.stacks() if self.popen.poll() is None else ""  # where is it?
                raise RuntimeError(
                    f"{pattern!r} x{count} not in {self.name}'s log within {_seconds(timeout):g}"
                    f" s (exit {self.popen.poll()}); log tail:\n{self.text()[-3000:]}"
                    + (f"\nstacks of its processes:\n{stacks}" if stacks else "")
                )
            time.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process only (its descendants noted first)."""
        self.children()
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM to the process if it still runs (an agent stops its ranks and its SMP)."""
        self.children()
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def kill_rest(self, reap_timeout: Timeout = 30.0) -> None:
        """SIGKILL the process group and every descendant ever seen; reap the process."""
        self.children()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        _kill(self.seen)
        try:
            self.popen.wait(timeout=_seconds(reap_timeout))
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) still alive after SIGKILL", self.name, self.pid)

    def stop(self, term_timeout: Timeout = 20.0) -> None:
        """:meth:`terminate`, wait up to ``term_timeout``, then :meth:`kill_rest`."""
        self.terminate()
        if self.wait(term_timeout) is None:
            log.warning("%s did not stop on SIGTERM; killing it", self.name)
        self.kill_rest()

    def lose(self, timeout: Timeout = 10.0) -> set[int]:
        """The machine dies: the process and every live descendant SIGKILLed at once, then
        reaped; return the pids still alive after ``timeout``."""
        procs = {self.pid, *self.descendants()}
        _kill(procs)
        try:
            self.popen.wait(timeout=_seconds(timeout))
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) survived SIGKILL", self.name, self.pid)
        left = wait_gone(procs, timeout)
        if left:
            log.error("%s: processes %s survived SIGKILL", self.name, sorted(left))
        return left

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# -- for tests ------------------------------------------------------------------------------

TINY = list(TINY_ARGS)
"""Arguments of the workload for a model of tens of milliseconds a step on one core."""


def _fail(message: str) -> NoReturn:
    import pytest  # only a test gets here; the benchmarks run without pytest

    pytest.fail(message)


def short_dir(prefix: str = "ftl-") -> Path:
    """A short private directory under /tmp (ipc socket paths are limited to ~100 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def wait_verified(run_dir: Path, ranks: set[int], timeout: float, min_step: int = 0) -> None:
    """Wait until the SMP's event log shows a verified snapshot of step ``min_step`` or newer
    of every rank in ``ranks``.

    Commits are asynchronous and a rank's first save is skipped while its slots are
    allocated, so under load a rank may hold nothing yet although its peers logged steps.
    """
    path = run_dir / "smp-events.jsonl"
    deadline = time.monotonic() + timeout
    seen: set[int] = set()
    while time.monotonic() < deadline:
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line being written
                    continue
                if event.get("event") == "verified" and int(event.get("step", -1)) >= min_step:
                    seen.add(int(event["rank"]))
        if ranks <= seen:
            return
        time.sleep(0.1)
    _fail(f"no verified snapshot of ranks {sorted(ranks - seen)} within {timeout} s")


class Launch(AgentProcess):
    """One ``ftmem-launch`` agent started by a test; its waits fail the test when they run
    out (or the agent exits first)."""

    def wait_for(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match[str]]:
        """Wait until ``pattern`` matched ``count`` times in the log; fail the test otherwise."""
        try:
            return self.wait_log(pattern, timeout, count)
        except RuntimeError as exc:
            _fail(str(exc))

    def wait(self, timeout: Timeout) -> int:
        """Wait for the agent to exit (collecting descendants meanwhile); return its code."""
        code = super().wait(timeout)
        if code is None:
            stacks = self.stacks()
            _fail(
                f"{self.name} still running after {timeout} s; log tail:\n{self.text()[-3000:]}"
                + (f"\nstacks of its processes:\n{stacks}" if stacks else "")
            )
        return code

    def kill_all(self) -> None:
        """Stop the agent (SIGTERM, bounded wait), then SIGKILL its group and every descendant."""
        self.stop(term_timeout=20.0)


class Launcher:
    """Starts agents for one test and cleans up after it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.launches: list[Launch] = []
        self.run_ids: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of an agent: the repo on PYTHONPATH, one thread per rank (ranks
        start from the fork server, as shipped)."""
        return agent_env(extra, pythonpath=[REPO])

    def new_run_id(self) -> str:
        """A unique run id (shared-memory names carry it)."""
        rid = "tl" + uuid.uuid4().hex[:10]
        self.run_ids.append(rid)
        return rid

    def start(self, args: list[str], name: str = "agent", **env: str) -> Launch:
        """Start ``python -m ftmem.launch ARGS`` logging to ``<tmp>/<name>.log``."""
        launch = Launch.launch(args, self.tmp / f"{name}.log", self.env(**env), cwd=REPO)
        self.launches.append(launch)
        return launch

    def single_node(
        self,
        run_id: str,
        nproc: int,
        ftmem: list[str],
        script: list[str],
        name: str = "agent",
        **env: str,
    ) -> Launch:
        """One node, c10d rendezvous on a free local port."""
        args = launch_args(
            nproc=nproc,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_id=run_id,
            node="n0",
            run_dir=self.tmp / f"{name}-rd",
            flags=ftmem,
            script=script,
        )
        return self.start(args, name, **env)

    def torchrun(self, script: list[str], nproc: int, name: str) -> Launch:
        """Start ``python -m torch.distributed.run --standalone`` with ``nproc`` ranks of
        ``script`` (no ftmem-launch), logging to ``<tmp>/<name>.log``; cleaned up as agents."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc), *script]
        launch = Launch(cmd, self.tmp / f"{name}.log", self.env(), name=name, cwd=REPO)
        self.launches.append(launch)
        return launch

    def cleanup(self) -> None:
        """Kill everything still alive; assert every process and arena is gone."""
        for launch in self.launches:
            launch.kill_all()
        seen = {p for launch in self.launches for p in launch.seen | {launch.pid}}
        alive = wait_gone(seen, 15)
        assert not alive, f"processes left behind: {alive}"
        for rid in self.run_ids:  # an agent that was killed leaves its host's job key
            host_key_path(rid).unlink(missing_ok=True)
        left = {rid: shm_files(rid) for rid in self.run_ids}
        for path in (p for paths in left.values() for p in paths):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a failed test (its SMPs SIGKILLed) leaks nothing either
        for rid, paths in left.items():
            assert paths == [], f"shared memory of {rid} left behind"


_REFERENCE: dict[tuple[str, ...], dict[int, str]] = {}


def failure_free_digests(launcher: Launcher, script: list[str], timeout: float) -> dict[int, str]:
    """Digests of a failure-free 2-rank run of ``script`` under plain torchrun, the run a
    user compares with (a data-parallel run: checked to be the same on both ranks)."""
    ref = launcher.torchrun(script, nproc=2, name="reference")
    assert ref.wait(timeout) == 0, ref.text()[-3000:]
    want = digests(ref.text())
    assert len(want) == 2 and len(set(want.values())) == 1
    return want


def reference_digests(
    launcher: Launcher, steps: int, nproc: int = 2, extra: Sequence[str] = ()
) -> dict[int, str]:
    """Digests of a failure-free run of the example with ``nproc`` ranks (the world size of
    the job it is compared with) and the workload's ``extra`` arguments (cached per session). Its ranks save every step into an SMP
    as under ftmem-launch, but are forked from one process that imported torch once
    (:func:`tests._support.ranks.run_ranks`): no agent, no fork server to start."""
    from tests._support.ranks import run_ranks  # (it imports this module)

    key = (str(steps), str(nproc), *extra)
    if key not in _REFERENCE:
        rid = launcher.new_run_id()
        run_dir = Path(tempfile.mkdtemp(prefix=f"reference{nproc}-", dir=launcher.tmp))
        with running_smp(run_dir, rid):
            ref = run_ranks(
                run_dir,
                ["--steps", str(steps), *TINY, *extra],
                world=nproc,
                env_extra={ENV_RUN_DIR: str(run_dir), ENV_RUN_ID: rid},
                timeout=240,
                tag="reference",
            )
        assert ref.codes == [0] * nproc, [t[-3000:] for t in ref.outputs]
        _REFERENCE[key] = digests("".join(ref.outputs))
        assert len(_REFERENCE[key]) == nproc
    return dict(_REFERENCE[key])
