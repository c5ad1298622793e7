"""The TCPStore a generation's ranks meet at, served by the agent instead of global rank 0.

With a store per rendezvous round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ftmem-launch's
default), torch makes global rank 0 serve the ranks' store in ``init_process_group``; a rank
that gets there first retries with torch's backoff, and at a restart rank 0 is often late
(a rank rejoining in process tears its old group down first). So the agent that runs global
rank 0 serves a fresh store per generation on its ``MASTER_ADDR:MASTER_PORT`` before any rank
starts, and every rank gets ``TORCHELASTIC_USE_AGENT_STORE=True`` (torch's switch: all
clients). If the port cannot be served, this node's ranks get ``False`` and rank 0 serves
it as torch does; other ranks are clients either way, so nodes need not agree. With
elastic's shared store nothing changes (docs/launcher.md).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]

from ftmem.launch.config import ENV_DISABLE_SHARED_STORE

log = logging.getLogger(__name__)

ENV_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
"""torch's switch: ``"True"`` makes every rank a client of a store the agent serves."""


class RankStore:
    """Serves the ranks' TCPStore of the current generation (one at a time) on this node.

    Call order, from the agent's main thread: after each rendezvous :meth:`serve` on the node
    that runs global rank 0 and :meth:`close` on the others, :meth:`rank_env` when starting
    the ranks, :meth:`close` at shutdown. Nothing is served with elastic's shared store
    (:attr:`enabled` False, read once: the launcher sets its environment before the agent).
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self.enabled = os.environ.get(ENV_DISABLE_SHARED_STORE) == "1"
        """Whether the agent serves the ranks' store (elastic's per-round stores)."""
        self.port: int | None = None
        """The port served now, None when this node serves none."""
        self._server: Store | None = None
        self._failed = False

    def serve(self, addr: str, port: int, generation: int) -> None:
        """Close the previous generation's store and serve a fresh one on ``port``.

        A failure to listen is logged and leaves rank 0 to serve the store itself (see
        :meth:`rank_env`); it does not fail the restart.
        """
        self.close()
        if not self.enabled:
            return
        try:
            self._server = TCPStore(
                host_name=addr,
                port=port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
            )
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            self._failed = True
            log.warning(
                "[%s] generation %d: cannot serve the ranks' store on port %d (%s): rank 0 "
                "serves it",
                self.node,
                generation,
                port,
                exc,
            )
            return
        self.port = port
        log.info(
            "[%s] generation %d: serving the ranks' store on %s:%d",
            self.node,
            generation,
            addr,
            port,
        )

    def rank_env(self) -> dict[str, str]:
        """What every rank of this node gets on top of elastic's environment ({} with
        elastic's shared store)."""
        if not self.enabled:
            return {}
        return {ENV_USE_AGENT_STORE: str(not self._failed)}

    def close(self) -> None:
        """Stop serving (the ranks of that generation are gone or have been told to rejoin)."""
        self._server = None  # the last reference: torch stops the server's thread
        self.port = None
        self._failed = False
