"""``python -m ftmem.tiers.flusher``: the SMP's flush worker process (it imports torch; the SMP
does not).

It reads one JSON request per line on stdin and answers with JSON lines on stdout::

    {"op": "flush", "id": 3, "step": 40, "sources": [{rank, step, path, capacity, layout}...],
     "tiers": ["/local/ckpt", "/shared/ckpt"], "keep": 2}
    -> {"id": 3, "event": "progress", "stage": "writing", "tier": 0}
    -> {"id": 3, "event": "tier", "tier": 0, "path": "...", "bytes": N}
    -> {"id": 3, "ok": true, "paths": [...], "bytes": N, "seconds": S}
       or {"id": 3, "ok": false, "error": "..."}

The first tier gets the checkpoint from the slots (``export_dcp``: tmp dir, fsync, rename);
each further tier gets a verified copy of it; each tier then keeps its newest ``keep``. It runs
at a lower CPU priority (nice 10) with one torch thread, so training keeps the cores. A
failure (a full disk...) leaves every tier as it was: the partial directory is removed and the
previous checkpoints stay complete. The process ends when stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ftmem._logging import configure, get_logger

log = get_logger("ftmem.flusher")


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def flush(req: dict[str, Any]) -> dict[str, Any]:
    """Run one flush request; return the final answer (progress lines are emitted on the way)."""
    from ftmem.errors import FtmemError
    from ftmem.tiers.checkpoints import (
        checkpoint_name,
        copy_checkpoint,
        list_checkpoints,
        prune,
        read_checkpoint,
    )
    from ftmem.tiers.export import RankSource, export_dcp

    rid, step = int(req["id"]), int(req["step"])
    tiers = [Path(t) for t in req["tiers"]]
    keep = max(1, int(req.get("keep", 2)))
    t0 = time.monotonic()
    sources = [
        RankSource(
            int(s["rank"]), int(s["step"]), str(s["path"]), int(s["capacity"]), str(s["layout"])
        )
        for s in req["sources"]
    ]
    paths: list[str] = []
    total = 0
    try:
        first = tiers[0]
        first.mkdir(parents=True, exist_ok=True)
        out = first / checkpoint_name(step)
        have = {c.step: c for c in list_checkpoints(first)[0]}
        _emit({"id": rid, "event": "progress", "stage": "writing", "tier": 0})
        if step in have:
            ckpt = have[step]
        else:
            export_dcp(sources, out)
            ckpt = read_checkpoint(out)
        paths.append(str(out))
        total += ckpt.nbytes
        _emit({"id": rid, "event": "tier", "tier": 0, "path": str(out), "bytes": ckpt.nbytes})
        prune(first, keep)
        for i, tier in enumerate(tiers[1:], start=1):
            _emit({"id": rid, "event": "progress", "stage": "copying", "tier": i})
            path = copy_checkpoint(ckpt, tier)
            paths.append(str(path))
            total += ckpt.nbytes
            _emit({"id": rid, "event": "tier", "tier": i, "path": str(path), "bytes": ckpt.nbytes})
            prune(tier, keep)
    except (FtmemError, OSError, ValueError) as exc:
        return {"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}", "paths": paths}
    return {
        "id": rid,
        "ok": True,
        "paths": paths,
        "bytes": total,
        "seconds": round(time.monotonic() - t0, 3),
    }


def main() -> int:
    """Serve flush requests from stdin until it closes."""
    configure(os.environ.get("FTMEM_LOG_LEVEL"))
    try:
        os.nice(10)
    except OSError:
        pass
    import torch
    import torch.distributed.checkpoint  # ~1 s: now, not in the first flush

    torch.set_num_threads(1)
    _emit({"event": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if not isinstance(req, dict) or req.get("op") != "flush":
                raise ValueError("expected a flush request")
        except ValueError as exc:
            _emit({"ok": False, "error": f"bad request: {exc}"})
            continue
        _emit(flush(req))
    return 0


if __name__ == "__main__":
    sys.exit(main())
