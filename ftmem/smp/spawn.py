"""Start an SMP as a child process with a readiness handshake and a deadline; stop it in steps."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from ftmem._logging import get_logger
from ftmem.errors import ProtocolError, SmpStartError
from ftmem.protocol.messages import SmpReady
from ftmem.secure_fs import replace_private_file

log = get_logger(__name__)


class SmpProcess:
    """A running SMP child.

    Resource handling: :meth:`stop` (idempotent, also on context exit) sends SIGTERM, waits,
    then SIGKILLs and waits again; the SMP removes its shared memory on SIGTERM.
    """

    def __init__(
        self, popen: subprocess.Popen[bytes], info: SmpReady, log_file: IO[bytes] | None
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.info = info
        """What the SMP said of itself once ready."""
        self.endpoint = info.endpoint
        self._log_file = log_file

    def poll(self) -> int | None:
        """Return the exit code if the SMP has exited, else None."""
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the SMP (a test's way to lose it) and reap it."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)
        self._close_log()

    def stop(self, timeout: timedelta = timedelta(seconds=10)) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL and wait; return the exit code."""
        _terminate(self.popen, timeout.total_seconds())
        self._close_log()
        return self.popen.returncode

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> SmpProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals a launcher turns into a stop (elastic's agent raises on each)."""
SMP_DEFERRED_SIGNALS = {signal.SIGTERM, signal.SIGINT}
"""Blocked in a new SMP until ``python -m ftmem.smp`` has its handlers for them."""
ABANDON_GRACE_S = 30.0
"""How long an SMP that :func:`start_smp` gives up on (stopped while it starts, or not ready
in time) may take to stop cleanly before it is SIGKILLed: it finishes starting first."""


def _terminate(popen: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the SMP, wait up to ``grace_s``, then SIGKILL it and wait (bounded). A second
    signal to us while we wait kills it at once and propagates."""
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        log.warning("SMP %d ignored SIGTERM for %g s; killing", popen.pid, grace_s)
    finally:
        if popen.poll() is None:
            popen.kill()
    try:
        popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.error("SMP %d still alive after SIGKILL (D state?)", popen.pid)


@contextlib.contextmanager
def _signals_deferred(sigs: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Inside, those of ``sigs`` that have a Python handler (one that may raise) are only
    noted; on leaving, each noted one is raised again, and its own handler runs then. Python
    handlers run in the main thread only: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    saved = {
        sig: signal.signal(sig, lambda signum, frame: noted.append(signum))
        for sig in sigs
        if callable(signal.getsignal(sig))
    }
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(noted):
            signal.raise_signal(signum)


SETTINGS_NAME = "smp-settings.json"
"""The SMP's settings file in its run directory (what ``python -m ftmem.smp --settings`` reads)."""


def write_settings(run_dir: Path, doc: Mapping[str, Any]) -> Path:
    """Write the SMP settings ``doc`` to ``run_dir/smp-settings.json`` (mode 0600, replaced
    atomically: a restarted SMP gets its own); the file's path."""
    path = run_dir / SETTINGS_NAME
    replace_private_file(path, json.dumps(dict(doc), indent=1, sort_keys=True).encode())
    return path


def start_smp(
    *,
    run_dir: Path | str,
    run_id: str = "default",
    node: str = "node0",
    slots: int = 2,
    start_timeout: timedelta = timedelta(seconds=60),
    parent_pid: int | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | str | None = None,
    extra_args: list[str] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> SmpProcess:
    """Spawn ``python -m ftmem.smp`` and return once it wrote ``READY {json}`` to its pipe.

    ``settings``: more of SmpConfig's fields, JSON-ready (paths as strings, durations in
    seconds); then every setting goes to the SMP in one file (:func:`write_settings`) instead
    of flags. Its output goes to ``log_path`` (or is inherited).

    Raises:
        SmpStartError: it exited or missed ``start_timeout`` (it is stopped then).
    """
    if settings is not None:
        doc: dict[str, Any] = {"run_dir": str(Path(run_dir).absolute()), "run_id": run_id}
        doc |= {"node": node, "slots": slots, "parent_pid": parent_pid, **settings}
        path = write_settings(Path(run_dir), doc)
        extra_args = ["--settings", str(path), *(extra_args or [])]
    rfd, wfd = os.pipe()
    cmd = [sys.executable, "-m", "ftmem.smp", "--ready-fd", str(wfd)]
    if settings is None:
        cmd += ["--run-dir", str(run_dir), "--run-id", run_id, "--node", node]
        cmd += ["--slots", str(slots)]
        if parent_pid is not None:
            cmd += ["--parent-pid", str(parent_pid)]
    cmd += extra_args or []
    log_file = open(log_path, "ab") if log_path is not None else None
    popen: subprocess.Popen[bytes] | None = None
    try:
        # A stop request (a signal whose handler raises, as elastic's agent does on SIGTERM)
        # must not land inside Popen, after the fork: the child would run on, unstopped. The
        # child starts with SIGTERM and SIGINT blocked (a mask survives exec) and unblocks them
        # once its handlers are in: a stop sent before then waits instead of killing it before
        # it could adopt, and so remove, its predecessor's slot files.
        with _signals_deferred():
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, SMP_DEFERRED_SIGNALS)
            try:
                popen = subprocess.Popen(
                    cmd,
                    pass_fds=(wfd,),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file if log_file else None,
                    stderr=log_file if log_file else None,
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # Close our copy of the write end so the child's death shows up as EOF at once.
        os.close(wfd)
        wfd = -1
        deadline = time.monotonic() + start_timeout.total_seconds()
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SmpStartError(f"SMP pid {popen.pid} not ready within {start_timeout}")
            ready, _, _ = select.select([rfd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(rfd, 4096)
                if not chunk:
                    code = popen.wait(timeout=10)
                    raise SmpStartError(f"SMP exited with code {code} before it was ready")
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith("READY "):
            raise SmpStartError(f"unexpected readiness line {line!r}")
        try:
            info = SmpReady.from_json(line[6:])
        except ProtocolError as exc:
            raise SmpStartError(f"unexpected readiness line {line[:200]!r}: {exc}") from exc
    except BaseException:
        # Stopped, not killed: a half-started SMP may already hold its predecessor's slot
        # files (it adopts them before it serves); on SIGTERM it removes them and exits.
        if popen is not None:
            _terminate(popen, ABANDON_GRACE_S)
        if log_file:
            log_file.close()
        raise
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
    assert popen is not None
    log.info("SMP %d ready at %s", popen.pid, info.endpoint)
    return SmpProcess(popen, info, log_file)
