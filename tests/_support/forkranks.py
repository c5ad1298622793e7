"""Start the ranks of a test run from a process that imported torch once (a zygote).

A zygote imports torch, ``torch._dynamo`` (a first optimizer imports it), ``torch.distributed``
and DCP (about 4 CPU-s on the test machine, paid once instead of once per rank), then forks
one child per rank. Each child takes its rank's environment, sends its stdout and stderr to
its log and runs the script as ``python script.py args`` would (``runpy``, ``__main__``,
``sys.argv``, ``sys.path[0]``), then exits as a cold process does (atexit handlers,
non-daemon threads). The children stay in the zygote's process group: killing that group
stops every rank. The zygote waits for every child and writes ``{"codes": [...]}`` (exit
codes as ``Popen`` gives them: negative for a signal) to the spec's ``result`` path.

``python forkranks.py --serve LISTEN_FD LIFELINE_FD`` (:func:`tests._support.ranks.run_ranks`
keeps one per test process) imports once, then for each connection on the listening Unix
socket forks a zygote in a session of its own. The zygote reads the spec's path (a line),
answers its pid (a line), does the run with its stdout and stderr in the spec's ``log`` and
exits: the connection's end of file says the run is over (whether it ended or was killed).
The server exits at end of file on the lifeline pipe (its test process closed it, or died).

ftmem is not imported before a fork: its modules must see each rank's environment when they
load. Nothing but the imports runs in a server, so each zygote is as fresh as a cold one.

The spec (a JSON file): ``{"script": path, "args": [...], "ranks": [{"env": {...}, "log": path}],
"result": path, "log": path}``, or ``"code"`` (Python source, run as ``python -c`` runs it)
instead of ``"script"``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys


def _child(
    script: str | None, code: str | None, args: list[str], env: dict[str, str], log: str
) -> None:
    """Become one rank running ``script`` (or ``code``, as ``python -c`` would); never
    returns (SystemExit ends the interpreter as a cold run's)."""
    import runpy
    import traceback

    _to_log(log)
    os.environ.clear()
    os.environ.update(env)
    try:
        if script is not None:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            exec(compile(code or "", "<string>", "exec"), {"__name__": "__main__"})
        status: object = 0
    except SystemExit as exc:
        status = exc.code
    except BaseException:
        traceback.print_exc()
        status = 1
    raise SystemExit(status)


def _to_log(log: str) -> None:
    """Send this process's stdout and stderr to ``log`` (truncated)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _import() -> None:
    import torch
    import torch._dynamo
    import torch.distributed
    import torch.distributed.checkpoint  # noqa: F401


def _run(spec_path: str, conn: socket.socket) -> None:
    """Fork the ranks of the run ``spec_path`` describes, wait for each, write the codes
    (``conn``: the zygote's connection, closed in each rank)."""
    with open(spec_path) as f:
        spec = json.load(f)
    pids = []
    for rank in spec["ranks"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(spec.get("script"), spec.get("code"), spec["args"], rank["env"], rank["log"])
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(spec["result"], "w") as f:
        json.dump({"codes": codes}, f)


def _zygote(conn: socket.socket) -> None:
    """A connection's zygote (forked by :func:`serve`): one run, then exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (the server's SIG_IGN would reap ranks)
    os.setsid()
    me, status = os.getpid(), 1
    try:
        conn.settimeout(30)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(4096)
            if not chunk:
                return
            line += chunk
        spec_path = line.decode().strip()
        with open(spec_path) as f:
            log = json.load(f)["log"]
        _to_log(log)
        conn.sendall(f"{os.getpid()}\n".encode())
        _run(spec_path, conn)
        status = 0
    except BaseException:
        if os.getpid() != me:
            raise  # a rank ends as a cold process does (its SystemExit)
        import traceback

        traceback.print_exc()
    finally:
        if os.getpid() == me:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)


def serve(listen_fd: int, lifeline_fd: int) -> int:
    """Import once, then fork a zygote per connection until the lifeline closes."""
    _import()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the zygotes are reaped as they exit
    listener = socket.socket(fileno=listen_fd)
    while True:
        ready, _, _ = select.select([listener.fileno(), lifeline_fd], [], [])
        if lifeline_fd in ready:  # nobody writes to it: readable means end of file
            return 0
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            os.close(lifeline_fd)
            _zygote(conn)
        conn.close()


def main() -> int:
    if sys.argv[1:2] != ["--serve"]:
        sys.exit("usage: forkranks.py --serve LISTEN_FD LIFELINE_FD")
    return serve(int(sys.argv[2]), int(sys.argv[3]))


if __name__ == "__main__":
    raise SystemExit(main())
