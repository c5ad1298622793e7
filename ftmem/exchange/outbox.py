"""Outbox: a protector's messages queued per peer and sent without blocking.

A node never blocks on a busy peer (while that peer may be blocked on it): every message is
queued here and :meth:`Outbox.flush` sends, in order, what each peer can take now. The owner's
waits call ``flush`` on every turn. One thread owns an outbox, as it owns the transport.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ftmem._logging import get_logger
from ftmem.errors import FtmemError
from ftmem.exchange.transport import PeerTransport

log = get_logger(__name__)


class Outbox:
    """Per-peer FIFO queues of (header, buffers) for :meth:`PeerTransport.try_send`.

    Error handling: a peer the transport refuses (FtmemError) loses its queued messages; the
    loss is logged and the other peers' queues go on.
    """

    def __init__(self, me: int) -> None:
        self.me = me
        self.sent_bytes = 0
        """Buffer bytes handed to the transport so far (headers not counted)."""
        self._boxes: dict[int, deque[tuple[dict[str, Any], list[Any]]]] = {}
        self._bytes: dict[int, int] = {}

    def put(self, node: int, header: dict[str, Any], bufs: list[Any]) -> None:
        """Queue a message for ``node`` (sent by a later :meth:`flush`)."""
        self._boxes.setdefault(node, deque()).append((header, bufs))
        self._bytes[node] = self._bytes.get(node, 0) + sum(memoryview(b).nbytes for b in bufs)

    def pending(self, node: int) -> tuple[int, int]:
        """(messages, buffer bytes) queued for ``node`` and not sent yet: what answering a
        peer's requests may add to is bounded by the caller on these."""
        box = self._boxes.get(node)
        return (len(box), self._bytes.get(node, 0)) if box else (0, 0)

    def flush(self, transport: PeerTransport) -> bool:
        """Send what peers can take now; True when nothing is left queued."""
        for node, box in list(self._boxes.items()):
            while box:
                header, bufs = box[0]
                try:
                    if not transport.try_send(str(node), header, bufs):
                        break
                except FtmemError as exc:
                    log.warning(
                        "[%d] dropping %d messages to node %d: %s", self.me, len(box), node, exc
                    )
                    box.clear()
                    break
                box.popleft()
                n = sum(memoryview(b).nbytes for b in bufs)
                self.sent_bytes += n
                self._bytes[node] -= n
            if not box:
                del self._boxes[node]
                self._bytes.pop(node, None)
        return not self._boxes

    def queued(self) -> int:
        """Messages not sent yet."""
        return sum(map(len, self._boxes.values()))

    def __bool__(self) -> bool:
        return bool(self._boxes)

    def clear(self) -> None:
        """Drop every queued message (a new epoch: they are stale)."""
        self._boxes.clear()
        self._bytes.clear()
