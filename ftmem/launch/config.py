"""Settings of ``ftmem-launch``: the ``--ftmem-*`` options and the safe elastic defaults.

torchrun's own settings stay in ``torch.distributed.launcher.api.LaunchConfig``; this module
holds what ftmem adds (:class:`FtmemLaunchConfig`) and the defaults where torch's break
restarts (see :func:`apply_safe_rdzv_defaults` and docs/launcher.md).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ftmem.config import ENV_AGENT_PID as ENV_AGENT_PID  # re-exported: workers.py
from ftmem.config import MAX_SOCKET_PATH, SOCKET_NAME, SmpConfig, default_run_dir, field_default
from ftmem.exchange.encode_worker import MAX_WORKERS

# torch's switch for the shared rendezvous TCPStore; "1" gives each generation its own store.
ENV_DISABLE_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

SAFE_RDZV_DEFAULTS: dict[str, Any] = {
    # torch waits 600 s for a replacement node; ftmem bounds it (override with --rdzv-conf).
    "join_timeout": 300,
    # Dead node noticed after keep_alive_interval * keep_alive_max_attempt = 5 s (torch: 15 s).
    # max_attempt must stay >= 3: a heartbeat is skipped when the last one is younger than
    # the interval, so 2 attempts declared live nodes dead and split the job in two.
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
}

DEFAULT_MAX_RESTARTS = 10
"""torchrun's default is 0, which would make a fault-tolerance launcher give up at once."""

_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name(value: str, limit: int = 64) -> str:
    """Return ``value`` made safe for ftmem names (``[A-Za-z0-9_.-]{1,64}``)."""
    cleaned = _NAME_RE.sub("_", value)[:limit]
    return cleaned or "default"


def default_node_name() -> str:
    """Return a node name unique on this host: ``<hostname>-<agent pid>``."""
    host = socket.gethostname().split(".")[0]
    return safe_name(f"{safe_name(host, 40)}-{os.getpid()}")


@dataclass(kw_only=True, slots=True)
class FtmemLaunchConfig:
    """What ``ftmem-launch`` adds to torchrun's LaunchConfig (the ``--ftmem-*`` flags)."""

    run_dir: Path | None = None
    """The node's SMP run directory (ipc socket, logs); None: a fresh one under /tmp."""
    node: str | None = None
    """This node's name (FTMEM_NODE, shared-memory names); None: ``<hostname>-<pid>``."""
    slots: int = field_default(SmpConfig, "slots")
    """Snapshot slots per rank that the SMP keeps (>= 2)."""
    smp_start_timeout: timedelta = timedelta(seconds=60)
    """Deadline for the SMP's readiness handshake."""
    smp_stop_timeout: timedelta = timedelta(seconds=10)
    """How long the SMP may take to exit after SIGTERM before it is SIGKILLed."""
    hang_timeout: timedelta = timedelta(seconds=120)
    """A rank that reported progress and then none for this long is SIGKILLed; 0 disables."""
    first_progress_timeout: timedelta = timedelta(0)
    """A rank that never reports progress this long after its start is SIGKILLed; 0 disables."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off); needs ``prometheus_client``."""
    metrics_addr: str = "127.0.0.1"
    """The address the metrics server binds."""
    rejoin_timeout: timedelta = timedelta(seconds=120)
    """A rank kept alive at a restart (``ftmem.run``) without progress in the new generation
    this long after it was handed it is SIGKILLed (and so cold-started)."""
    status_interval: timedelta = timedelta(seconds=1)
    """How often the monitor asks the SMP for each rank's progress."""
    detect_timeout: timedelta = timedelta(seconds=1)
    """The failure detector suspects a node after this long without its heartbeat (declared
    lost once another neighbour agrees); 0: off, elastic's rendezvous keep-alive alone."""
    restart_last_call: timedelta | None = timedelta(seconds=1)
    """The rendezvous' last call at a re-join after a machine loss (a job below its maximum
    size goes on with the survivors that soon); None: ``--rdzv-conf last_call_timeout``'s."""
    no_progress_restarts: int = 3
    """Stop after this many restarts in a row without a newer committed step; 0 disables."""
    smp_log_level: str = "INFO"
    """Log level passed to the SMP (its log goes to ``<run_dir>/smp.log``)."""
    rank_assignment: str = "stable"
    """``stable``: every node keeps its global ranks across rounds (a replacement takes the
    lost node's); ``elastic``: elastic's numbering."""
    auto_run_dir: bool = False
    """The run directory was made up by ftmem-launch: removed after a successful run."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the SMP (tests)."""
    ec_parity: int = -1
    """Erasure-coding parity m across nodes; -1 (auto): 1 with >= 3 nodes, else off; 0: off."""
    ec_group_size: int = 8
    """Cap on the nodes per erasure-coding group."""
    ec_interval: timedelta = timedelta(0)
    """Least time between two protection rounds (0: protect as often as the SMPs can)."""
    key_file: Path | None = None
    """The job's CURVE key file (``ftmem keygen``); None: one per job via the rendezvous store."""
    insecure_mesh: bool = False
    """Allow erasure coding across hosts without a key file (``--ftmem-insecure-mesh``)."""
    ec_encrypt: bool = False
    """Snapshot bytes between SMPs over CURVE too; else the plain data channel, keyed tags."""
    ec_encode_workers: int = 0
    """Processes per SMP that encode its stripes; 0: the SMP's protection thread encodes."""
    checkfree: bool = False
    """Rebuild a pipeline stage without any snapshot from its neighbours (the ranks get
    FTMEM_CHECKFREE=1; a sync that finds more than m nodes lost goes on)."""
    peer_host: str = ""
    """Address the SMP's peer port binds and advertises; "": --local-addr or this host's."""
    rebuild_timeout: timedelta = timedelta(seconds=600)
    """Longest wait for the peers' sync and this node's rebuild before its ranks start."""
    flush_dir: Path | None = None
    """Node-local disk tier (DCP checkpoints); None: no flushing."""
    flush_persistent_dir: Path | None = None
    """Persistent (shared) disk tier, written after the local one."""
    flush_every: int = 0
    """Flush every this many steps in the background (0: only on ``ftmem flush``/SIGTERM)."""
    flush_keep: int = field_default(SmpConfig, "flush_keep")
    """Complete checkpoints kept per tier."""
    flush_writers: int = field_default(SmpConfig, "flush_writers")
    """Data files a flush writes in parallel."""
    flush_direct: bool = field_default(SmpConfig, "flush_direct")
    """A flush writes with O_DIRECT where the file system allows it."""
    flush_on_stop: timedelta = field_default(SmpConfig, "flush_on_stop")  # noqa: RUF009 (immutable)
    """On SIGTERM, time the SMP has for a final flush of the newest step."""
    hash_threads: int = field_default(SmpConfig, "hash_threads")
    """Threads of the SMP that checksum committed snapshots."""
    standby: int = 1
    """Warm starts (0: cold only): with ``standby_fork`` the node's one fork server, else
    this many standby ranks per local rank."""
    standby_fork: bool = True
    """Ranks are forked by the node's fork server at every start. Off (and implied off by
    ``standby_cuda``: a CUDA context cannot cross a fork): standby ranks, each a process that
    takes over one rank (for a script whose imports start threads, which a fork cannot copy)."""
    standby_imports: tuple[str, ...] = ()
    """Modules a standby imports besides torch and ftmem's client."""
    standby_cuda: bool = False
    """A standby also creates the CUDA context of its local rank's device."""

    def flush_tiers(self) -> list[Path]:
        """The disk tiers, nearest first."""
        return [Path(p).absolute() for p in (self.flush_dir, self.flush_persistent_dir) if p]

    def smp_settings(self) -> dict[str, Any]:
        """The SMP's settings this config sets (SmpConfig's fields, JSON-ready) beyond the
        run directory, run id, node and slots, which its runner adds."""
        out: dict[str, Any] = {"hash_threads": self.hash_threads}
        if self.flush_tiers():
            out |= {
                "flush_tiers": [str(t) for t in self.flush_tiers()],
                "flush_shared": self.flush_persistent_dir is not None,
                "flush_every": self.flush_every,
                "flush_keep": self.flush_keep,
                "flush_writers": self.flush_writers,
                "flush_direct": self.flush_direct,
                "flush_on_stop": self.flush_on_stop.total_seconds(),
            }
        return out

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ValueError(f"--ftmem-tune slots must be >= 2, got {self.slots}")
        if not 0 <= self.hash_threads <= 64:
            raise ValueError(
                f"--ftmem-tune hash-threads must be in [0, 64], got {self.hash_threads}"
            )
        if not 0 <= self.standby <= 4:
            raise ValueError(f"--ftmem-standby must be in [0, 4], got {self.standby}")
        for name in self.standby_imports:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
                raise ValueError(f"--ftmem-tune standby-import: {name!r} is not a module name")
        for name in ("smp_start_timeout", "smp_stop_timeout", "status_interval"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be > 0")
        for name in ("hang_timeout", "first_progress_timeout", "detect_timeout"):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"{name} must be >= 0 (0 disables it)")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--ftmem-metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_port:
            try:
                import prometheus_client  # noqa: F401
            except ImportError:
                raise ValueError(
                    "--ftmem-metrics-port needs prometheus_client: pip install 'ftmem[metrics]'"
                ) from None
        if self.rejoin_timeout <= timedelta(0):
            raise ValueError("--ftmem-rejoin-timeout must be > 0")
        if self.rank_assignment not in ("stable", "elastic"):
            raise ValueError("--ftmem-rank-assignment must be 'stable' or 'elastic'")
        if self.no_progress_restarts < 0:
            raise ValueError("--ftmem-tune no-progress-restarts must be >= 0")
        if self.ec_parity < -1:
            raise ValueError("--ftmem-ec-parity must be auto, 0 (off) or >= 1")
        if self.ec_group_size < 3:
            raise ValueError("--ftmem-tune ec-group-size must be >= 3")
        if not 0 <= self.ec_encode_workers <= MAX_WORKERS:
            raise ValueError(
                f"--ftmem-tune ec-encode-workers must be 0..{MAX_WORKERS}, "
                f"got {self.ec_encode_workers}"
            )
        if self.flush_every < 0 or self.flush_keep < 1 or self.flush_writers < 1:
            raise ValueError(
                "--ftmem-flush-every must be >= 0, --ftmem-flush-keep and "
                "--ftmem-tune flush-writers >= 1"
            )
        if self.key_file is not None and not Path(self.key_file).is_file():
            raise ValueError(f"--ftmem-key-file {self.key_file} does not exist (`ftmem keygen`)")
        if self.node is not None and safe_name(self.node) != self.node:
            raise ValueError(f"--ftmem-node {self.node!r} must match [A-Za-z0-9_.-]{{1,64}}")
        if self.run_dir is not None:
            sock = len(str(Path(self.run_dir).absolute())) + 1 + len(SOCKET_NAME)
            if sock > MAX_SOCKET_PATH:
                raise ValueError(
                    f"--ftmem-run-dir {self.run_dir} is too long for an ipc socket path "
                    f"({sock} > {MAX_SOCKET_PATH} characters); choose a shorter one"
                )


def cli_default(name: str) -> Any:
    """The command-line form of :class:`FtmemLaunchConfig`'s default for ``name``: seconds
    for a duration, ``on``/``off`` for a switch, comma-separated for a list."""
    value = field_default(FtmemLaunchConfig, name)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(value)
    return value


def cli_knob(name: str) -> tuple[type, object, tuple[str, ...] | None]:
    """A tuning knob's (type, default, choices) on the command line, from the field."""
    value = cli_default(name)
    if isinstance(field_default(FtmemLaunchConfig, name), bool):
        return str, value, ("on", "off")
    return type(value), value, None


def apply_safe_rdzv_defaults(rdzv_configs: dict[str, Any]) -> dict[str, Any]:
    """Fill in ftmem's rendezvous defaults for every key the user did not set.

    Returns the keys that were filled in (for the start-up log).
    """
    filled = {k: v for k, v in SAFE_RDZV_DEFAULTS.items() if k not in rdzv_configs}
    rdzv_configs.update(filled)
    attempts = int(rdzv_configs.get("keep_alive_max_attempt", 3))
    if attempts < 3:
        raise ValueError(
            f"keep_alive_max_attempt={attempts} splits the job on a skipped heartbeat; use >= 3"
        )
    return filled


def apply_safe_env_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Give each rendezvous round its own TCPStore unless the user chose otherwise (torch's
    shared store hands the previous generation's keys to restarted ranks: cascaded restarts,
    hangs in init_process_group). Returns the variables that were set."""
    env = os.environ if environ is None else environ
    if ENV_DISABLE_SHARED_STORE not in env:
        env[ENV_DISABLE_SHARED_STORE] = "1"
        return {ENV_DISABLE_SHARED_STORE: "1"}
    return {}


def default_peer_host(local_addr: str | None) -> str:
    """The address peers reach this node's SMP at: ``--local-addr``, else this host's name's."""
    if local_addr:
        return local_addr
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True if ``host`` (an address or a name; ``[v6]`` brackets allowed) is this machine's
    loopback: then nothing but this host can reach what listens there."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except (OSError, ValueError):
            return False


def check_mesh_key(
    *, ec_possible: bool, key_file: Path | None, insecure: bool, peer_host: str, rdzv_host: str
) -> None:
    """Refuse erasure coding across hosts without a key file.

    Without ``--ftmem-key-file`` the agents share the mesh's key pair through a private file
    of this host (``ftmem.launch.job_key.host_key_path``): the mesh must stay on this host.
    Across hosts the only other way is the unauthenticated rendezvous store, which needs
    ``--ftmem-insecure-mesh``.

    Raises:
        ValueError: erasure coding may span hosts, with neither a key file nor the flag.
    """
    if not ec_possible or key_file is not None or insecure:
        return
    if is_loopback(peer_host) and is_loopback(rdzv_host):
        return
    raise ValueError(
        "erasure coding across hosts needs the job's key file: run `ftmem keygen FILE` once, "
        "copy FILE (mode 0600) to every node and pass --ftmem-key-file FILE; without it the "
        "mesh's key would travel through the unauthenticated rendezvous store "
        f"(peer host {peer_host}, rendezvous host {rdzv_host or '?'}). "
        "--ftmem-insecure-mesh accepts that risk, or --ftmem-ec-parity 0 turns erasure coding off"
    )


def check_flush_tiers(tiers: list[Path]) -> None:
    """Refuse, before any rank starts, a disk tier that ftmem could not trust when it reads
    it back (``ftmem.tiers.checkpoints.check_tier``), and a node-local (first) tier whose
    parents someone else could rename (``check_tier_parents``). A missing one is made private
    when first written.

    Raises:
        ValueError: naming the directory and the fix.
    """
    from ftmem.errors import UnsafePathError
    from ftmem.tiers.checkpoints import check_tier, check_tier_parents

    for i, tier in enumerate(tiers):
        try:
            if i == 0:  # the node-local tier: nobody else may be able to move it away
                check_tier_parents(tier)
            if os.path.lexists(tier):
                check_tier(tier)
        except UnsafePathError as exc:
            raise ValueError(f"--ftmem-flush-dir: {exc}") from exc


def resolve_names(config: FtmemLaunchConfig, run_id: str) -> None:
    """Fill in the node name and the run directory if the user gave none."""
    if config.node is None:
        config.node = default_node_name()
    if config.run_dir is None:
        config.run_dir = default_run_dir(safe_name(run_id), config.node)
        config.auto_run_dir = True


def check_rdzv_backend(backend: str) -> None:
    """Refuse ``--rdzv-backend static`` (it cannot restart ranks nor admit a spare).

    Raises:
        ValueError: the backend is ``static``.
    """
    if backend == "static":
        raise ValueError(
            "--rdzv-backend static cannot restart ranks (the agent's store and rank 0 both "
            "bind --master-port, and one store serves every generation): use --rdzv-backend "
            "c10d --rdzv-endpoint HOST:PORT, or etcd-v3 against an etcd cluster"
        )


def check_host_address(
    *,
    max_nodes: int,
    rdzv_host: str,
    local_addr: str | None,
    environ: dict[str, str] | None = None,
    hostname: str | None = None,
) -> dict[str, str]:
    """Make sure the ranks' gloo groups can reach this host from the others, before any
    rank starts.

    gloo binds each rank to the address of the host's name; one that resolves to loopback
    only (or not at all) leaves the hosts' ranks unconnected (``connectFullMesh failed``),
    restarting until the no-progress guard stops the job. Nothing is checked for one node, a
    rendezvous on loopback or a set ``GLOO_SOCKET_IFNAME``; with ``--local-addr`` that is set
    to the interface holding the address.

    Returns the environment variables it set (for the start-up log).

    Raises:
        ValueError: the host name does not resolve to a non-loopback address.
    """
    env = os.environ if environ is None else environ
    if max_nodes <= 1 or is_loopback(rdzv_host) or env.get("GLOO_SOCKET_IFNAME"):
        return {}
    if local_addr:
        import psutil

        for iface, addrs in psutil.net_if_addrs().items():  # the one holding that address
            if any(a.address == local_addr for a in addrs):
                env["GLOO_SOCKET_IFNAME"] = iface
                return {"GLOO_SOCKET_IFNAME": iface}
    name = hostname if hostname is not None else socket.gethostname()
    try:
        addrs = sorted({str(ai[4][0]) for ai in socket.getaddrinfo(name, None)})
    except OSError as exc:
        addrs, why = [], f"does not resolve ({exc})"
    else:
        why = f"resolves to {', '.join(addrs)} only (loopback)"
    if addrs and not all(is_loopback(a) for a in addrs):
        return {}
    raise ValueError(
        f"this host's name {name!r} {why}: the ranks' gloo groups bind to that address, so "
        "ranks on other hosts could not reach this one's. Give the name its network address "
        "(DNS or /etc/hosts), or set GLOO_SOCKET_IFNAME=<interface>, or pass --local-addr "
        "<this host's address>"
    )
