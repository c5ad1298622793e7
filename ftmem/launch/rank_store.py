"""The TCPStore a generation's ranks meet at, served by the agent instead of global rank 0.

With a store per rendezvous round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, ftmem-launch's
default: :func:`ftmem.launch.config.apply_safe_env_defaults`), torch makes global rank 0
serve the ranks' TCPStore from its own process, in ``init_process_group``. A rank that gets
there first finds nothing listening and retries with torch's backoff, so a rank 0 that arrives
late leaves both waiting for the backoff's next turn. At a restart that is the usual order, not the exception: a rank that rejoins in
process tears its old group down first, and standbys and cold ranks start at different times.

So the agent that will run global rank 0 serves a fresh store for every generation, on the
generation's ``MASTER_ADDR:MASTER_PORT``, before it starts a rank, and every rank of every
node gets ``TORCHELASTIC_USE_AGENT_STORE=True``: torch's own switch, with which every rank is
a client of a store that is already up. A fresh store per generation means no rank reads a
key of an earlier one (why ftmem-launch turns elastic's shared store off). If the store
cannot be served (the port was taken meanwhile), this node's ranks get ``False`` and rank 0
serves it as torch does; ranks other than 0 are clients either way, so nodes need not agree.

With elastic's shared store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0``) nothing changes here.
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


def per_round_store(environ: dict[str, str] | None = None) -> bool:
    """Whether elastic gives each rendezvous round its own store (then the agent serves it)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_DISABLE_SHARED_STORE) == "1"


class RankStore:
    """Serves the ranks' TCPStore of the current generation (one at a time) on this node.

    Call order, from the agent's main thread: after each rendezvous :meth:`serve` on the node
    that runs global rank 0 and :meth:`close` on the others, :meth:`rank_env` when starting
    the ranks, :meth:`close` at shutdown. Nothing is served with elastic's shared store
    (:attr:`enabled` False, read once: the launcher sets its environment before the agent).
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self.enabled = per_round_store()
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
