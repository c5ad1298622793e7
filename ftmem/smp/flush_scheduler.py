"""FlushService: the SMP's lazy background flush to the disk tiers.

A thread of the SMP decides *what* and *when*; a worker process (``ftmem.tiers.flush_worker``,
which imports torch at nice 10) does the writing. Every ``every`` steps (the newest step all
the node's ranks committed, or the newest protected step when erasure coding is on) the
service pins that step's slots, hands the slots' paths and layouts to the worker, and unpins
when the worker answers. Pinned slots are never handed to ranks for writing, so a rank whose
other slots are all busy *skips* its snapshot (counted) rather than waiting: flushing never
blocks training. ``ftmem flush`` (a FLUSH request) asks for a flush now and gets its reply
when the checkpoint is durable. If the worker dies mid-flush (SIGKILL, OOM) the step is given
up, its partial directory is never listed as a checkpoint, and a new worker starts next time.

Resource handling: :meth:`close` ends the worker (stdin closed, bounded wait, then SIGKILL)
and unpins; :meth:`final_flush` (on SIGTERM) writes the newest step not yet flushed, bounded.
"""

from __future__ import annotations

import dataclasses
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ftmem._logging import get_logger
from ftmem.config import SmpConfig
from ftmem.events import EventLog
from ftmem.protocol import messages as m
from ftmem.protocol.flush_jobs import (
    AssembleJob,
    FlushJob,
    JobDone,
    Progress,
    SlotSource,
    TierWritten,
    WorkerReady,
)
from ftmem.protocol.status import FlushRunning, FlushStatus
from ftmem.smp.flush_process import FlushProcess
from ftmem.smp.slot_store import SlotStore
from ftmem.smp.store import RankPiece

log = get_logger(__name__)


ASSEMBLE_TIMEOUT_S = 300.0
"""``ftmem flush`` on the node of rank 0 waits this long for the other nodes' parts."""
ASSEMBLE_EVERY_S = 2.0
"""How often the node of rank 0 looks for parts to assemble when idle (multi-node)."""


@dataclass
class FlushRequest:
    """A FLUSH request waiting for its answer."""

    token: Any
    step: int | None
    tiers: int
    """How many tiers must be written (1: local only)."""
    assemble_s: float = ASSEMBLE_TIMEOUT_S
    """How long the node of rank 0 waits for the other nodes' parts of this step."""


@dataclass
class _Running:
    rid: int
    step: int
    pieces: list[RankPiece]
    tiers: int
    started: float
    waiters: list[FlushRequest] = field(default_factory=list)
    assemble_only: bool = False


class FlushService:
    """The flush thread (see the module docstring)."""

    def __init__(
        self,
        config: SmpConfig,
        slots: SlotStore,
        protected_step: Callable[[], int | None],
        on_reply: Callable[[Any, bool, dict[str, Any], str], None],
        events: EventLog | None = None,
    ) -> None:
        self.node = node = config.node
        self.events = events
        self.config = config
        self.slots = slots
        self.protected_step = protected_step
        self.on_reply = on_reply
        self._requests: queue.Queue[FlushRequest | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftmem-smp-flush", daemon=True)
        self.worker = FlushProcess(node)
        """The worker process that writes (started on demand; its ``ready`` is set once it
        has imported torch and DCP: scheduled flushes pin nothing before it, since a pin held
        during a cold start would make ranks skip)."""
        self._running: _Running | None = None
        self._waiting: list[FlushRequest] = []
        self._ids = 0
        self._lock = threading.Lock()
        self._status = FlushStatus(
            enabled=True,
            tiers=tuple(str(t) for t in config.flush_tiers),
            every=config.flush_every,
            keep=config.flush_keep,
        )
        self._discard_above: int | None = None
        self._last_assemble = 0.0
        self.last_step: int | None = None
        # Every-N flushes: each rank's slot of a multiple of N is pinned as it commits, so the
        # step is still there when the last rank has committed it (guarded by _res_lock).
        self._reserved: dict[int, dict[int, RankPiece]] = {}
        self._res_lock = threading.Lock()

    # -- main-loop side ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and the worker process (its torch import takes seconds: better
        now than while the first flush holds slots)."""
        try:
            self.worker.ensure()
        except OSError as exc:
            log.error("[%s/flush] cannot start the flush worker: %s", self.node, exc)
        self._thread.start()

    def request(self, req: FlushRequest) -> None:
        """Ask for a flush now; ``on_reply`` answers it when durable (or failed)."""
        self._requests.put(req)

    def wants(self, step: int) -> bool:
        """Should the slot of ``step`` a rank just committed be kept for a scheduled flush?"""
        every = self.config.flush_every
        last = self.last_step
        # Not while a flush runs: a reservation then would leave ranks no slot to save into
        # (newest + flushing + reserved); the next flush takes the newest complete step.
        return (
            every > 0
            and step % every == 0
            and (last is None or step > last)
            and self._running is None
            and self.worker.ready.is_set()
        )

    def reserve(self, rank: int, step: int, piece: RankPiece) -> list[RankPiece]:
        """Keep a (pinned) slot of a scheduled step; return older pins to release (at most
        two scheduled steps are held, so a rank that skipped one cannot hold slots forever)."""
        with self._res_lock:
            self._reserved.setdefault(step, {})[rank] = piece
            drop: list[RankPiece] = []
            while len(self._reserved) > 2:
                oldest = min(self._reserved)
                drop += self._reserved.pop(oldest).values()
            return drop

    def release_incomplete(self, rank: int) -> list[RankPiece]:
        """``rank`` has no slot to write into: give back its pins of scheduled steps that not
        every rank of the node has reserved (such a step may never be complete, e.g. another
        rank committed it while a flush ran; a newer step is flushed instead). Return them to
        unpin."""
        ranks = set(self.slots.all_ranks())
        with self._res_lock:
            out = []
            for step in sorted(self._reserved):
                held = self._reserved[step]
                if rank in held and set(held) != ranks:
                    out.append(held.pop(rank))
                    if not held:
                        del self._reserved[step]
            return out

    def cancel_newer(self, step: int) -> list[RankPiece]:
        """Ranks restored ``step``: forget reservations of newer steps (an abandoned timeline);
        return their pins to release."""
        with self._res_lock:
            newer = [s for s in self._reserved if s > step]
            if self._discard_above is None or step < self._discard_above:
                self._discard_above = step  # this node's parts of newer steps: see _discard
            return [p for s in newer for p in self._reserved.pop(s).values()]

    def _take_reserved(self) -> tuple[int, list[RankPiece]] | None:
        ranks = set(self.slots.all_ranks())
        with self._res_lock:
            ready = [s for s, d in self._reserved.items() if ranks and set(d) >= ranks]
            if not ready:
                return None
            step = max(ready)
            pieces = [p for r, p in sorted(self._reserved.pop(step).items()) if r in ranks]
            stale = [s for s in self._reserved if s < step]
            old = [p for s in stale for p in self._reserved.pop(s).values()]
        if old:
            self.slots.unpin(old)
        return step, pieces

    def status(self) -> FlushStatus:
        """The flush state now (frozen: safe to keep)."""
        with self._lock:
            return self._status

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and the worker (bounded); release reserved slots."""
        self._stop.set()
        self._requests.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self.worker.end()
        with self._res_lock:
            held = [p for d in self._reserved.values() for p in d.values()]
            self._reserved.clear()
        if held:
            self.slots.unpin(held)

    # -- thread ------------------------------------------------------------------------------
    def _set(self, **kw: Any) -> None:
        with self._lock:
            self._status = dataclasses.replace(self._status, **kw)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._tick()
        except Exception:
            log.exception("[%s/flush] stopped by an unexpected error", self.node)
        finally:
            if self._running is not None:
                self._finish(JobDone(self._running.rid, False, error="the SMP is stopping"))

    def _tick(self) -> None:
        try:
            req = self._requests.get(timeout=0.2 if self._running is None else 0.05)
            if req is not None:
                self._waiting.append(req)
        except queue.Empty:
            pass
        running = self._running is not None
        self._poll_worker()
        if running:
            return
        if self._discard_above is not None:
            self._discard()
        if not self._waiting:
            got = self._take_reserved()
            if got is not None:
                self._begin(got[0], len(self.config.flush_tiers), got[1])
                return
        step, tiers = self._next()
        if step is not None and (self._waiting or self.worker.ready.is_set()):
            self._begin(step, tiers)
        elif self._coordinates() and self._running is None:
            if time.monotonic() - self._last_assemble > ASSEMBLE_EVERY_S:
                self._start_assemble()

    def _multi(self) -> bool:
        world = self.slots.world_size()
        return world > 0 and self.slots.all_ranks() != list(range(world))

    def _coordinates(self) -> bool:
        """Multi-node with a shared last tier, and this node holds rank 0: it assembles."""
        return self.config.flush_shared and self._multi() and 0 in self.slots.all_ranks()

    def _discard(self) -> None:
        """Ranks restored an older step: remove this node's parts of newer steps (they belong to
        an abandoned run and must never be assembled with parts of the new one)."""
        from ftmem.tiers.checkpoints import list_checkpoints

        above, self._discard_above = self._discard_above, None
        ranks = self.slots.all_ranks()
        if above is None or not ranks or not self._multi():
            return
        for tier in self.config.flush_tiers:
            for ck in list_checkpoints(tier, parts=True)[0]:
                if ck.is_part and ck.step > above and ck.ranks[0] == ranks[0]:
                    log.info("[%s/flush] removing %s (an abandoned run's part)", self.node, ck.path)
                    shutil.rmtree(ck.path, ignore_errors=True)

    def _start_assemble(self) -> None:
        self._last_assemble = time.monotonic()
        try:
            self.worker.ensure()
        except OSError:
            return
        self._ids += 1
        self._running = _Running(self._ids, -1, [], 0, time.monotonic(), assemble_only=True)
        tier = str(self.config.flush_tiers[-1])
        world = self.slots.world_size()
        self._send(AssembleJob(self._ids, tier, world, self.config.flush_keep))

    def _candidate(self, protected: bool = True) -> int | None:
        """The protected step (unless not ``protected``), else the newest step every rank of
        this node has verified (None: none)."""
        step = self.protected_step() if protected else None
        if step is not None:
            return step
        steps = self.slots.complete_steps(self.slots.all_ranks())
        return steps[0] if steps else None

    def _next(self) -> tuple[int | None, int]:
        cand = self._candidate()
        if self._waiting:
            want = [r.step for r in self._waiting if r.step is not None]
            step = want[0] if want else cand
            tiers = max(r.tiers for r in self._waiting)
            if step is None:
                why = "no step is committed by every rank yet " + held_by_rank(
                    self.slots.committed_steps()
                )
                for r in self._waiting:
                    self.on_reply(r.token, False, {}, why)
                self._waiting.clear()
                return None, 0
            return step, tiers
        every = self.config.flush_every
        if every <= 0 or cand is None:
            return None, 0
        # Multiples of ``every`` only: every node of a multi-node run picks the same steps.
        target = cand // every * every
        if target > (self.last_step or 0):
            return target, len(self.config.flush_tiers)
        return None, 0

    def _begin(self, step: int, tiers: int, pinned: list[RankPiece] | None = None) -> None:
        ranks = self.slots.all_ranks()
        if pinned is not None:
            pieces: list[RankPiece] | None = pinned
        else:
            pieces = self.slots.pin_step(ranks, step) if ranks else None
        waiters, self._waiting = self._waiting, []
        if pieces is None:
            msg = f"step {step} is not held by every rank of this node"
            for w in waiters:
                self.on_reply(w.token, False, {}, msg)
            log.info("[%s/flush] %s; skipped", self.node, msg)
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            return
        try:
            self.worker.ensure()
        except OSError as exc:
            self.slots.unpin(pieces)
            for w in waiters:
                self.on_reply(w.token, False, {}, f"cannot start the flush worker: {exc}")
            return
        self._ids += 1
        self._running = _Running(self._ids, step, pieces, tiers, time.monotonic(), waiters)
        job = FlushJob(
            id=self._ids,
            step=step,
            sources=[SlotSource(p.rank, step, p.path, p.capacity, p.layout) for p in pieces],
            tiers=[str(t) for t in self.config.flush_tiers[: max(1, tiers)]],
            keep=self.config.flush_keep,
            writers=self.config.flush_writers,
            direct=self.config.flush_direct,
            world_size=self.slots.world_size(),
            shared=self.config.flush_shared and tiers >= len(self.config.flush_tiers),
            # Asked for (ftmem flush, the final flush): wait for the other nodes' parts, as
            # long as the longest asker allows; scheduled: one look.
            assemble_timeout=max((w.assemble_s for w in waiters), default=0.0),
        )
        self._set(running=FlushRunning(step, "starting", 0))
        self._send(job)

    def _send(self, job: FlushJob | AssembleJob) -> None:
        if not self.worker.send(job):
            self._finish(JobDone(job.id, False, error="the flush worker is gone"))

    def _poll_worker(self) -> None:
        """Read the worker's replies: its readiness, and the running job's progress and end
        (if one runs); the end of its output means it died."""
        for reply in self.worker.replies():
            run = self._running
            match reply:
                case None:
                    if run is not None:
                        code = self.worker.exit_code
                        error = f"the flush worker died (exit {code})"
                        self._finish(JobDone(run.rid, False, error=error))
                    self.worker.end()
                    return
                case WorkerReady():
                    log.info("[%s/flush] flush worker ready", self.node)
                case _ if run is None or reply.id != run.rid:
                    continue  # a late reply of a job given up
                case JobDone():
                    self._finish(reply)
                    return
                case Progress() if not run.assemble_only:
                    self._set(
                        running=FlushRunning(
                            run.step, reply.stage, reply.tier, reply.done, reply.total, reply.unit
                        )
                    )
                case TierWritten():
                    log.info("[%s/flush] step %d durable in %s", self.node, run.step, reply.path)

    def _finish(self, done: JobDone) -> None:
        run, self._running = self._running, None
        assert run is not None
        if done.assembled:
            self._set(assembled_step=max(done.assembled))
        if run.assemble_only:
            if done.assembled and self.events is not None:
                self.events.write("assembled", step=max(done.assembled))
            if not done.ok and not self._stop.is_set():  # (an idle look cut short: no error)
                log.error("[%s/flush] assembling failed: %s", self.node, done.error)
            return
        self.slots.unpin(run.pieces)
        seconds = time.monotonic() - run.started
        s = self._status  # only this thread changes it
        if done.ok:
            self._set(
                running=None,
                last_step=run.step,
                last_paths=tuple(done.paths),
                last_seconds=round(seconds, 3),
                last_bytes=done.bytes,
                flushes=s.flushes + 1,
            )
        else:
            self._set(running=None, last_error=done.error, failures=s.failures + 1)
        if self.events is not None:
            self.events.write(
                "flushed" if done.ok else "flush_failed",
                step=run.step,
                seconds=round(seconds, 3),
                paths=list(done.paths),
                bytes=done.bytes,
                assembled=list(done.assembled),
                error=done.error,
            )
        # A failed step is not retried by the schedule (the next one will be flushed).
        self.last_step = run.step if self.last_step is None else max(self.last_step, run.step)
        if done.ok:
            log.info(
                "[%s/flush] step %d flushed to %d tier(s) in %.2f s (%.1f MiB)",
                self.node,
                run.step,
                len(done.paths),
                seconds,
                done.bytes / 2**20,
            )
        else:
            log.error("[%s/flush] flush of step %d failed: %s", self.node, run.step, done.error)
        data = m.to_fields(m.FlushReply(run.step, list(done.paths), round(seconds, 3)))
        for w in run.waiters:
            self.on_reply(w.token, done.ok, data, done.error)

    def final_flush(self, timeout_s: float) -> None:
        """(SIGTERM) Flush the newest step every rank of this node has verified (not the
        protected one: the job is ending, its final step is what must be kept), waiting at
        most ``timeout_s``."""
        cand = self._candidate(protected=False)
        if cand is None or (self.last_step is not None and cand <= self.last_step):
            return
        # The other nodes' parts are waited for within the same bound (less a margin for the
        # worker to finish), never ftmem flush's 300 s: a dead node's part never comes.
        wait = max(0.0, timeout_s - 5.0)
        self.request(FlushRequest(None, cand, len(self.config.flush_tiers), assemble_s=wait))
        deadline = time.monotonic() + timeout_s
        log.info("[%s/flush] final flush of step %d (at most %.0f s)", self.node, cand, timeout_s)
        while time.monotonic() < deadline:
            last = self.last_step
            if last is not None and last >= cand and self._running is None:
                return
            time.sleep(0.05)
        log.error("[%s/flush] final flush of step %d did not finish in time", self.node, cand)


def held_by_rank(steps: dict[str, list[int | None]], most: int = 8) -> str:
    """``(rank 0: steps [5, 6]; rank 1: none; ...)`` for an error message (at most ``most``
    ranks named)."""
    parts = [
        f"rank {r}: "
        + (
            f"steps {sorted(s for s in v if s is not None)}"
            if any(s is not None for s in v)
            else "none"
        )
        for r, v in sorted(steps.items(), key=lambda kv: int(kv[0]))[:most]
    ]
    more = f"; {len(steps) - most} more" if len(steps) > most else ""
    return f"({'; '.join(parts)}{more})"
