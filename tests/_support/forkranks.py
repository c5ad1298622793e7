"""Start the ranks of one test run from one process that imported torch once (a zygote).

``python forkranks.py SPEC.json`` imports torch, ``torch.distributed`` and DCP (about 3 CPU-s
on the test machine, paid once instead of once per rank), then forks one child per rank.
Each child takes its rank's environment, sends its stdout and stderr to its log and runs the
script as ``python script.py args`` would (``runpy``, ``__main__``, ``sys.argv``,
``sys.path[0]``), then exits as a cold process does (atexit handlers, non-daemon threads).
The children stay in the zygote's process group: killing that group stops every rank.

The zygote waits for every child and writes ``{"codes": [...]}`` (exit codes as ``Popen``
gives them: negative for a signal) to ``SPEC.json``'s ``result`` path, then exits 0.
ftmem is not imported here: its modules must see each rank's environment when they load.

SPEC.json: ``{"script": path, "args": [...], "ranks": [{"env": {...}, "log": path}],
"result": path}``, or ``"code"`` (Python source, run as ``python -c`` runs it) instead of
``"script"``.
"""

from __future__ import annotations

import json
import os
import sys


def _child(
    script: str | None, code: str | None, args: list[str], env: dict[str, str], log: str
) -> None:
    """Become one rank running ``script`` (or ``code``, as ``python -c`` would); never
    returns (SystemExit ends the interpreter as a cold run's)."""
    import runpy
    import traceback

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
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


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import torch
    import torch.distributed
    import torch.distributed.checkpoint  # noqa: F401

    pids = []
    for rank in spec["ranks"]:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(spec.get("script"), spec.get("code"), spec["args"], rank["env"], rank["log"])
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(spec["result"], "w") as f:
        json.dump({"codes": codes}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
