"""The commands the SMP's main loop gives its protection thread, and the results it gets back.

The main loop turns PEER_BIND and PEER_START into :class:`BindCommand` and
:class:`StartCommand` (:meth:`ProtectionService.submit`); the thread answers each with a
:class:`Result` carrying the command's ``token`` (the main loop sends the deferred reply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftmem.errors import ErrorKind
from ftmem.exchange.keys import CurveKeyPair


@dataclass(frozen=True, slots=True)
class BindCommand:
    """Start a new transport with ``keys`` on ``host`` (replaces the previous one)."""

    token: Any
    keys: CurveKeyPair
    host: str
    me: int
    """This node's index in the job (peers know it by this name)."""
    port: int = 0
    encrypt: bool = False
    """Every message over CURVE (no plain data channel)."""
    encode_workers: int = 0
    """Processes that encode this node's stripes (0: the protection thread)."""


@dataclass(frozen=True, slots=True)
class StartCommand:
    """Join the mesh of ``epoch`` (two per generation: ftmem.launch.peers.mesh_epoch): peers,
    erasure code, this node's ranks; then sync."""

    token: Any
    epoch: int
    me: int
    endpoints: dict[int, str]
    m: int
    max_group: int
    ranks: list[int]
    protect_interval_s: float = 0.0
    nodes: int = 0
    """The job's node count (0: ``endpoints`` names every node; else at least the group's)."""


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of a command, for the main loop to reply with."""

    token: Any
    ok: bool
    data: dict[str, Any]
    error: str = ""
    kind: ErrorKind = ErrorKind.REFUSED
    """Which refusal (when not ``ok``)."""
