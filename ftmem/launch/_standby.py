"""A standby rank or the fork server: a process that did a rank's rank-independent start-up.

:mod:`ftmem.launch.warm_start` starts it as ``PYTHON [the rank command's interpreter flags]
_standby.py --ctl-fd N --agent-pid P --local-rank L --path0 DIR [--import mod,...] [--cuda]
[--nice 10] [--fork-server]``.

It sets its parent-death signal (as the exec shim does for a cold rank); a low-priority
warm-up thread imports torch and the named modules (with ``--cuda``, creates device ``L``'s
CUDA context) and reports ``ready`` on the control socket (a ``SOCK_SEQPACKET`` socketpair).
The main thread blocks until the agent hands it a rank: command line, environment and cwd,
with the rank's stdout and stderr as descriptors (``SCM_RIGHTS``). It then becomes the rank
in this process (``__main__``, ``sys.argv``, ``sys.path[0]``, cwd, environment, signals and
streams as ``python script.py args`` sets them), so the pid the agent watches is the rank's;
the fork server forks a child that does that per handoff. End of file on the socket exits 0.

Nothing touches the SMP, a snapshot or a process group before a handoff (``--import`` opens
no connection). Standard library only until the warm-up thread runs.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import contextlib
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import types
from importlib.machinery import SourceFileLoader
from typing import Any

# sys.path[0] is this directory until main() sets the script's: the exec shim is a sibling.
from _exec_shim import die_with_parent

MAX_MESSAGE = 4 << 20
"""Largest handoff message (command line + environment) accepted."""


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="_standby.py")
    p.add_argument("--ctl-fd", type=int, required=True)
    p.add_argument("--agent-pid", type=int, required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--path0", required=True)
    p.add_argument("--import", dest="imports", default="")
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--idle", type=int, default=1, help="1: warm up under SCHED_IDLE")
    p.add_argument("--fork-server", action="store_true", help="fork a rank per handoff")
    return p.parse_args(argv)


def _warm_up(args: argparse.Namespace, ctl: socket.socket) -> None:
    """Import torch and the named modules (and create the CUDA context), then say ready."""
    # This thread only (Linux keeps the policy and nice value per thread): the main thread,
    # which becomes the rank, keeps its priority. SCHED_IDLE runs it only on a CPU nothing
    # else wants; the nice value is the fallback where SCHED_IDLE is refused.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice)
    if args.idle:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    t0 = time.monotonic()
    imported: list[str] = []
    failed: dict[str, str] = {}
    names = ["torch", *(n.strip() for n in args.imports.split(",") if n.strip())]
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
            imported.append(name)
        except BaseException as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    cuda = False
    if args.cuda and "torch" in imported:
        try:
            import torch

            if torch.cuda.is_available() and args.local_rank < torch.cuda.device_count():
                # The device is current in this thread only (CUDA keeps it per thread); the
                # primary context it creates belongs to the process and stays.
                with torch.cuda.device(args.local_rank):
                    torch.cuda.synchronize()
                cuda = True
            else:
                failed["cuda"] = f"no CUDA device {args.local_rank}"
        except BaseException as exc:
            failed["cuda"] = f"{type(exc).__name__}: {exc}"
    for name, why in failed.items():
        sys.stderr.write(f"ftmem standby: warm-up of {name} failed: {why}\n")
    sys.stderr.flush()
    report = {
        "ready": True,
        "seconds": round(time.monotonic() - t0, 3),
        "imported": imported,
        "failed": failed,
        "cuda": cuda,
    }
    with contextlib.suppress(OSError):  # the agent is gone or retired us: see _receive
        ctl.send(json.dumps(report).encode())


def _receive(ctl: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Block until the agent's handoff; exit quietly on end of file."""
    try:
        data, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MESSAGE, 2)
    except OSError:
        data, fds = b"", []
    if not data:
        os._exit(0)
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError):
        msg = None
    ok = (
        isinstance(msg, dict)
        and msg.get("kind") in ("script", "module")
        and isinstance(msg.get("target"), str)
        and isinstance(msg.get("argv"), list)
        and all(isinstance(a, str) for a in msg["argv"])
        and isinstance(msg.get("env"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in msg["env"].items())
        and isinstance(msg.get("cwd"), str)
        and len(fds) == 2
    )
    if not ok:
        sys.stderr.write("ftmem standby: malformed handoff message; exiting\n")
        os._exit(70)
    return msg, fds


def _reopen(fd: int, old: Any) -> io.TextIOWrapper:
    """A text stream on ``fd`` set up as CPython sets up ``sys.stdout``/``sys.stderr``."""
    unbuffered = bool(getattr(old, "write_through", False))
    raw = io.FileIO(fd, "w", closefd=False)
    buf: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buf,
        encoding=getattr(old, "encoding", None),
        errors=getattr(old, "errors", None),
        newline="\n",
        line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
        write_through=unbuffered,
    )


def _become_rank(msg: dict[str, Any], fds: list[int], dispositions: dict[int, Any]) -> None:
    """Take the rank's cwd, environment, streams, signals and argv; run its script."""
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    _flush_std()
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = _reopen(1, sys.__stdout__)
    sys.stderr = _reopen(2, sys.__stderr__)
    setattr(sys, "__stdout__", sys.stdout)  # noqa: B010 - typeshed marks them final
    setattr(sys, "__stderr__", sys.stderr)  # noqa: B010
    for sig, handler in dispositions.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    sys.argv = list(msg["argv"])
    orig = msg.get("orig_argv")
    if isinstance(orig, list) and all(isinstance(a, str) for a in orig):
        sys.orig_argv = orig
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    if msg["kind"] == "module":
        sys.path[0] = os.getcwd()
        run_as_main = runpy._run_module_as_main  # type: ignore[attr-defined]  # what -m runs
        _run_guarded(lambda: run_as_main(msg["target"], True), skip=(__file__, runpy.__file__))
        return
    path = msg["target"]
    file = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.path[0] = os.path.dirname(os.path.realpath(file))
    if not os.path.isfile(file):  # a directory or zip with __main__.py
        _run_guarded(lambda: runpy.run_path(file, run_name="__main__"), skip=(__file__,))
        return
    main.__dict__.update(
        __file__=file,
        __cached__=None,
        __loader__=SourceFileLoader("__main__", file),
        __spec__=None,
        __package__=None,
    )
    with open(file, "rb") as f:
        source = f.read()
    code = compile(source, file, "exec", dont_inherit=True)
    _run_guarded(lambda: exec(code, main.__dict__), skip=(__file__,))


def _run_guarded(run: Any, skip: tuple[str, ...]) -> None:
    """Run; report an uncaught exception as the interpreter would (without our frames)."""
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in skip:
            tb = tb.tb_next
        exc.with_traceback(tb)  # the hook prints the exception's own traceback
        sys.excepthook(type(exc), exc, tb)
        raise SystemExit(1) from None


def _exit_code(code: object) -> int:
    """The exit status ``raise SystemExit(code)`` gives an interpreter (printing a message)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"{code}\n")
    return 1


def _run_forked(msg: dict[str, Any], fds: list[int], dispositions: dict[int, Any]) -> int:
    """In a forked child: become the rank, then shut down as the interpreter would (the
    non-daemon threads joined, ``atexit`` run, the streams flushed); the exit status."""
    try:
        _become_rank(msg, fds, dispositions)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    _flush_std()
    return code


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


def _serve_forks(ctl: socket.socket, dispositions: dict[int, Any]) -> None:
    """The fork server's loop: fork a rank per handoff, report each rank's exit; never returns.

    Replies on ``ctl``: ``{"forked": pid}`` after each fork, ``{"exited": pid, "code": c,
    "at": t}`` once it is reaped (``c`` as ``Popen.returncode``: negative for a signal; ``t``
    the wall clock then), in the order the ranks died. The warm-up thread is gone by now, from
    the kernel's list too (:func:`_thread_gone`), so a fork copies no half-finished thread.
    """
    gc.freeze()  # what the warm-up allocated is never collected: its pages stay shared
    server = os.getpid()
    children: dict[int, int] = {}  # pidfd -> pid
    # epoll returns ready descriptors in the order they became ready (select would return
    # them in descriptor order): ranks that died while we waited for a CPU are reported in
    # the order they died, so the agent names the first one as the failure.
    poller = select.epoll()
    poller.register(ctl.fileno(), select.EPOLLIN)
    while True:
        for fd, _events in poller.poll():
            if fd in children:
                pid = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                _send(ctl, {"exited": pid, "code": code, "at": time.time()})
                continue
            msg, fds = _receive(ctl)
            pid = os.fork()
            if pid == 0:
                code = 70
                try:
                    ctl.close()
                    poller.close()
                    for pidfd in children:
                        os.close(pidfd)
                    os.setsid()  # the rank leads its own session, as elastic starts it
                    die_with_parent(server)
                    _fresh_entropy()
                    code = _run_forked(msg, fds, dispositions)
                finally:
                    os._exit(code)
            for passed in fds:
                os.close(passed)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            poller.register(pidfd, select.EPOLLIN)
            _send(ctl, {"forked": pid})


THREAD_GONE_WAIT_S = 30.0
"""How long the fork server waits for its warm-up thread to be gone from the kernel."""


def _thread_gone(tid: int, wait_s: float) -> bool:
    """Wait (bounded) until the thread ``tid`` of this process is gone from the kernel's list.

    ``Thread.join`` returns before the thread has run its native exit path (the thread-local
    destructors of torch, OpenMP and MKL): a fork meanwhile copies whatever lock that path
    holds, and the forked rank can hang in its first op. Threads that libraries keep
    (numpy's OpenBLAS pool) stop themselves at a fork."""
    deadline = time.monotonic() + wait_s
    while os.path.exists(f"/proc/self/task/{tid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _fresh_entropy() -> None:
    """Reseed what a fresh interpreter seeds from the OS (Python's ``random`` reseeds itself
    at a fork): numpy's global generator, so forked ranks do not share one stream."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):  # a broken numpy must not stop the rank
            numpy.random.seed(int.from_bytes(os.urandom(4), "little"))


def _send(ctl: socket.socket, reply: dict[str, float]) -> None:
    try:
        ctl.send(json.dumps(reply).encode())
    except OSError:
        os._exit(0)  # the agent is gone: our ranks follow by their death signal


def main() -> None:
    """Set the death signal, warm up, wait for a rank, become it (or, as the fork server,
    fork one per handoff)."""
    args = _parse(sys.argv[1:])
    die_with_parent(args.agent_pid)
    dispositions = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            dispositions[int(sig)] = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
    sys.path[0] = args.path0
    ctl = socket.socket(fileno=args.ctl_fd)
    warm = threading.Thread(target=_warm_up, args=(args, ctl), name="ftmem-standby-warm-up")
    warm.start()
    if args.fork_server:
        warm.join()
        if warm.native_id is None or not _thread_gone(warm.native_id, THREAD_GONE_WAIT_S):
            sys.stderr.write("ftmem standby: the warm-up thread did not end; exiting\n")
            os._exit(70)  # the agent starts its ranks cold
        _serve_forks(ctl, dispositions)
    msg, fds = _receive(ctl)
    warm.join()
    ctl.close()
    _become_rank(msg, fds, dispositions)


if __name__ == "__main__":
    main()
