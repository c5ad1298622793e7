"""``python -m ftmem.tiers.flush_worker``: the SMP's flush worker process (it imports torch; the
SMP does not).

It reads one job per line on stdin (:class:`~ftmem.protocol.flush_jobs.FlushJob`, or
:class:`~ftmem.protocol.flush_jobs.AssembleJob`) and answers with typed lines on stdout
(protocol/flush_jobs.py). The first tier gets the checkpoint from the slots (``export_dcp``);
each further tier a verified copy; each tier keeps its newest ``keep``. Multi-node, each tier
gets this node's *part*, and the node of rank 0 assembles the parts in the shared last tier
(:func:`ftmem.tiers.assemble.assemble`). A failure leaves every tier as it was. It runs at a
lower CPU and I/O priority with one torch thread, and ends when stdin closes.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ftmem._logging import configure, get_logger
from ftmem.config import ENV_LOG_LEVEL
from ftmem.errors import ProtocolError
from ftmem.protocol.flush_jobs import (
    AssembleJob,
    FlushJob,
    JobDone,
    Progress,
    Reply,
    TierWritten,
    WorkerReady,
    encode,
    parse_job,
)

log = get_logger(__name__)


_emit_lock = threading.Lock()


def _emit(msg: Reply) -> None:
    with _emit_lock:
        sys.stdout.write(encode(msg))
        sys.stdout.flush()


def flush(job: FlushJob) -> JobDone:
    """Run one flush request; return the final answer (progress lines are emitted on the way)."""
    from ftmem.errors import FtmemError
    from ftmem.format.layout import parse_layout
    from ftmem.tiers.assemble import AssembleError, assemble
    from ftmem.tiers.checkpoints import (
        checkpoint_name,
        copy_checkpoint,
        part_name,
        prepare_local_tier,
        prune,
        read_checkpoint,
        temp_name,
    )
    from ftmem.tiers.export import export_dcp

    rid, step = job.id, job.step
    tiers = [Path(t) for t in job.tiers]
    keep = max(1, job.keep)
    t0 = time.monotonic()
    sources = list(job.sources)
    world = job.world_size
    ranks = sorted(s.rank for s in sources)
    multi = world > 0 and ranks != list(range(world))
    name = part_name(step, ranks[0]) if multi else checkpoint_name(step)
    paths: list[str] = []
    assembled: list[int] = []
    total = 0
    try:
        first = tiers[0]
        prepare_local_tier(first)  # ours, and nobody else can move it away
        out = first / name
        ckpt = _existing(out)
        if ckpt is None:
            expected = sum(
                t.nbytes for s in sources for t in parse_layout(s.layout, s.capacity).tensors
            )
            with _Progress(rid, 0, first, temp_name(name), expected):
                export_dcp(
                    sources,
                    out,
                    world_size=world if multi else None,
                    threads=max(1, job.writers),
                    direct=job.direct,
                )
            ckpt = read_checkpoint(out)
        paths.append(str(out))
        total += ckpt.nbytes
        _emit(TierWritten(rid, 0, str(out), ckpt.nbytes))
        prune(first, keep)
        for i, tier in enumerate(tiers[1:], start=1):
            with _Progress(rid, i, tier, temp_name(name), ckpt.nbytes, "copying"):
                path = copy_checkpoint(ckpt, tier)
            paths.append(str(path))
            total += ckpt.nbytes
            _emit(TierWritten(rid, i, str(path), ckpt.nbytes))
            prune(tier, keep)
        if multi and job.shared and 0 in ranks:
            last = len(tiers) - 1

            def waiting(have: int, world: int) -> None:
                _emit(Progress(rid, "waiting for parts", last, have, world, "ranks"))

            wait_s = job.assemble_timeout
            try:
                whole = assemble(tiers[-1], step, world, wait_s, on_wait=waiting)
            except AssembleError:
                if wait_s > 0:
                    raise
                whole = None  # the other parts come later: the idle check assembles them
            if whole is not None:
                assembled.append(step)
                paths[-1] = str(whole.path)
                _emit(TierWritten(rid, last, paths[-1], 0))
                prune(tiers[-1], keep)
    except (FtmemError, OSError, ValueError) as exc:
        return JobDone(rid, False, paths=paths, error=f"{type(exc).__name__}: {exc}")
    seconds = round(time.monotonic() - t0, 3)
    return JobDone(rid, True, paths, total, seconds, assembled)


def assemble_pending(job: AssembleJob) -> JobDone:
    """(The node of rank 0) assemble the newest step whose parts cover every rank in the
    shared tier, if it is newer than its newest global checkpoint; never waits."""
    from ftmem.errors import FtmemError
    from ftmem.tiers.assemble import AssembleError, assemble
    from ftmem.tiers.checkpoints import list_checkpoints, prune

    rid, tier, world = job.id, Path(job.tier), job.world_size
    assembled: list[int] = []
    try:
        good = list_checkpoints(tier, parts=True)[0]
        newest = max((c.step for c in good if not c.is_part), default=-1)
        steps = {c.step for c in good if c.is_part and c.world_size == world and c.step > newest}
        for step in sorted(steps, reverse=True):
            try:
                assemble(tier, step, world, 0.0)
            except AssembleError:
                continue
            assembled.append(step)
            prune(tier, max(1, job.keep))
            break
    except (FtmemError, OSError, ValueError) as exc:
        return JobDone(rid, False, error=f"{type(exc).__name__}: {exc}")
    return JobDone(rid, True, assembled=assembled)


def _existing(path: Path) -> Any:
    """The complete checkpoint (or part) at ``path``, or None."""
    from ftmem.errors import CorruptSnapshotError
    from ftmem.tiers.checkpoints import read_checkpoint

    if not path.is_dir():
        return None
    try:
        return read_checkpoint(path)
    except CorruptSnapshotError:
        return None


class _Progress:
    """While a tier is written, report the bytes in its tmp directory twice a second."""

    def __init__(
        self, rid: int, tier: int, parent: Path, tmp_name: str, total: int, stage: str = "writing"
    ) -> None:
        self.rid, self.stage, self.tier, self.total = rid, stage, tier, total
        self.tmp = parent / tmp_name
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ftmem-flush-progress", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                done = sum(p.stat().st_size for p in self.tmp.rglob("*") if p.is_file())
            except OSError:
                done = 0
            _emit(Progress(self.rid, self.stage, self.tier, done, self.total))
            if self.stop.wait(0.5):
                return

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _lower_priority() -> None:
    """CPU nice 10 and the lowest best-effort I/O priority: training keeps the cores and
    its own I/O (data loading) goes first; the flush still progresses (unlike the idle I/O
    class, which a busy disk can starve for ever)."""
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, AttributeError, ValueError) as exc:  # not Linux, or not allowed
        log.info("flush worker keeps its I/O priority: %s", exc)


def main() -> int:
    """Serve flush requests from stdin until it closes."""
    configure(os.environ.get(ENV_LOG_LEVEL))
    _lower_priority()
    import torch
    import torch.distributed.checkpoint  # ~1 s: now, not in the first flush

    torch.set_num_threads(1)
    _emit(WorkerReady(os.getpid()))
    for line in sys.stdin:
        try:
            job = parse_job(line)
        except ProtocolError as exc:
            _emit(JobDone(-1, False, error=f"bad request: {exc}"))
            continue
        _emit(flush(job) if isinstance(job, FlushJob) else assemble_pending(job))
    gc.freeze()  # skip the last garbage collection of torch's heap: the SMP waits for this exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
