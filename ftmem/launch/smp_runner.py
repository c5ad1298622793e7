"""Start, watch and stop the node's SMP (snapshot management process).

The agent owns exactly one :class:`SmpRunner`. The SMP is started before the first ranks
(``ftmem.smp.spawn.start_smp`` does the readiness handshake with a deadline), outlives every
rank restart, is restarted when it dies, and is stopped (SIGTERM, bounded wait, SIGKILL) when
the agent shuts down. It watches the agent's pid, so it exits if the agent is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftmem.config import ENV_LOG_LEVEL

if TYPE_CHECKING:
    from ftmem.smp.spawn import SmpProcess

log = logging.getLogger(__name__)


@dataclass(kw_only=True, eq=False)
class SmpRunner:
    """Owns the node's SMP process: start, liveness, restart, stop.

    Resource handling: :meth:`stop` is idempotent and bounded by ``stop_timeout``. Error
    handling: :meth:`start` raises ``SmpStartError`` if the SMP is not ready in time.
    """

    run_dir: Path
    run_id: str
    node: str
    slots: int
    start_timeout: timedelta
    stop_timeout: timedelta
    log_level: str = "INFO"
    extra_env: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    """More of the SMP's settings (SmpConfig's fields, JSON-ready), handed over in its
    settings file with the run directory, run id, node, slots and this agent's pid."""
    _proc: SmpProcess | None = field(default=None, init=False)
    starts: int = field(default=0, init=False)
    """How many times an SMP was started (1 + restarts)."""
    last_exit: int | None = field(default=None, init=False)
    """Exit code of the previous SMP if it died (negative: killed by that signal)."""

    @property
    def pid(self) -> int | None:
        """The running SMP's pid, or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """The SMP's log file (stdout and stderr)."""
        return self.run_dir / "smp.log"

    def start(self) -> None:
        """Start the SMP and wait for its readiness handshake (at most ``start_timeout``)."""
        from ftmem.smp.spawn import start_smp

        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(self.extra_env)
        env.setdefault(ENV_LOG_LEVEL, self.log_level)
        t0 = time.monotonic()
        self._proc = start_smp(
            run_dir=self.run_dir,
            run_id=self.run_id,
            node=self.node,
            slots=self.slots,
            start_timeout=self.start_timeout,
            parent_pid=os.getpid(),
            env=env,
            log_path=self.log_path,
            settings=self.settings,
        )
        self.starts += 1
        log.info(
            "[%s] SMP pid %s ready in %.2f s (run dir %s, start #%d)",
            self.node,
            self._proc.pid,
            time.monotonic() - t0,
            self.run_dir,
            self.starts,
        )

    def poll(self) -> int | None:
        """Return the SMP's exit code if it has exited (or was never started), else None."""
        if self._proc is None:
            return self.last_exit if self.last_exit is not None else 0
        code = self._proc.poll()
        if code is not None:
            self.last_exit = code
        return code

    def is_alive(self) -> bool:
        """True while the SMP process runs."""
        return self._proc is not None and self._proc.poll() is None

    def ensure_running(self) -> bool:
        """Start the SMP if it is not running; return True if it had to be (re)started."""
        if self.is_alive():
            return False
        if self._proc is not None:
            log.warning(
                "[%s] SMP pid %s is gone (exit %s); starting a new one",
                self.node,
                self._proc.pid,
                self._proc.poll(),
            )
            self._proc = None
        self.start()
        return True

    def stop(self) -> None:
        """Stop the SMP: SIGTERM, wait ``stop_timeout``, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            log.info("[%s] stopping SMP pid %s", self.node, proc.pid)
            try:
                proc.stop(timeout=self.stop_timeout)
            except Exception:
                log.exception("[%s] stopping SMP pid %s failed; killing it", self.node, proc.pid)
                proc.kill()
        code = proc.poll()
        if code is None:
            log.error("[%s] SMP pid %s is still alive after stop", self.node, proc.pid)
        else:
            log.info("[%s] SMP pid %s exited with %s", self.node, proc.pid, code)
