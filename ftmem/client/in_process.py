"""``ftmem.run``: a training function whose process survives the failure of other ranks.

When a collective fails because a peer died (:func:`is_peer_failure`),
:func:`run_in_process` waits for the pending snapshot, tears the process group down
(:func:`teardown_process_group`, bounded), waits for ftmem-launch's next generation
(:class:`~ftmem.protocol.rejoin.RejoinOrder`, bounded by ``FTMEM_REJOIN_TIMEOUT``), creates the
group again, restores from memory and calls ``train`` again. Anything else propagates and the
process is started cold. Process-group-bound objects must live only inside ``train``: gloo
closes a group's connections only once nothing refers to it, and until then a peer blocked on
this rank does not notice the failure. See docs/launcher.md, "In-process restart".
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ftmem import faults
from ftmem.client.flatten import dtensor_type
from ftmem.config import (
    ENV_AGENT_PID,
    ENV_GENERATION,
    ENV_REJOIN_TIMEOUT,
    ENV_RUN_DIR,
    env_seconds,
)
from ftmem.errors import FtmemError
from ftmem.protocol.rejoin import RejoinOrder, read_order

log = logging.getLogger(__name__)

T = TypeVar("T")

TEARDOWN_TIMEOUT_S = 30.0
"""Longest wait for the old process group's teardown (an NCCL abort can hang)."""
POLL_S = 0.01
"""How often a rank looks for its rejoin order."""

_PEER_FAILURE_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "NCCL error",
    "ncclRemoteError",
    "Socket Timeout",
)
"""What the messages of a collective that failed because a peer died contain (gloo's
transport errors and ProcessGroupNCCL's abort/remote errors; gloo raises plain
RuntimeErrors)."""


class RejoinError(FtmemError):
    """The rank cannot rejoin in process; it exits and ftmem-launch starts it cold."""


class InProcessUnavailable(FtmemError):
    """``ftmem.run`` was called outside ftmem-launch (plain torchrun, a single process)."""


def is_peer_failure(exc: BaseException) -> bool:
    """True if ``exc`` (or an exception it was raised from) is a collective failing because a
    peer process died or was aborted; False for anything else (a bug, a CUDA error, OOM)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        if isinstance(cur, dist.DistNetworkError):
            return True
        if isinstance(cur, RuntimeError):
            text = str(cur)
            if "CUDA error" in text:
                return False  # the device may be broken: a new process is safer
            if isinstance(cur, dist.DistBackendError) or any(t in text for t in _PEER_FAILURE_TEXT):
                return True
        cur = cur.__cause__ or cur.__context__
    return False


def require_launcher() -> int:
    """Check that this rank was started by ftmem-launch; return the agent's pid.

    Raises:
        InProcessUnavailable: with what to do instead.
    """
    agent = os.environ.get(ENV_AGENT_PID, "")
    if not agent.isdigit() or not os.environ.get(ENV_RUN_DIR):
        raise InProcessUnavailable(
            "ftmem.run restarts ranks in process and needs ftmem-launch, which keeps the "
            "survivors of a failure alive and hands them the next generation; this rank was "
            f"not started by it ({ENV_AGENT_PID} / {ENV_RUN_DIR} not set: plain torchrun or "
            "python?). Run the same command with `ftmem-launch` in place of `torchrun`, or "
            "call `train(ftmem.load(state))` yourself for process restarts only."
        )
    if not started_by(int(agent)):
        raise InProcessUnavailable(
            f"ftmem.run: this rank's parent (pid {os.getppid()}) is neither the ftmem-launch "
            f"agent (pid {agent}) nor its fork server; the rank must be started by the agent"
        )
    return int(agent)


def started_by(agent: int) -> bool:
    """True while ``agent`` is this process's parent, or the parent of its parent (the
    agent's fork server forks the ranks); False once either is gone (we were re-parented)."""
    parent = os.getppid()
    if parent == agent:
        return True
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2 :].split()
    return len(fields) > 1 and fields[1] == str(agent).encode()


def default_backend() -> str:
    """``nccl`` when CUDA is available, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(backend: str, timeout: timedelta | None) -> None:
    """Create the default process group from the environment (``env://``)."""
    if backend == "nccl":
        # Let the watchdog abort a failed communicator (the collective then raises) instead of
        # tearing the process down: 2 = abort and clean up, keep the process.
        if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") == "1":
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    kwargs: dict[str, Any] = {"backend": backend, "init_method": "env://"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(**kwargs)


def _bounded(what: str, fn: Callable[[], None], timeout_s: float) -> None:
    """Run ``fn`` in a thread; raise :class:`RejoinError` if it raises or does not return in
    ``timeout_s`` (the thread is left behind: the process is about to exit)."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # reported to the caller
            errors.append(exc)

    thread = threading.Thread(target=body, name=f"ftmem-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RejoinError(f"{what} did not finish within {timeout_s:.0f} s")
    if errors:
        raise RejoinError(f"{what} failed: {errors[0]}") from errors[0]


def teardown_process_group(backend: str, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Tear down every process group of this process after a peer failure (bounded).

    gloo: ``destroy_process_group`` (it returns at once once the collective has failed).
    NCCL: abort every communicator (``_abort_process_group``: it does not wait for the hung
    kernels), then check that the device is usable (a CUDA error raises: a process that saw
    one cannot be trusted, so it restarts cold).
    """
    if not dist.is_initialized():
        return
    if backend == "nccl":
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            raise RejoinError("this torch cannot abort an NCCL process group")
        _bounded("the NCCL abort", abort, timeout_s)
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            _bounded("a CUDA synchronize after the abort", torch.cuda.synchronize, timeout_s)
    if dist.is_initialized():
        _bounded("the process group teardown", dist.destroy_process_group, timeout_s)


def wait_for_order(
    run_dir: str, rank: int, generation: int, agent_pid: int, timeout_s: float
) -> RejoinOrder:
    """Wait for this rank's rejoin order of a generation newer than ``generation``.

    Raises:
        RejoinError: none within ``timeout_s``, or the agent is gone (this process was
            re-parented), or the order names another rank.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if not started_by(agent_pid):
            raise RejoinError(f"the agent (pid {agent_pid}) is gone")
        try:
            order = read_order(Path(run_dir), rank)
        except FtmemError as exc:
            raise RejoinError(f"unusable rejoin order: {exc}") from exc
        if order is not None and order.generation > generation:
            if order.agent_pid != agent_pid:
                raise RejoinError(f"rejoin order from pid {order.agent_pid}, not the agent")
            return order
        if time.monotonic() > deadline:
            raise RejoinError(
                f"no new generation within {timeout_s:.0f} s ({ENV_REJOIN_TIMEOUT}) after the "
                "peer failure"
            )
        time.sleep(POLL_S)


def _reopen_output(order: RejoinOrder) -> None:
    """Point stdout and stderr at the new generation's log files (the agent tails those)."""
    for fd, path, stream in ((1, order.stdout, sys.stdout), (2, order.stderr, sys.stderr)):
        if not path:
            continue
        stream.flush()
        new = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.dup2(new, fd)
        finally:
            os.close(new)


def _refuse_dtensors(state: MutableMapping[str, Any]) -> None:
    """DTensor parameters (FSDP2, tensor parallel) hold their device mesh and with it the
    process groups: they cannot move to a new group in process."""
    dtensor = dtensor_type()
    for value in state.values():
        if (
            dtensor is not None
            and isinstance(value, torch.nn.Module)
            and any(isinstance(p, dtensor) for p in value.parameters())
        ):
            raise InProcessUnavailable(
                "ftmem.run: the model's parameters are DTensors (FSDP2 / tensor parallel), "
                "which hold their device mesh's process groups: they cannot rejoin a new "
                "group in process. Use ftmem.load and process restarts (standby ranks) for "
                "this model."
            )


def run_in_process(
    train: Callable[[int], T],
    state: MutableMapping[str, Any],
    checkpointer: Any,
    *,
    replicated_over: Callable[[], Any] | None = None,
    backend: str | None = None,
    pg_timeout: timedelta | None = None,
) -> T:
    """See :func:`ftmem.run` (the public entry point); ``checkpointer`` is the process's
    :class:`~ftmem.client.Checkpointer`."""
    agent_pid = require_launcher()
    _refuse_dtensors(state)
    if not dist.is_initialized():
        init_process_group(backend or default_backend(), pg_timeout)
    backend = str(dist.get_backend())
    checkpointer.announce_in_process()
    rank = dist.get_rank()
    rejoins = 0
    while True:
        group = replicated_over() if replicated_over is not None else None
        start = checkpointer.load(state, replicated_over=group)
        del group
        try:
            return train(start)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        # Out of the except block: the exception's traceback (and with it train's frames,
        # its DDP module, the failed work) is gone, so the old group can really be freed.
        log.warning(
            "[rank %d] a collective failed because a peer failed (%s): rejoining in process",
            rank,
            first,
        )
        t0 = time.monotonic()
        _rejoin(checkpointer, backend, pg_timeout, rank, agent_pid, start)
        rejoins += 1
        log.warning(
            "[rank %d] rejoined in process (generation %s, %d rejoin(s)) in %.2f s",
            rank,
            os.environ.get(ENV_GENERATION),
            rejoins,
            time.monotonic() - t0,
        )


def _rejoin(
    checkpointer: Any,
    backend: str,
    pg_timeout: timedelta | None,
    rank: int,
    agent_pid: int,
    step: int,
) -> None:
    checkpointer.leave_generation()
    teardown_process_group(backend)
    # Free the old group (see the module docstring): collect what train left behind (its DDP
    # module holds the group), once, after the teardown dropped torch's own references.
    gc.collect()
    generation = int(os.environ.get(ENV_GENERATION, "-1") or -1)
    timeout = env_seconds(ENV_REJOIN_TIMEOUT, 120.0).total_seconds()
    order = wait_for_order(os.environ[ENV_RUN_DIR], rank, generation, agent_pid, timeout)
    # (after the order: the agent has handed this process its new generation)
    faults.maybe_inject(faults.Point.IN_REJOIN, rank, step)
    if order.env.get("RANK", str(rank)) != str(rank):
        raise RejoinError(f"the new generation gives this process rank {order.env['RANK']}")
    os.environ.update(order.env)
    _reopen_output(order)
    init_process_group(backend, pg_timeout)
    checkpointer.rejoined()
