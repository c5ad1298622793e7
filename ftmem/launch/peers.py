"""The agent's part of the erasure-coded peer mesh: keys, endpoints and each generation's sync.

Every rendezvous round, before its ranks start, each agent:

1. resolves the parity ``m`` (``--ftmem-ec-parity``; ``auto`` = 1 with at least 3 nodes,
   else off: Reed-Solomon with ISA-L needs ``k = n - m >= 2`` data columns);
2. gets the job's CURVE key pair (:mod:`ftmem.launch.job_key`);
3. makes this node's key pair of the generation, asks its SMP to open its peer port with it
   (PEER_BIND) and publishes ``(generation, node index, address)`` in the store with an
   HMAC-SHA256 under a key derived from the job's (the store is plain TCP: an entry that
   fails its checks, or is of another generation or node, is refused);
4. reads back the addresses of its erasure-coding group only (``placement.group_nodes``) and
   sends them to its SMP (PEER_START), which admits exactly those keys and waits for the
   group's sync: a node that lost its memory rebuilds it from its peers before its ranks are
   started. More than ``m`` nodes lost raises :class:`~ftmem.errors.UnrecoverableError` on
   every node (the same verdict everywhere).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from ftmem import typed_json
from ftmem.errors import ErrorKind, FtmemError, SmpRequestError, UnrecoverableError
from ftmem.exchange.keys import KeyFileError
from ftmem.exchange.placement import group_nodes
from ftmem.launch.job_key import host_key_path, job_keys
from ftmem.protocol.status import ProtectionState, SyncReply

if TYPE_CHECKING:
    from ftmem.launch.config import FtmemLaunchConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

_PEER_KEY = "ftmem/peer"

AUTO = -1
"""``--ftmem-ec-parity auto``."""


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """The ``--ftmem-ec-*``, ``--ftmem-key-file`` and ``--ftmem-peer-host`` choices."""

    parity: int = AUTO
    max_group: int = 8
    key_file: Path | None = None
    host_key: Path | None = None
    """Without a key file: the private file of this host through which the agents of a
    mesh that stays on this host share the job's key (:func:`host_key_path`); None (with
    ``--ftmem-insecure-mesh``): the key goes through the rendezvous store."""
    host: str = "127.0.0.1"
    interval_s: float = 0.0
    rebuild_timeout: timedelta = timedelta(seconds=600)
    encrypt: bool = False
    """``--ftmem-ec-encrypt``: snapshot bytes over CURVE too (else the tagged data channel)."""
    encode_workers: int = 0
    """``--ftmem-tune ec-encode-workers``: processes per SMP that encode its stripes."""

    @classmethod
    def from_launch(cls, ft: FtmemLaunchConfig, run_id: str) -> PeerSettings:
        """The mesh's settings from the launcher's flags. Without a key file (and without
        ``--ftmem-insecure-mesh``) the mesh is on this host only (``check_mesh_key``): its
        key is then shared through a private file of this host, never through the store."""
        host_local = ft.key_file is None and not ft.insecure_mesh
        return cls(
            parity=ft.ec_parity,
            max_group=ft.ec_group_size,
            key_file=ft.key_file,
            host_key=host_key_path(run_id) if host_local else None,
            host=ft.peer_host or "127.0.0.1",
            interval_s=ft.ec_interval.total_seconds(),
            rebuild_timeout=ft.rebuild_timeout,
            encrypt=ft.ec_encrypt,
            encode_workers=ft.ec_encode_workers,
        )


def mesh_epoch(generation: int, reshaped: bool = False) -> int:
    """The peer mesh's epoch in ``generation``: epochs only grow, and a round whose job
    changed size makes two meshes (the old nodes' to rebuild, then the new one's), so
    each generation has two (the SMPs keep a message of a newer epoch until they start it)."""
    return 2 * generation + int(reshaped)


def resolve_parity(parity: int, nodes: int) -> int:
    """The parity m to use with ``nodes`` nodes (0: erasure coding off)."""
    if parity == AUTO:
        return 1 if nodes >= 3 else 0
    if parity > 0 and nodes < parity + 2:
        log.warning(
            "--ftmem-ec-parity %d needs at least %d nodes, the job has %d: erasure coding off",
            parity,
            parity + 2,
            nodes,
        )
        return 0
    return parity


def _entry_mac(job: Any, fields: dict[str, Any]) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(job.derived_key("store-entry"), body, hashlib.sha256).hexdigest()


def signed_entry(job: Any, fields: dict[str, Any]) -> str:
    """``fields`` as JSON with ``mac``, their MAC under the job's key (``job``: its
    :class:`~ftmem.exchange.keys.CurveKeyPair`; None: no MAC)."""
    return json.dumps({**fields, "mac": _entry_mac(job, fields) if job is not None else None})


def verified_entry(job: Any, raw: bytes, cls: type[T], fields: dict[str, Any]) -> T:
    """The ``cls`` in ``raw`` (exactly its fields, ``mac`` the MAC of the others, as
    :func:`signed_entry` writes it) if it agrees with ``fields`` and its MAC verifies (any
    MAC passes without a job key).

    Raises:
        ProtocolError: it does not.
    """
    from ftmem.errors import ProtocolError

    try:
        doc = typed_json.loads(raw, "the entry")
        got: T = typed_json.build(cls, doc)
    except ProtocolError as exc:
        raise ProtocolError(f"malformed: {exc}") from None
    body = {k: v for k, v in doc.items() if k != "mac"}
    if any(body[k] != v for k, v in fields.items()):
        raise ProtocolError(f"of another round or node: {body!r:.200}")
    mac = doc["mac"]
    if job is not None and not (
        type(mac) is str and hmac.compare_digest(mac, _entry_mac(job, body))
    ):
        raise ProtocolError("fails its authentication (not written with this job's key)")
    return got


def peer_entry(job: Any, generation: int, node: int, address: str) -> str:
    """This node's entry in the rendezvous store: the generation, the node index and its
    address (endpoint and public key), as :func:`signed_entry` writes them."""
    return signed_entry(job, {"generation": generation, "node": node, "address": address})


@dataclass(frozen=True, slots=True)
class _PeerEntry:
    """A node's entry in the rendezvous store, as :func:`peer_entry` writes it."""

    generation: int
    node: Annotated[int, typed_json.Range(0, 1 << 20)]
    address: Annotated[str, typed_json.Most(1024)]
    mac: Annotated[str, typed_json.Most(64)]


ENTRY_WAIT_S = 10.0
"""How long a node's entry that fails its checks is read again: a store writer may have
planted it, or a round whose number came back still holds its first formation's entry, before
the node writes this generation's."""


def read_until_valid(
    store: Any, key: str, raw: bytes, read: Callable[[bytes], T], deadline: float, warn: bool
) -> T:
    """``read(raw)``, ``raw`` being the value of ``key``: a value ``read`` refuses (FtmemError,
    ValueError) is read from the store again every 50 ms until ``deadline`` (monotonic), then
    its error is raised. ``warn``: log the first refused value that is not blank (a blank one
    is not written yet)."""
    while True:
        try:
            return read(raw)
        except (FtmemError, ValueError) as exc:
            if warn and raw:
                warn = False
                log.warning(
                    "rendezvous store: %r was not written by this job's agent of this round "
                    "(%s): ignored; reading it again",
                    key,
                    exc,
                )
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.05)
        raw = bytes(store.get(key))


def read_entries(
    store: Any, keys: list[str], read: Callable[[int, bytes], T], wait_s: float = ENTRY_WAIT_S
) -> list[T]:
    """``read(i, value)`` of each of ``keys`` (waits until all are in: up to the store's
    timeout, or the round's end through a
    :class:`~ftmem.launch.elastic_compat.RoundStore`), through
    :func:`read_until_valid` for up to ``wait_s`` (for all of them together)."""
    values = store.multi_get(keys)
    deadline = time.monotonic() + wait_s
    return [
        read_until_valid(store, key, bytes(raw), functools.partial(read, i), deadline, False)
        for i, (key, raw) in enumerate(zip(keys, values, strict=True))
    ]


def read_peer_entry(job: Any, raw: bytes, generation: int, node: int) -> str:
    """The address in node ``node``'s entry for ``generation``, once its MAC, generation,
    node and address are checked.

    Raises:
        FtmemError: the entry is malformed, fails its MAC, or is of another generation or node.
    """
    from ftmem.errors import ProtocolError
    from ftmem.protocol.peer import parse_endpoint

    try:
        entry = verified_entry(job, raw, _PeerEntry, {})
        if entry.generation != generation or entry.node != node:
            raise ProtocolError(
                f"it is of generation {entry.generation}, node {entry.node}, not generation "
                f"{generation}: refusing it"
            )
        return parse_endpoint(entry.address)
    except ProtocolError as exc:
        raise FtmemError(f"the store's peer entry of node {node}: {exc}") from exc


def _start_showing_progress(
    smp: Any, start: Any, timeout: timedelta, run_dir: Path, node_name: str
) -> SyncReply:
    """Send PEER_START and return its typed reply; meanwhile log the rebuild's progress each
    second.

    The request runs on a thread of its own (a client belongs to one thread); this thread polls
    the SMP's status with a second client.

    Raises:
        SmpRequestError, SmpUnavailableError: as the request; ProtocolError: a malformed reply.
    """
    from ftmem.protocol.smp_client import SmpClient

    shown: tuple[int, int] | None = None
    with (
        ThreadPoolExecutor(1, thread_name_prefix="ftmem-peer-start") as pool,
        SmpClient(run_dir, timeout=timedelta(seconds=5)) as status,
    ):
        asked = pool.submit(smp.call, start, timeout=timeout)
        while wait([asked], 1.0).not_done:
            try:  # ProtocolError (a malformed status) is an FtmemError too
                ex = status.status().protection
            except FtmemError:
                ex = None
            prog = ex.rebuild_progress if ex and ex.state is ProtectionState.REBUILDING else None
            if prog is not None and prog.of and (prog.fragments, prog.of) != shown:
                shown = (prog.fragments, prog.of)
                log.info(
                    "[%s] rebuilding step %s from peers: %.0f%% (%d/%d fragments)",
                    node_name,
                    prog.step,
                    100.0 * prog.fragments / prog.of,
                    prog.fragments,
                    prog.of,
                )
    reply: SyncReply = asked.result()
    return reply


@dataclass(frozen=True, slots=True)
class MeshSync:
    """A generation's mesh in sync: the SMP's PEER_START reply and how long the join took."""

    reply: SyncReply
    seconds: float

    def event_fields(self) -> dict[str, Any]:
        """The ``peers_synced`` event's fields: the reply as the SMP sent it, and ``seconds``."""
        return {**self.reply.to_json(), "seconds": self.seconds}


class PeerMesh:
    """This node's side of every generation's peer mesh (steps 1-4 of the module docstring),
    with the job's key: one object per agent, which warns once about a key that travels
    through the store.

    Args:
        settings: the launcher's mesh settings.
    """

    def __init__(self, settings: PeerSettings) -> None:
        self.settings = settings
        self.key_warned = False
        """The warning about a key handed out through the store was logged."""

    def job_keys(self, store: Any, group_rank: int) -> str:
        """The job's CURVE key pair as JSON (:func:`job_keys`), warning at most once."""
        s = self.settings
        pair = job_keys(s.key_file, s.host_key, store, group_rank, warn=not self.key_warned)
        self.key_warned = True
        return pair

    def parity(self, nodes: int) -> int:
        """The parity m of a mesh of ``nodes`` nodes (0: erasure coding off)."""
        return resolve_parity(self.settings.parity, nodes)

    def join(
        self,
        *,
        store: Any,
        group_rank: int,
        nodes: int,
        me: int,
        generation: int,
        run_dir: Path,
        ranks: list[int],
        node_name: str,
        epoch: int | None = None,
        tag: str = "",
    ) -> MeshSync | None:
        """Bind, publish, read and start the mesh of ``generation`` for the SMP of ``run_dir``
        as node ``me`` of ``nodes``; return once the group is in sync (None: EC off).

        ``epoch``: the mesh's epoch (default :func:`mesh_epoch` of the generation); ``tag``:
        a name for a second mesh of the same round (its own store keys), as a change of the
        job's size makes (:mod:`ftmem.launch.reshape`).

        Raises:
            UnrecoverableError: more than m nodes of a group lost their snapshots.
            FtmemError: the SMP could not open its port or the sync failed otherwise.
        """
        from ftmem.exchange import keys
        from ftmem.protocol import messages as m
        from ftmem.protocol.smp_client import SmpClient

        settings = self.settings
        parity = self.parity(nodes)
        if parity == 0:
            return None
        epoch = mesh_epoch(generation) if epoch is None else epoch
        key = f"{_PEER_KEY}{tag}"
        t0 = time.monotonic()
        job = keys.CurveKeyPair.from_json(self.job_keys(store, group_rank))
        pair = job.with_node(keys.generate()).to_json()
        with SmpClient(run_dir, timeout=timedelta(seconds=30)) as smp:
            bound = smp.call(
                m.PeerBind(
                    keys=pair,
                    host=settings.host,
                    me=me,
                    encrypt=settings.encrypt,
                    encode_workers=settings.encode_workers,
                ),
            )
            store.set(f"{key}/{me}", peer_entry(job, generation, me, bound.endpoint))
            group = group_nodes(nodes, parity, settings.max_group, me)
            read = read_entries(
                store,
                [f"{key}/{i}" for i in group],
                lambda j, raw: read_peer_entry(job, raw, generation, group[j]),
            )
            endpoints = {str(i): e for i, e in zip(group, read, strict=True)}
            log.info(
                "[%s] peer mesh of generation %d: %d nodes, m=%d, this node %d at %s",
                node_name,
                generation,
                nodes,
                parity,
                me,
                bound.endpoint,
            )
            start = m.PeerStart(
                epoch=epoch,
                me=me,
                endpoints=endpoints,
                m=parity,
                max_group=settings.max_group,
                ranks=ranks,
                protect_interval_s=settings.interval_s,
                nodes=nodes,
            )
            try:
                reply = _start_showing_progress(
                    smp, start, settings.rebuild_timeout, run_dir, node_name
                )
            except SmpRequestError as exc:
                if exc.kind is ErrorKind.UNRECOVERABLE:
                    raise UnrecoverableError(str(exc).split(": ", 1)[-1]) from exc
                raise FtmemError(f"peer sync failed: {exc}") from exc
        seconds = round(time.monotonic() - t0, 3)
        if reply.rebuilt:
            log.info(
                "[%s] REBUILT step %s of this node from its peers (lost nodes %s) in %.2f s",
                node_name,
                reply.step,
                list(reply.lost),
                seconds,
            )
        else:
            log.info(
                "[%s] peers in sync: protected step %s (lost nodes %s)",
                node_name,
                reply.step,
                list(reply.lost),
            )
        return MeshSync(reply, seconds)

    def sync(self, events: Any, checkfree: bool, *, generation: int, **join: Any) -> None:
        """:meth:`join` this generation's mesh (``join``: its arguments) and record the
        outcome (``peers_synced``, ``peers_failed``): a mesh that does not form leaves the
        generation unprotected; more than m nodes lost is ``checkfree`` (the ranks rebuild
        lost pipeline stages from neighbours) or ends the job.

        Raises:
            UnrecoverableError: more than m nodes of a group lost their snapshots and
                ``checkfree`` is off (logged ``UNRECOVERABLE``, recorded).
            RoundAbandoned: a node left the round (``store`` a
                :class:`~ftmem.launch.elastic_compat.RoundStore`).
        """
        node = join["node_name"]
        try:
            sync = self.join(generation=generation, **join)
        except UnrecoverableError as exc:
            if checkfree:
                log.error("[%s] %s; --ftmem-checkfree: going on without it", node, exc)
                events.write("checkfree", generation=generation, reason=str(exc))
                return
            log.error("[%s] UNRECOVERABLE: %s", node, exc)
            events.write("unrecoverable", generation=generation, reason=str(exc))
            raise
        except (FtmemError, KeyFileError) as exc:
            log.error("[%s] the peer mesh is not protecting this generation: %s", node, exc)
            events.write("peers_failed", generation=generation, reason=str(exc))
            return
        if sync is not None:
            events.write("peers_synced", generation=generation, **sync.event_fields())
