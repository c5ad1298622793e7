"""Delay and drop packets of an iptables NFQUEUE: netem for kernels built without it.

    python tests/_support/delayer.py QUEUE DELAY_MS [LOSS] [SEED]

Run by :meth:`tests._support.hosts.Hosts.impair` in the bridge's namespace, where iptables
sends a host's forwarded packets (both ways) to queue ``QUEUE``. Each packet is dropped with
probability ``LOSS`` (a seeded RNG, so a run is repeatable) or released ``DELAY_MS`` after it
arrived, in arrival order. Prints ``READY`` once bound; stops on SIGTERM, releasing what it
holds. Needs the ``NetfilterQueue`` package (libnetfilter-queue).
"""

from __future__ import annotations

import collections
import random
import select
import signal
import sys
import time
from typing import Any


def serve(queue: int, delay_s: float, loss: float, seed: int) -> None:
    """Hold each packet of ``queue`` for ``delay_s`` (or drop it with probability ``loss``)
    until SIGTERM."""
    from netfilterqueue import NetfilterQueue

    rng = random.Random(seed)
    held: collections.deque[tuple[float, Any]] = collections.deque()
    stop = [False]

    def on_packet(pkt: Any) -> None:
        if loss and rng.random() < loss:
            pkt.drop()
            return
        pkt.retain()  # the verdict comes after this callback returns
        held.append((time.monotonic() + delay_s, pkt))

    def on_term(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_term)
    nfq = NetfilterQueue()
    nfq.bind(queue, on_packet, max_len=65536)
    fd = nfq.get_fd()
    print("READY", flush=True)
    try:
        while not stop[0]:
            now = time.monotonic()
            while held and held[0][0] <= now:
                held.popleft()[1].accept()
            wait = max(0.0, held[0][0] - now) if held else 0.1
            readable, _, _ = select.select([fd], [], [], wait)
            if readable:
                nfq.run(block=False)
    finally:
        while held:
            held.popleft()[1].accept()
        nfq.unbind()


def main(argv: list[str] | None = None) -> int:
    """``QUEUE DELAY_MS [LOSS] [SEED]``."""
    args = sys.argv[1:] if argv is None else argv
    if not 2 <= len(args) <= 4:
        print(__doc__, file=sys.stderr)
        return 2
    queue, delay_ms = int(args[0]), float(args[1])
    loss = float(args[2]) if len(args) > 2 else 0.0
    seed = int(args[3]) if len(args) > 3 else 0
    serve(queue, delay_ms / 1000.0, loss, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
