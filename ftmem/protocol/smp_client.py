"""SmpClient: a process's only link to its node's SMP (one DEALER socket, one owner thread)."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import zmq

from ftmem._logging import get_logger
from ftmem._process import pid_alive
from ftmem.config import AUTH_KEY_NAME, ENV_AGENT_PID, READY_NAME, SOCKET_NAME
from ftmem.errors import (
    ErrorKind,
    ProtocolError,
    SmpRequestError,
    SmpUnavailableError,
    UnsafePathError,
)
from ftmem.protocol import messages as m
from ftmem.protocol.status import SmpStatus
from ftmem.protocol.wire import decode, encode
from ftmem.secure_fs import check_dir, read_private_file

log = get_logger(__name__)

R = TypeVar("R")

_SLICE_MS = 200  # how often a waiting request checks that the SMP process still exists


class SmpClient:
    """Request/reply to the SMP serving ``run_dir``. Not thread-safe: each thread owns its
    own SmpClient (ZeroMQ sockets belong to one thread). :meth:`close` (idempotent; context
    manager) closes the socket.

    Error handling: every request waits at most ``timeout`` and raises SmpUnavailableError
    if the SMP does not answer (sooner if its process is gone), and SmpRequestError if it
    answers with an error.
    """

    def __init__(self, run_dir: Path | str, timeout: timedelta = timedelta(seconds=30)) -> None:
        self.run_dir = Path(run_dir)
        self.timeout = timeout
        sock_path = self.run_dir / SOCKET_NAME
        if not sock_path.exists():
            raise SmpUnavailableError(
                f"no SMP serves {self.run_dir} (missing {SOCKET_NAME}): " + _not_served_hint()
            )
        try:
            check_dir(self.run_dir, "SMP run directory", private=True)
            self._key: bytes | None = read_private_file(self.run_dir / AUTH_KEY_NAME, "SMP key")
            ready = m.SmpReady.from_json((self.run_dir / READY_NAME).read_text())
            self.smp_pid: int | None = ready.pid
        except UnsafePathError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise  # planted or opened up by someone else: say so, never use it
            raise SmpUnavailableError(f"SMP in {self.run_dir} is not ready: {exc}") from exc
        except (OSError, ValueError, ProtocolError) as exc:
            raise SmpUnavailableError(f"SMP in {self.run_dir} is not ready: {exc}") from exc
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{sock_path}")
        self._ids = itertools.count(1)

    def request(self, payload: Any, timeout: timedelta | None = None) -> dict[str, Any]:
        """Send one request and return the reply's data.

        Raises:
            SmpUnavailableError: no reply within the timeout, or the SMP process is gone.
            SmpRequestError: the SMP replied with an error.
        """
        if self._sock is None:
            raise SmpUnavailableError("client is closed")
        req_id = next(self._ids)
        self._sock.send(encode(payload, req_id, self._key), copy=True)
        limit = (timeout or self.timeout).total_seconds() * 1000
        waited = 0.0
        while waited < limit:
            step = min(_SLICE_MS, limit - waited)
            if self._sock.poll(int(step), zmq.POLLIN):
                frame = self._sock.recv(copy=True)
                try:
                    rid, kind, reply = decode(frame, self._key)
                except ProtocolError as exc:
                    raise SmpUnavailableError(f"unreadable reply from the SMP: {exc}") from exc
                if rid != req_id or kind is not m.Kind.REPLY:
                    log.debug("dropping stale reply %d (waiting for %d)", rid, req_id)
                    continue
                assert isinstance(reply, m.Reply)
                if not reply.ok:
                    raise SmpRequestError(
                        f"SMP refused {type(payload).__name__}: {reply.error}",
                        reply.kind or ErrorKind.REFUSED,
                    )
                return reply.data
            waited += step
            self.check_alive()
        raise SmpUnavailableError(
            f"the SMP serving {self.run_dir} did not answer {type(payload).__name__} "
            f"within {limit / 1000:.1f} s"
        )

    def check_alive(self) -> None:
        """Raise SmpUnavailableError if the SMP's process is gone (no message is sent: a
        save that needs no request still fails fast on a dead SMP)."""
        if self._sock is None:
            raise SmpUnavailableError("client is closed")
        if self.smp_pid is not None and not pid_alive(self.smp_pid):
            raise SmpUnavailableError(
                f"the SMP (pid {self.smp_pid}) serving {self.run_dir} is gone"
            )

    def call(self, payload: m.Request[R], timeout: timedelta | None = None) -> R:
        """Send one request and return its answer, of the type the request names
        (``m.Begin`` -> ``m.BeginReply``; None for a request whose answer carries nothing).

        Raises:
            ProtocolError: the answer does not fit its type; otherwise as :meth:`request`.
        """
        data = self.request(payload, timeout)
        reply = m.REPLY_OF[type(payload)]
        return cast(R, None if reply is None else m.parse_reply(reply, data))

    def query(self, rank: int) -> list[m.SnapshotInfo]:
        """``rank``'s verified snapshots the SMP holds, newest step first."""
        return self.call(m.Query(rank=rank)).snapshots

    def status(self) -> SmpStatus:
        """The SMP's STATUS, typed (:class:`~ftmem.protocol.status.SmpStatus`)."""
        return self.call(m.Status())

    def status_document(self) -> dict[str, Any]:
        """The SMP's STATUS as the JSON document it sent (``ftmem status`` prints it)."""
        return self.request(m.Status())

    def close(self) -> None:
        """Close the socket and its context."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self._ctx.term()

    def __enter__(self) -> SmpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _not_served_hint() -> str:
    """What to do when no SMP serves the run directory: a rank that torchrun (or another
    launcher) started gets no SMP, ftmem-launch starts one on every node."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and not os.environ.get(ENV_AGENT_PID):
        return (
            "this rank was started by torchrun, not by ftmem-launch, which starts the SMP on "
            "every node: run the same command with `ftmem-launch` in place of `torchrun` (it "
            "takes the same flags)"
        )
    return "is the job running here? `ftmem status` with no arguments lists your SMPs on this host"
