"""PeerTransport: how SMPs of a group move fragments to each other (interface only).

Call order: ``start()`` once, ``connect(peers)`` each generation, then ``send`` (bounded by
the send timeout: a slow or dead peer makes it raise, not hang), ``try_send`` (never blocks)
and ``recv`` as needed, and ``close()`` (idempotent, bounded).

One thread owns a transport: the SMP's protection thread. Implementation: zmq_transport.py.
Every received message has been authenticated, size-checked and its buffers checksummed
before ``recv`` returns it, and its ``sender`` is the node whose key the connection
authenticated; bad messages are dropped and counted. What headers mean, and their
validation, is :mod:`ftmem.protocol.peer`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from ftmem.protocol.peer import PeerMessage

if TYPE_CHECKING:
    from ftmem.exchange.keys import CurveKeyPair


class PeerTransport(ABC):
    """Moves headers plus raw buffers between the SMPs of a group (see the module docstring)."""

    @property
    def job_keys(self) -> CurveKeyPair | None:
        """The job's key pair, which seals are made and checked with (None: none; seals.py)."""
        return None

    @abstractmethod
    def start(self) -> str:
        """Bind and return this node's endpoint."""

    @abstractmethod
    def connect(self, peers: dict[str, str]) -> None:
        """Connect to ``peers`` (node name -> endpoint), replacing the previous set."""

    @abstractmethod
    def send(self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]) -> None:
        """Send one message to ``node``. Raises PeerUnavailableError if it cannot be queued."""

    @abstractmethod
    def try_send(
        self, node: str, header: dict[str, Any], buffers: list[memoryview | bytes]
    ) -> bool:
        """Send one message to ``node`` if it can be queued now; False if it would block.

        Raises PeerUnavailableError if ``node`` is not connected.
        """

    @abstractmethod
    def recv(self, timeout_s: float) -> PeerMessage | None:
        """Return the next valid message, or None after ``timeout_s``."""

    def take_refused(self) -> list[PeerMessage]:
        """Messages refused since the last call because their tag was wrong (altered on the
        way, or forged), as they claimed to be: the claimed sender (a member) and header, no
        buffers. Nothing in them is authenticated: use them only to ask again for what was
        lost, or to count it lost. This base transport refuses nothing this way."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release sockets (idempotent, bounded)."""
