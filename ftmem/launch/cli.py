"""The ``ftmem-launch`` command line: torchrun's flags plus an ``ftmem`` group.

Shaped like ``torch.distributed.run``: :func:`get_args_parser`, :func:`config_from_args`,
:func:`run` and a ``@record`` :func:`main`. Every ``--ftmem-*`` flag also reads
``PET_FTMEM_*`` from the environment (torch's ``env`` action), like torchrun's flags.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import traceback
import uuid
from argparse import SUPPRESS, ArgumentParser, Namespace
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

from torch.distributed.argparse_util import check_env, env
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import config_from_args as torchrun_config_from_args
from torch.distributed.run import get_args_parser as torchrun_args_parser
from torch.distributed.run import parse_min_max_nnodes

from ftmem.config import ENV_LOG_LEVEL
from ftmem.errors import UnrecoverableError
from ftmem.launch.config import (
    DEFAULT_MAX_RESTARTS,
    FtmemLaunchConfig,
    check_flush_tiers,
    check_host_address,
    check_mesh_key,
    check_rdzv_backend,
    cli_default,
    cli_knob,
    default_peer_host,
    resolve_names,
)

log = logging.getLogger(__name__)


def get_args_parser() -> ArgumentParser:
    """torchrun's parser with ftmem's defaults and the ``ftmem`` argument group."""
    parser = torchrun_args_parser()
    parser.prog = "ftmem-launch"
    parser.description = (
        "torchrun drop-in that keeps per-step snapshots in memory (the node's SMP) and "
        "restarts every rank from them after a crash, hang, SMP loss or node loss."
    )
    if "PET_MAX_RESTARTS" not in os.environ:
        parser.set_defaults(max_restarts=DEFAULT_MAX_RESTARTS)
    group = parser.add_argument_group("ftmem")

    def option(name: str, help: str, kind: Any = str, default: Any = None, **more: Any) -> None:
        """``--ftmem-NAME``, also read from ``PET_FTMEM_NAME``."""
        group.add_argument(
            f"--ftmem-{name}", action=env, type=kind, default=default, help=help, **more
        )

    def switch(name: str, help: str) -> None:
        """An on/off ``--ftmem-NAME``, also read from ``PET_FTMEM_NAME``."""
        group.add_argument(f"--ftmem-{name}", action=check_env, help=help)

    option(
        "run-dir",
        "This node's SMP run directory (socket, smp.log, events). Default: a new "
        "directory under $XDG_RUNTIME_DIR/ftmem/ (when private) or /tmp/ftmem-<uid>/, "
        "removed after a successful run.",
    )
    option(
        "node",
        "This node's name (FTMEM_NODE, shared-memory names). Default: <hostname>-<pid>.",
    )
    option(
        "hang-timeout",
        "Seconds without progress (ftmem.save / ftmem.heartbeat) after a rank's first "
        "report before it is SIGKILLed and all ranks restart; 0 disables. Default: 120.",
        float,
        cli_default("hang_timeout"),
    )
    option(
        "first-progress-timeout",
        "Seconds from a rank's start to its first report (start-up + load + first "
        "step) before it counts as hung; 0 (default) disables.",
        float,
        cli_default("first_progress_timeout"),
    )
    option(
        "metrics-port",
        "Serve Prometheus metrics of this node at http://ADDR:PORT/metrics (0, the "
        "default: off); needs prometheus_client (pip install 'ftmem[metrics]').",
        int,
        cli_default("metrics_port"),
    )
    option(
        "metrics-addr",
        "The address the metrics server binds (default 127.0.0.1: this host only; the "
        "metrics are unauthenticated, so bind another interface only where every host that "
        "can reach it may read them, e.g. 0.0.0.0 behind a firewall for Prometheus).",
        str,
        cli_default("metrics_addr"),
    )
    option(
        "rejoin-timeout",
        "Seconds a rank kept alive at a restart (it runs under ftmem.run) has to report "
        "progress in the new generation before it is SIGKILLed and cold-started; the rank "
        "itself waits that long plus the rendezvous join timeout for its new generation "
        "(default 120).",
        float,
        cli_default("rejoin_timeout"),
    )
    option(
        "standby",
        "Start ranks warm: the node's fork server, a process that has imported torch "
        "(and --ftmem-tune standby-import) before the first rank starts, forks each rank at the "
        "start and at every restart instead of a cold start (with --ftmem-tune standby-fork=off "
        "or --ftmem-standby-cuda: this many standby ranks per local rank, started once the ranks "
        "are stepping). 0: off. Default: 1.",
        int,
        cli_default("standby"),
    )
    switch(
        "standby-cuda",
        "Standby ranks per local rank instead of the fork server, each of which also "
        "creates the CUDA context of its local rank's device (a context cannot cross a fork).",
    )
    option(
        "ec-parity",
        "Erasure-coding parity m: any m nodes of a group may be lost at once. 'auto' "
        "(default): 1 with at least 3 nodes, else off; 0: off.",
        str,
        "auto",
    )
    option(
        "key-file",
        "The job's CURVE key pair for the SMP peer mesh (`ftmem keygen`, mode 0600, "
        "the same file on every node). Default: one made per job and handed out through "
        "the rendezvous store (a warning is logged).",
    )
    switch(
        "ec-encrypt",
        "Encrypt the snapshot bytes between SMPs too (CURVE for every message). Default: "
        "messages that carry snapshot bytes go over a plain data channel, each with a keyed "
        "BLAKE3 tag that only the job's nodes can make (altered or forged ones are refused), "
        "at a fraction of CURVE's CPU; see docs/security.md.",
    )
    switch(
        "checkfree",
        "Last resort for pipeline-parallel jobs (ftmem.CheckFreeStage in the state): when "
        "a stage's snapshot is gone from memory and the disk tiers, rebuild it from its two "
        "neighbouring stages (CheckFree) instead of stopping; its optimizer state is reset "
        "(docs/api.md, CheckFree).",
    )
    switch(
        "insecure-mesh",
        "Allow erasure coding across hosts without --ftmem-key-file: the mesh's key "
        "pair then travels through the unauthenticated rendezvous store, so whoever can read "
        "that store can join the mesh. Default: refused unless the mesh stays on this host.",
    )
    option(
        "peer-host",
        "Address the SMP's peer port binds and advertises. Default: --local-addr, "
        "else the address of this host's name.",
    )
    option(
        "flush-dir",
        "Node-local directory for checkpoints flushed from memory in the background "
        "(stock torch.distributed.checkpoint format). Default: no flushing.",
    )
    option(
        "flush-persistent-dir",
        "Persistent (shared) directory each flushed checkpoint is copied to after the local one.",
    )
    option(
        "flush-every",
        "Flush every N steps in the background; 0 (default): only on `ftmem flush` and on SIGTERM.",
        int,
        cli_default("flush_every"),
    )
    option(
        "flush-keep",
        "Complete checkpoints kept per tier. Default: 2.",
        int,
        cli_default("flush_keep"),
    )
    option(
        "rank-assignment",
        "stable (default): every node keeps its global ranks across restarts and a "
        "replacement node takes the lost node's, so each rank finds its own snapshot; "
        "elastic: torchrun's numbering (by node order in each round).",
        str,
        cli_default("rank_assignment"),
        choices=("stable", "elastic"),
    )
    for key, (kind, default, choices) in TUNING.items():
        option(key, SUPPRESS, kind, default, choices=choices)
    group.add_argument(
        "--ftmem-tune",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="Set a tuning knob (repeatable; also PET_FTMEM_TUNE, comma-separated): "
        + ", ".join(TUNING)
        + ". Their meanings and defaults: docs/launcher.md, Tuning.",
    )
    return parser


TUNING: dict[str, tuple[type, object, tuple[str, ...] | None]] = {
    "slots": (int, None, None),  # None: as many as the job's tiers and erasure coding need
    **{
        key: cli_knob(key.replace("-", "_"))
        for key in (
            "hash-threads",
            "ec-group-size",
            "ec-interval",
            "ec-encode-workers",
            "flush-writers",
            "flush-direct",
            "rebuild-timeout",
            "smp-start-timeout",
            "no-progress-restarts",
            "status-interval",
            "detect-timeout",
            "smp-log-level",
            "standby-fork",
        )
    },
    "standby-import": cli_knob("standby_imports"),
}
"""The knobs ``--ftmem-tune KEY=VALUE`` sets (type, default, choices; the defaults are
:class:`FtmemLaunchConfig`'s): settings a user should not need to see to run a job. Each is
also a hidden ``--ftmem-KEY`` flag (and ``PET_FTMEM_KEY``); docs/launcher.md, Tuning."""


def apply_tuning(args: Namespace) -> None:
    """Apply ``--ftmem-tune KEY=VALUE`` (and ``PET_FTMEM_TUNE``) to ``args``, each value
    parsed as its knob's flag would parse it; a later setting of a key wins.

    Raises:
        ValueError: an unknown key, a setting without ``=``, or a value the knob refuses.
    """
    settings = list(getattr(args, "ftmem_tune", None) or [])
    if not settings and os.environ.get("PET_FTMEM_TUNE"):
        settings = [x for x in os.environ["PET_FTMEM_TUNE"].split(",") if x.strip()]
    if not settings:
        return
    actions = {a.dest: a for a in get_args_parser()._actions}
    for setting in settings:
        key, sep, value = setting.strip().partition("=")
        if not sep or key not in TUNING:
            raise ValueError(
                f"--ftmem-tune {setting!r}: expected KEY=VALUE with KEY one of {', '.join(TUNING)}"
            )
        action = actions["ftmem_" + key.replace("-", "_")]
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"--ftmem-tune {key}: choose from {', '.join(action.choices)}")
        try:
            parsed = action.type(value) if callable(action.type) else value
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--ftmem-tune {key}: {value!r} is not valid ({exc})") from exc
        setattr(args, action.dest, parsed)


def _seconds(value: float) -> timedelta:
    return timedelta(seconds=float(value))


def _parity(value: str) -> int:
    if str(value).lower() == "auto":
        return -1
    try:
        m = int(value)
    except ValueError as exc:
        raise ValueError(f"--ftmem-ec-parity must be auto or an integer, got {value!r}") from exc
    if m < 0:
        raise ValueError("--ftmem-ec-parity must be auto, 0 (off) or >= 1")
    return m


def _ec_possible(args: Namespace) -> bool:
    """Erasure coding may run: parity not 0 and at least 3 nodes at most (``auto`` needs 3)."""
    max_nodes = str(args.nnodes).split(":")[-1]
    return _parity(args.ftmem_ec_parity) != 0 and max_nodes.isdigit() and int(max_nodes) >= 3


def _slots(args: Namespace) -> int:
    if args.ftmem_slots is not None:
        return int(args.ftmem_slots)
    # The newest committed step and the one being written; +1 pinned while a step flushes;
    # +2 with erasure coding (the protected step and the one a round protects), so that
    # back-to-back rounds never make a rank skip a snapshot (docs/design.md, "Slots").
    flushing = bool(args.ftmem_flush_dir or args.ftmem_flush_persistent_dir)
    return 2 + int(flushing) + 2 * int(_ec_possible(args))


def ftmem_config_from_args(args: Namespace) -> FtmemLaunchConfig:
    """Build the ftmem part of the configuration from parsed arguments.

    Raises:
        ValueError: a setting is out of range, or erasure coding could span hosts without a
            key file (:func:`~ftmem.launch.config.check_mesh_key`).
    """
    apply_tuning(args)
    config = FtmemLaunchConfig(
        run_dir=Path(args.ftmem_run_dir) if args.ftmem_run_dir else None,
        node=args.ftmem_node or None,
        slots=_slots(args),
        ec_parity=_parity(args.ftmem_ec_parity),
        ec_group_size=int(args.ftmem_ec_group_size),
        ec_interval=_seconds(args.ftmem_ec_interval),
        key_file=Path(args.ftmem_key_file) if args.ftmem_key_file else None,
        insecure_mesh=bool(args.ftmem_insecure_mesh),
        ec_encrypt=bool(args.ftmem_ec_encrypt),
        ec_encode_workers=int(args.ftmem_ec_encode_workers),
        checkfree=bool(args.ftmem_checkfree),
        peer_host=args.ftmem_peer_host or default_peer_host(args.local_addr),
        rebuild_timeout=_seconds(args.ftmem_rebuild_timeout),
        flush_dir=Path(args.ftmem_flush_dir) if args.ftmem_flush_dir else None,
        flush_persistent_dir=(
            Path(args.ftmem_flush_persistent_dir) if args.ftmem_flush_persistent_dir else None
        ),
        flush_every=int(args.ftmem_flush_every),
        flush_keep=int(args.ftmem_flush_keep),
        flush_writers=int(args.ftmem_flush_writers),
        flush_direct=str(args.ftmem_flush_direct) == "on",
        hash_threads=int(args.ftmem_hash_threads),
        standby=int(args.ftmem_standby),
        standby_imports=tuple(n.strip() for n in args.ftmem_standby_import.split(",") if n.strip()),
        standby_cuda=bool(args.ftmem_standby_cuda),
        standby_fork=str(args.ftmem_standby_fork) == "on",
        smp_start_timeout=_seconds(args.ftmem_smp_start_timeout),
        hang_timeout=_seconds(args.ftmem_hang_timeout),
        first_progress_timeout=_seconds(args.ftmem_first_progress_timeout),
        rejoin_timeout=_seconds(args.ftmem_rejoin_timeout),
        metrics_port=int(args.ftmem_metrics_port),
        metrics_addr=str(args.ftmem_metrics_addr),
        status_interval=_seconds(args.ftmem_status_interval),
        detect_timeout=_seconds(args.ftmem_detect_timeout),
        no_progress_restarts=int(args.ftmem_no_progress_restarts),
        smp_log_level=str(args.ftmem_smp_log_level),
        rank_assignment=str(args.ftmem_rank_assignment),
    )
    check_mesh_key(
        ec_possible=_ec_possible(args),
        key_file=config.key_file,
        insecure=config.insecure_mesh,
        peer_host=config.peer_host,
        rdzv_host=_rdzv_host(args),
    )
    return config


def preflight(args: Namespace) -> None:
    """Checks before anything starts: the backend can restart ranks and, with several nodes,
    gloo gets a reachable address (:func:`~ftmem.launch.config.check_rdzv_backend`,
    :func:`~ftmem.launch.config.check_host_address`).

    Raises:
        ValueError: a check failed (the message names the fix).
    """
    check_rdzv_backend(str(args.rdzv_backend))
    _, max_nodes = parse_min_max_nnodes(str(args.nnodes))
    set_env = check_host_address(
        max_nodes=max_nodes, rdzv_host=_rdzv_host(args), local_addr=args.local_addr
    )
    if set_env:
        log.info("ranks' gloo groups bind to --local-addr's interface: %s", set_env)


def _rdzv_host(args: Namespace) -> str:
    """The rendezvous store's host: ``--rdzv-endpoint``'s, else ``--master-addr`` (static)."""
    endpoint = str(args.rdzv_endpoint or "").split(",")[0].strip()  # etcd-v3: first member
    if not endpoint:
        return str(args.master_addr or "127.0.0.1")
    return endpoint.rsplit(":", 1)[0] if ":" in endpoint.strip("[]") else endpoint


def config_from_args(
    args: Namespace,
) -> tuple[LaunchConfig, FtmemLaunchConfig, Callable[..., Any] | str, list[str]]:
    """torchrun's ``config_from_args`` plus the ftmem configuration."""
    ftmem = ftmem_config_from_args(args)
    resolve_names(ftmem, args.rdzv_id)
    assert ftmem.run_dir is not None
    # Rank output goes to the console *and* to files (torchrun: console only), so that the
    # final report can quote the failing rank's last lines; an explicit choice wins.
    if str(args.tee) == "0" and str(args.redirects) == "0":
        args.tee = "3"
    if args.log_dir is None:
        # torch creates the log dir at once; create the run dir first, private (0700).
        ftmem.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        args.log_dir = str(ftmem.run_dir / "logs")
    config, cmd, cmd_args = torchrun_config_from_args(args)
    return config, ftmem, cmd, cmd_args


def apply_standalone(args: Namespace) -> None:
    """torchrun's ``--standalone`` and single-node defaults (as in ``torch.distributed.run.run``),
    except that an ``--rdzv-id`` given with ``--standalone`` is kept (torchrun replaces it by
    a random one): it names the run, and ``ftmem status --run-id`` finds the job by it."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        if args.rdzv_id in (None, "", "none"):
            args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig.name}", sigval=sig)


def install_signal_handlers(names: str) -> None:
    """Turn the termination signals into ``SignalException`` from the start.

    elastic installs the same handlers only when the first ranks start; installing them
    now lets a signal during the SMP start or the rendezvous still clean up.
    """
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if isinstance(sig, signal.Signals):
            signal.signal(sig, _raise_signal)


def configure_logging() -> None:
    """Log the launcher's events to stderr (level from FTMEM_LOG_LEVEL, default INFO)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ftmem")
    if not logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(os.environ.get(ENV_LOG_LEVEL, "INFO").upper())
    logger.propagate = False


def run(args: Namespace) -> dict[int, Any]:
    """Run the agent described by parsed ``args`` on this node."""
    from ftmem.launch.launch import launch_agent

    apply_standalone(args)
    install_signal_handlers(args.signals_to_handle)
    try:
        config, ftmem, cmd, cmd_args = config_from_args(args)
        preflight(args)
        check_flush_tiers(ftmem.flush_tiers())
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return launch_agent(config, ftmem, cmd, cmd_args)


class UsageError(Exception):
    """The flags describe no valid run (the message says which and how to fix it)."""


@record
def main(args: list[str] | None = None) -> None:
    """Entry point of the ``ftmem-launch`` console script."""
    configure_logging()
    try:
        run(get_args_parser().parse_args(args))
    except UnrecoverableError as exc:
        log.error("ftmem-launch: UNRECOVERABLE: %s", exc)
        sys.exit(3)
    except UsageError as exc:
        log.error("ftmem-launch: %s", exc)
        sys.exit(2)
    except SignalException:
        # As torchrun: the traceback and exit code 1. But not through the interpreter's
        # shutdown: the agent's daemon threads may still be writing to stderr, and an
        # interpreter that finalizes while one of them holds stderr's lock aborts (SIGABRT).
        traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(1)
    finally:
        # What is left is torch's and elastic's heap: collecting it at exit is wasted CPU.
        gc.freeze()


if __name__ == "__main__":
    main()
