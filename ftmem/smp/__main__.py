"""``python -m ftmem.smp``: run one node's snapshot management process.

Start it by hand beside plain torchrun::

    python -m ftmem.smp --run-dir /tmp/ftmem-demo &
    FTMEM_RUN_DIR=/tmp/ftmem-demo torchrun --nproc-per-node 2 examples/train_gpt.py

It prints ``READY {...}`` on stdout (or on ``--ready-fd``) once it serves, and on SIGTERM
or SIGINT removes its shared memory and exits 0.
"""

from __future__ import annotations

import signal
from types import FrameType

_EARLY_STOP: list[int] = []
"""SIGTERM/SIGINT received before the daemon's own handlers, honoured once it serves (killed
by the default action, an SMP a restart had just started would leave its predecessor's slot
files behind)."""


def _early(signum: int, frame: FrameType | None) -> None:
    _EARLY_STOP.append(signum)


if __name__ == "__main__":  # (not when imported for its parser)
    signal.signal(signal.SIGTERM, _early)
    signal.signal(signal.SIGINT, _early)
    # start_smp starts us with both blocked (a stop then waits for these handlers): unblock.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})

import argparse  # noqa: E402 (after the handlers, on purpose)
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from ftmem import typed_json  # noqa: E402
from ftmem._logging import configure, get_logger  # noqa: E402
from ftmem.config import ENV_NODE, SmpConfig, default_run_dir, default_run_id  # noqa: E402
from ftmem.errors import FtmemError, ProtocolError, SmpStartError  # noqa: E402
from ftmem.secure_fs import read_private_file  # noqa: E402
from ftmem.smp.daemon import SmpDaemon  # noqa: E402

log = get_logger("ftmem.smp")


_FLAGS: list[tuple[str, Any, str]] = [
    (
        "--settings",
        Path,
        "a JSON file of this user's (mode 0600) holding the settings below by their "
        "SmpConfig names (what ftmem-launch writes); a flag given beside it wins",
    ),
    (
        "--run-dir",
        Path,
        "run directory (0700) holding smp.sock; default $FTMEM_RUN_DIR or /tmp/ftmem-<uid>/<run-id>",
    ),
    ("--run-id", None, "run id (default $FTMEM_RUN_ID, $TORCHELASTIC_RUN_ID or 'default')"),
    ("--node", None, "node name (default $FTMEM_NODE or node0)"),
    ("--slots", int, "snapshot slots per rank (>= 2)"),
    (
        "--hash-threads",
        int,
        "threads that checksum committed snapshots (default 0: half the cores, at most 8)",
    ),
    ("--ready-fd", int, "write 'READY {json}' to this inherited fd when serving (else to stdout)"),
    ("--parent-pid", int, "exit when this pid is gone"),
    ("--max-message-bytes", int, "largest request accepted"),
    (
        "--shm-dir",
        Path,
        "this user's private directory (made 0700, on a tmpfs) for the slot files; "
        "default $FTMEM_SHM_DIR or /dev/shm/ftmem-<uid>",
    ),
    ("--poll-interval", float, "seconds between housekeeping checks"),
    (
        "--no-adopt",
        "store_true",
        "discard (instead of serving again) committed slots a killed SMP left behind",
    ),
    (
        "--flush-dir",
        "append",
        "disk tier to flush checkpoints to (DCP format); give it twice for node-local "
        "then persistent storage",
    ),
    (
        "--flush-shared-dir",
        Path,
        "persistent disk tier every node sees, written last; in a multi-node run the "
        "node of rank 0 assembles the nodes' parts there into one DCP checkpoint",
    ),
    (
        "--flush-every",
        int,
        "flush every N steps in the background (0: only when `ftmem flush` asks)",
    ),
    ("--flush-keep", int, "complete checkpoints kept per tier"),
    ("--flush-writers", int, "data files written in parallel per flush"),
    (
        "--flush-buffered",
        "store_true",
        "write through the page cache (default: O_DIRECT where the file system allows it)",
    ),
    (
        "--flush-on-stop",
        float,
        "seconds allowed for a final flush on SIGTERM (when --flush-dir is set)",
    ),
    ("--log-level", None, "DEBUG, INFO (default), WARNING"),
]
"""The SMP's flags in --help order: (flag, its type or action, help); a typed flag's default
is None (unset: the settings file or SmpConfig decides), ``append`` collects paths."""


def get_args_parser() -> argparse.ArgumentParser:
    """Return the SMP's argument parser."""
    p = argparse.ArgumentParser(prog="python -m ftmem.smp", description=__doc__.split("\n")[0])
    for flag, kind, text in _FLAGS:
        if kind == "store_true":
            p.add_argument(flag, action=kind, help=text)
        elif kind == "append":
            p.add_argument(flag, type=Path, action=kind, default=[], help=text)
        else:
            p.add_argument(flag, type=kind, default=None, help=text)
    return p


def config_from_args(args: argparse.Namespace) -> SmpConfig:
    """Build an SmpConfig from ``--settings`` (if given) and the flags (a flag wins); what
    neither sets takes the environment's run id, node and run directory, then the defaults.

    Raises:
        ValueError: a setting SmpConfig refuses.
        ProtocolError: a settings file that is not JSON or not SmpConfig's fields.
        UnsafePathError: a settings file that is not this user's alone.
    """
    doc: dict[str, Any] = {}
    if args.settings is not None:
        text = read_private_file(args.settings.absolute(), "SMP settings file")
        doc = typed_json.loads(text, f"SMP settings file {args.settings}")
        if type(doc) is not dict:
            raise ProtocolError(f"SMP settings file {args.settings}: not a JSON object")
    tiers = [*args.flush_dir, *filter(None, [args.flush_shared_dir])]
    flags = {
        "run_dir": args.run_dir and str(args.run_dir.absolute()),
        "run_id": args.run_id,
        "node": args.node,
        "slots": args.slots,
        "hash_threads": args.hash_threads,
        "max_message_bytes": args.max_message_bytes,
        "shm_dir": args.shm_dir and str(args.shm_dir.absolute()),
        "parent_pid": args.parent_pid,
        "poll_interval": args.poll_interval,
        "adopt": False if args.no_adopt else None,
        "flush_tiers": [str(d.absolute()) for d in tiers] or None,
        "flush_shared": True if args.flush_shared_dir is not None else None,
        "flush_every": args.flush_every,
        "flush_keep": args.flush_keep,
        "flush_writers": args.flush_writers,
        "flush_direct": False if args.flush_buffered else None,
        "flush_on_stop": args.flush_on_stop,
    }
    doc.update((k, v) for k, v in flags.items() if v is not None)
    doc.setdefault("run_id", default_run_id())
    doc.setdefault("node", os.environ.get(ENV_NODE) or "node0")
    if "run_dir" not in doc and isinstance(doc["run_id"], str):
        doc["run_dir"] = str(default_run_dir(doc["run_id"]).absolute())
    config: SmpConfig = typed_json.build(SmpConfig, doc, what="SMP settings")
    return config


def raise_nofile() -> int:
    """Raise this process's soft limit of open files to its hard limit (at most 2**20), so
    connections held open to the peer ports do not exhaust it; the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", want, exc)
    return soft


def main(argv: list[str] | None = None) -> int:
    """Run the SMP until SIGTERM/SIGINT (or its parent's death); return the exit code."""
    args = get_args_parser().parse_args(argv)
    configure(args.log_level)
    raise_nofile()
    try:
        config = config_from_args(args)
    except (ValueError, FtmemError) as exc:
        print(f"ftmem.smp: {exc}", file=sys.stderr)
        return 2
    daemon = SmpDaemon(config)
    daemon.install_signal_handlers()
    if _EARLY_STOP:  # start anyway (adopting what a predecessor left), then stop cleanly
        log.warning("stop requested (signal %d) while starting", _EARLY_STOP[0])
        daemon.request_stop(_EARLY_STOP[0])
    try:
        daemon.start()
    except (SmpStartError, OSError) as exc:
        log.error("cannot start: %s", exc)
        daemon.close()
        return 1
    try:
        line = daemon.ready_line()
        if args.ready_fd is not None:
            os.write(args.ready_fd, line.encode())
            os.close(args.ready_fd)
        else:
            sys.stdout.write(line)
            sys.stdout.flush()
        daemon.serve_forever()
    finally:
        daemon.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
