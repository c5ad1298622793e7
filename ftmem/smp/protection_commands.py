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
from ftmem.protocol.messages import PeerBind, PeerStart


@dataclass(frozen=True, slots=True)
class BindCommand:
    """Start a new transport as ``request`` says (replaces the previous one), with the job's
    key pair ``keys`` read from it."""

    token: Any
    request: PeerBind
    keys: CurveKeyPair


@dataclass(frozen=True, slots=True)
class StartCommand:
    """Join the mesh of ``request.epoch`` (two per generation: ftmem.launch.peers.mesh_epoch)
    as ``request`` says, with its peer ``endpoints`` checked and keyed by node index; then
    sync."""

    token: Any
    request: PeerStart
    endpoints: dict[int, str]


@dataclass(frozen=True, slots=True)
class Result:
    """The outcome of a command, for the main loop to reply with."""

    token: Any
    ok: bool
    data: dict[str, Any]
    error: str = ""
    kind: ErrorKind = ErrorKind.REFUSED
    """Which refusal (when not ``ok``)."""
