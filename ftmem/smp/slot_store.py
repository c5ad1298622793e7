"""SlotStore: every rank's slots of one SMP behind one lock, and their commit records.

Four threads change slots: the loop thread (requests, finished allocations, hash results),
the protection thread (pins for a round, a rebuilt step), the flush thread (pins for a flush)
and, through the loop thread, the allocation worker. Each does it through one method of this
class, which holds the lock for the whole transition, so a slot is never seen half changed
and every pin is counted in one place. The methods carry the names of the transitions of
:mod:`ftmem.smp.store`'s diagram.

Commit records (:mod:`ftmem.smp.records`) follow the transitions under the same lock: written
at the commit without checksums (a commit the rank was told about survives the SMP's death
even before it is verified; a restarted SMP hashes it), rewritten with the checksums at
verification, removed before a slot's data is overwritten or dropped. A GRANTED slot keeps its
checksummed record: a restarted SMP adopts the older step it holds, and a load finds it
corrupt if the rank had begun to overwrite it.

Layouts are registered once per rank (:class:`~ftmem.format.layout.RegisteredLayout`, at most
``MAX_LAYOUTS``, validated then); a COMMIT names one by id and the verified layout document is
rendered from it and the checksums, never parsed again. The grant board
(:class:`ftmem.shm.GrantBoard`) is written under the lock too: pending when a conditional grant
is made, ready when a commit settles it, revoked when a pin takes the slot back; so ranks of a
node saving in lockstep still need one message per save.

The only I/O outside the lock writes a rebuilt snapshot into its new slot file (the slot is
ALLOCATING meanwhile, which nothing else touches).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ftmem import shm
from ftmem._logging import get_logger
from ftmem.config import MAX_SLOT_BYTES
from ftmem.errors import CorruptSnapshotError
from ftmem.format.layout import (
    RegisteredLayout,
    StoredSnapshot,
    parse_layout,
    register_layout,
    with_hashes,
)
from ftmem.format.record import CommitRecord, ManifestEntry, NodeManifest
from ftmem.protocol import messages as m
from ftmem.protocol.status import RankProgress
from ftmem.smp import records
from ftmem.smp.allocation import SlotFiles
from ftmem.smp.hashing import HashJob, HashResult
from ftmem.smp.store import (
    BeginDecision,
    RankPiece,
    RankSlots,
    Slot,
    SlotState,
)

log = get_logger(__name__)

MAX_RANK = 1 << 20
"""Ranks at or above this are refused (a malformed request must not grow the store)."""
MAX_LAYOUTS = 4
"""Layouts kept registered per rank (the oldest is forgotten; a COMMIT naming it then gets
a refusal of kind UNKNOWN_LAYOUT and the rank registers it again)."""


class UnknownLayoutError(ValueError):
    """A COMMIT named a layout id the SMP does not hold (the rank sends the layout again)."""


@dataclass(frozen=True, slots=True)
class Verified:
    """A slot the hasher verified; ``kept``: its piece, pinned once more for a flush."""

    kept: RankPiece | None = None


class SlotStore:
    """Every rank's slots, thread-safe (see the module docstring). ``submit_hash`` queues a
    committed slot's checksums (the slot stays pinned until :meth:`verify` gets the result).

    Error handling: a request that does not fit a slot's state raises :class:`StoreError`,
    one out of range raises ``ValueError``; nothing is changed then. A commit record that
    cannot be written is logged (the commit stands; only adoption after an SMP crash is lost).
    """

    def __init__(
        self, node: str, nslots: int, files: SlotFiles, submit_hash: Callable[[HashJob], None]
    ) -> None:
        self.node = node
        self.nslots = nslots
        self.files = files
        self._submit_hash = submit_hash
        self._ranks: dict[int, RankSlots] = {}
        self._world_size = 0
        self._board: shm.GrantBoard | None = None
        self._cells: dict[int, int] = {}
        """rank -> its byte on the grant board."""
        self._lock = threading.Lock()

    # -- ranks and queries -------------------------------------------------------------------
    def _rank(self, rank: int) -> RankSlots:
        if not 0 <= rank < MAX_RANK:
            raise ValueError(f"rank {rank} out of range")
        rs = self._ranks.get(rank)
        if rs is None:
            rs = self._ranks[rank] = RankSlots(rank=rank, nslots=self.nslots)
        return rs

    def all_ranks(self) -> list[int]:
        """Every rank this SMP has seen."""
        with self._lock:
            return sorted(self._ranks)

    def world_size(self) -> int:
        """The job's world size as the newest rank to say hello reported (0: unknown)."""
        with self._lock:
            return self._world_size

    def statuses(self) -> dict[int, RankProgress]:
        """Each rank's slots, progress and statistics (STATUS), by rank."""
        with self._lock:
            return {r: rs.status(r) for r, rs in sorted(self._ranks.items())}

    def describe_slots(self, rank: int) -> str:
        """One line on ``rank``'s slots (state, step, capacity, pins) for an error message."""
        with self._lock:
            return ", ".join(
                f"slot {s.index} {s.state.value} step {s.step} {s.capacity} B pinned {s.pinned}"
                for s in self._rank(rank).slots
            )

    def committed_steps(self) -> dict[str, list[int | None]]:
        """Each rank's committed steps, newest first."""
        with self._lock:
            return {str(r): [s.step for s in rs.committed()] for r, rs in self._ranks.items()}

    def snapshots(self, rank: int) -> list[m.SnapshotInfo] | None:
        """The verified snapshots of ``rank`` for a QUERY, newest first; None while one of
        its commits is still being hashed (the QUERY waits for it)."""
        with self._lock:
            rs = self._rank(rank)
            if rs.unverified():
                return None
            return [
                m.SnapshotInfo(s.step or 0, s.index, s.gen, s.path, s.capacity, s.layout)
                for s in rs.readable()
            ]

    def complete_steps(self, ranks: Iterable[int]) -> list[int]:
        """Steps every rank of ``ranks`` has committed and verified, newest first."""
        with self._lock:
            common: set[int] | None = None
            for r in ranks:
                rs = self._ranks.get(r)
                steps = {s.step for s in rs.keepable() if s.step is not None} if rs else set()
                common = steps if common is None else common & steps
            return sorted(common or (), reverse=True)

    # -- the ranks' requests -----------------------------------------------------------------
    def hello(
        self,
        rank: int,
        pid: int,
        world_size: int,
        *,
        in_process: bool = False,
        rejoined: bool = False,
    ) -> list[int]:
        """Rank ``rank`` (process ``pid``) said hello: free the slots it was writing (torn);
        return their indices. ``world_size`` > 0 replaces the job's world size; see
        :class:`~ftmem.protocol.messages.Hello` for the flags."""
        with self._lock:
            rs = self._rank(rank)
            if world_size > 0:
                self._world_size = world_size
            rs.in_process = in_process
            return rs.restarted(pid, rejoined=rejoined)

    def progress(self, rank: int, step: int | None) -> None:
        """Rank ``rank`` made progress (a save or a heartbeat)."""
        with self._lock:
            self._rank(rank).progress(step)

    def count_skip(self, rank: int, reason: str) -> None:
        """Count one skipped snapshot of ``rank`` for ``reason``."""
        with self._lock:
            self._rank(rank).count_skip(reason)

    def begin(self, rank: int, step: int, nbytes: int) -> m.BeginReply:
        """Choose the slot ``rank`` writes ``step`` (``nbytes``) into (:meth:`RankSlots.begin`);
        a slot handed out for writing loses its commit record."""
        with self._lock:
            rs = self._rank(rank)
            held = rs.granted()
            return self._grant_of(rs, rs.begin(step, nbytes), held)

    def grant(self, rank: int, nbytes: int) -> m.BeginReply:
        """Promise a slot of ``nbytes`` to ``rank``'s next save (:meth:`RankSlots.grant`); a
        conditional grant comes with the rank's cell on the grant board (pending until a
        commit settles it), and without a board (it cannot be made) nothing is granted."""
        with self._lock:
            rs = self._rank(rank)
            held = rs.granted()
            reply = self._grant_of(rs, rs.grant(nbytes, needed=self._needed()), held)
            if rs.grant_after is None:
                return reply
            try:
                board, cell = self._cell(rank)
            except (OSError, ValueError) as exc:
                log.warning("[%s/smp] no grant board: %s", self.node, exc)
                rs.release_grant()
                return m.BeginReply(m.Decision.SKIP, reason=f"step {rs.grant_after} may be needed")
            board.set(cell, shm.GRANT_PENDING)
            return dataclasses.replace(reply, board=str(board.path), cell=cell)

    def _needed(self) -> int | None:
        """The oldest of the ranks' newest committed steps (None: no rank has one): the newest
        step every rank of this node may have in common."""
        newest = [rs.newest() for rs in self._ranks.values()]
        steps = [n.step for n in newest if n is not None and n.step is not None]
        return min(steps) if steps else None

    def _cell(self, rank: int) -> tuple[shm.GrantBoard, int]:
        """The grant board (made now if it is the first) and ``rank``'s cell on it."""
        if self._board is None:
            self._board = shm.GrantBoard(self.files.board_path())
        cell = self._cells.get(rank)
        if cell is None:
            if len(self._cells) >= shm.BOARD_CELLS:
                raise ValueError(f"more than {shm.BOARD_CELLS} ranks on one node")
            cell = self._cells[rank] = len(self._cells)
        return self._board, cell

    def _settle(self) -> None:
        """Mark ready every conditional grant whose step every rank has committed past."""
        needed = self._needed()
        for r, rs in self._ranks.items():
            if rs.settle(needed) and self._board is not None:
                self._board.set(self._cells[r], shm.GRANT_READY)

    def close(self) -> None:
        """Remove the grant board (the slot files are the caller's)."""
        with self._lock:
            if self._board is not None:
                self._board.close()

    @staticmethod
    def _grant_of(rs: RankSlots, d: BeginDecision, held: Slot | None) -> m.BeginReply:
        """The reply to ``rs``'s decision ``d``. Removes the records of the slots whose data
        goes: the one handed out for writing, and ``held`` (the slot granted before ``d``) if
        ``d`` freed it (a dead process's grant: maybe torn)."""
        if held is not None and held.state is SlotState.FREE:
            records.remove_record(held.path)
        if d.action is m.Decision.SKIP:
            return m.BeginReply(m.Decision.SKIP, reason=d.reason)
        s = rs.slot(d.slot)
        if s.state is SlotState.WRITING or (s.state is SlotState.GRANTED and s.step is None):
            records.remove_record(s.path)  # its old data is about to be overwritten
        return m.BeginReply(d.action, s.index, s.gen, s.path, s.capacity)

    def register(self, rank: int, layout_id: int, text: str) -> RegisteredLayout:
        """Validate and keep ``rank``'s layout ``layout_id`` (its ``tensors`` array); the
        oldest of more than ``MAX_LAYOUTS`` is forgotten.

        Raises:
            ValueError: a bad id, or a layout that does not validate.
        """
        if not 0 < layout_id < 1 << 62:
            raise ValueError(f"layout id {layout_id} out of range")
        try:
            reg = register_layout(text, MAX_SLOT_BYTES)
        except CorruptSnapshotError as exc:
            raise ValueError(str(exc)) from exc
        with self._lock:
            held = self._rank(rank).layouts
            held.pop(layout_id, None)
            held[layout_id] = reg
            while len(held) > MAX_LAYOUTS:
                del held[next(iter(held))]
        return reg

    def commit(self, c: m.Commit) -> StoredSnapshot:
        """Commit ``c.step`` into slot ``c.slot`` of ``c.rank`` as its registered layout
        ``c.layout_id`` says, write its record and queue its checksums. Return the snapshot's
        layout as checked against the slot.

        Raises:
            UnknownLayoutError: ``c.layout_id`` is not registered for ``c.rank``.
            ValueError: the layout does not fit the slot.
            StoreError: the slot is not being written with ``step`` and ``gen`` (or granted).
        """
        with self._lock:
            rs = self._rank(c.rank)
            reg = rs.layouts.get(c.layout_id)
            if reg is None:
                raise UnknownLayoutError(f"unknown layout {c.layout_id} of rank {c.rank}")
            s = rs.slot(c.slot)
            objects = (c.objects_offset, c.objects_nbytes)
            try:
                snap = reg.snapshot(c.step, objects, c.unsharded_nbytes, s.capacity)
            except CorruptSnapshotError as exc:
                raise ValueError(str(exc)) from exc
            rs.commit(c.slot, c.gen, c.step, snap, reg)
            self._write_record(rs, s)
            self._hash(rs, s, snap)
            rs.progress(c.step)
            rs.commit_stats(c.stall_s, c.copy_s, c.skipped)
            self._settle()
            return snap

    def abort(self, rank: int, index: int, gen: int) -> None:
        """Give back the slot whose copy failed (ignored if it was replaced since)."""
        with self._lock:
            rs = self._rank(rank)
            s = rs.slot(index)
            rs.abort(index, gen)
            if s.state is SlotState.FREE:
                records.remove_record(s.path)

    def discard_newer(self, rank: int, step: int) -> list[int]:
        """``rank`` restored ``step``: drop its unpinned committed slots of newer steps (and
        their records); return the steps dropped. Marks the rank's restore as done."""
        with self._lock:
            rs = self._rank(rank)
            for sl in rs.newer_unpinned(step):
                records.remove_record(sl.path)
            dropped = rs.discard_newer(step)
            rs.restored_time, rs.restored_step = time.time(), step
            return dropped

    # -- allocation --------------------------------------------------------------------------
    def start_resize(self, rank: int, index: int, capacity: int) -> list[tuple[int, str, int]]:
        """Mark slot ``index`` (none if negative) of ``rank`` ALLOCATING for a file of
        ``capacity`` bytes, and every other slot :meth:`RankSlots.growable` names. Return
        (index, old path, new gen) of each; the caller replaces the files, then calls
        :meth:`finish_resize`.

        Raises:
            StoreError: slot ``index`` is the newest committed, pinned, or busy (nothing
                changed).
        """
        with self._lock:
            rs = self._rank(rank)
            targets = [] if index < 0 else [rs.start_resize(index)]
            targets += [rs.start_resize(s.index) for s in rs.growable(capacity, but=index)]
            return [(s.index, s.path, s.gen + 1) for s in targets]

    def finish_resize(self, rank: int, index: int, path: str, capacity: int, ok: bool) -> None:
        """The new file of an ALLOCATING slot exists (``ok``) or could not be made."""
        with self._lock:
            self._rank(rank).finish_resize(index, path, capacity, ok)

    # -- verification ------------------------------------------------------------------------
    def _hash(self, rs: RankSlots, sl: Slot, snap: StoredSnapshot) -> None:
        """Pin a committed slot and queue its checksums (lock held)."""
        assert sl.step is not None
        rs.pin(sl.index)
        self._submit_hash(HashJob(rs.rank, sl.index, sl.gen, sl.step, sl.path, snap))

    def verify(self, result: HashResult, keep: bool = False) -> Verified | None:
        """Take a hash result: the hasher's pin goes; the slot gets its checksummed layout and
        record, or is dropped if it could not be hashed. ``keep``: pin a verified slot once
        more for a scheduled flush (its piece in ``kept``). None if nothing was verified."""
        job = result.job
        with self._lock:
            rs = self._ranks.get(job.rank)
            if rs is None:
                return None
            sl = rs.slot(job.slot)
            rs.unpin(job.slot, job.gen)
            if result.error:
                log.error(
                    "[%s/%d %d] cannot verify slot %d: %s; dropped",
                    self.node,
                    job.rank,
                    job.step,
                    job.slot,
                    result.error,
                )
                if sl.gen == job.gen and not sl.pinned:
                    records.remove_record(sl.path)
                    rs.drop(job.slot, job.gen)
                return None
            if sl.gen != job.gen or sl.step != job.step:
                return None  # replaced or dropped while it was hashed
            if sl.template is not None:
                layout = sl.template.render(job.snap, result.digests)
            else:  # an adopted or rebuilt snapshot: its whole document, without checksums
                layout = with_hashes(sl.layout, result.digests[1:], result.digests[0])
            if not rs.verify(job.slot, job.gen, job.step, layout):
                return None
            rs.last_hash_s = result.seconds
            self._write_record(rs, sl)
            if not keep:
                return Verified()
            rs.pin(sl.index)
            return Verified(sl.piece(job.rank, job.snap.used_bytes))  # same extents

    # -- pins: the exchange and the flush ----------------------------------------------------
    def pin_step(self, ranks: Iterable[int], step: int) -> list[RankPiece] | None:
        """Pin every rank's verified slot of ``step`` (a conditionally granted one is revoked
        first); None (nothing pinned) if a rank has none. Each piece is one pin, given back
        with :meth:`unpin`."""
        with self._lock:
            chosen: list[tuple[RankSlots, Slot]] = []
            for r in ranks:
                rs = self._ranks.get(r)
                found = [s for s in rs.keepable() if s.step == step] if rs else []
                if rs is None or not found:
                    return None
                chosen.append((rs, found[0]))
            pieces = []
            for rs, sl in chosen:
                if rs.revoke(sl.index) and self._board is not None:
                    self._board.set(self._cells[rs.rank], shm.GRANT_REVOKED)
                rs.pin(sl.index)
                used = (sl.snap or parse_layout(sl.layout, sl.capacity)).used_bytes
                pieces.append(sl.piece(rs.rank, used))
            return pieces

    def unpin(self, pieces: Iterable[RankPiece]) -> None:
        """Give back one pin per piece (slots replaced since are left alone)."""
        with self._lock:
            for p in pieces:
                rs = self._ranks.get(p.rank)
                if rs is not None:
                    rs.unpin(p.slot, p.gen)

    # -- rebuild and adoption ----------------------------------------------------------------
    def install_rebuilt(
        self, step: int, manifest: NodeManifest, data: memoryview
    ) -> list[RankPiece]:
        """Write each rebuilt rank's bytes into a new slot file, commit it and pin it once
        (for the exchange); return the pieces. A layout without checksums is hashed like a
        commit.

        Raises:
            ValueError: the manifest does not describe ``data`` (nothing is installed).
            OSError: a slot file cannot be made (e.g. /dev/shm is full).
            StoreError: a rank has no slot that may take the rebuilt snapshot.
        """
        spans = _spans(manifest, data.nbytes)
        return [self._install(step, e, snap, data[off : off + e.nbytes]) for off, e, snap in spans]

    def _install(
        self, step: int, e: ManifestEntry, snap: StoredSnapshot, data: memoryview
    ) -> RankPiece:
        with self._lock:
            rs = self._rank(e.rank)
            sl = rs.start_rebuild(step)
            index, old, gen = sl.index, sl.path, sl.gen + 1
        path = self.files.path(e.rank, index, gen)
        if old:
            self.files.discard(old)
        try:
            shm.create_segment(path, e.capacity)
            shm.write_segment(path, data)
        except BaseException:
            with self._lock:
                rs.finish_resize(index, "", 0, ok=False)
            shm.remove_segment(path)
            raise
        with self._lock:
            # Its checksums came with the manifest; the ranks verify them again at load.
            sl = rs.finish_rebuild(index, str(path), e.capacity, step, e.layout, snap)
            self._write_record(rs, sl)
            if not snap.verified:
                self._hash(rs, sl, snap)
            piece = sl.piece(e.rank, e.nbytes)
        log.info("[%s/%d %d] rebuilt slot %d (%d bytes)", self.node, e.rank, step, index, e.nbytes)
        return piece

    def adopt_left(self) -> list[records.Adoptable]:
        """Take over the committed slots a previous SMP of this node left (hashing those not
        verified yet); remove every other file of this run and node. Return the adopted ones.

        Raises:
            StoreError: a slot to adopt is not EMPTY or FREE (adopting twice).
        """
        adopted = []
        with self._lock:
            for a in self.files.adoptable(self.nslots):
                r = a.record
                try:
                    snap = parse_layout(r.layout, r.capacity)
                    rs = self._rank(r.rank)
                    rs.adopt(r.slot, r.gen, str(a.path), r.capacity, r.step, r.seq, r.layout, snap)
                    if not snap.verified:  # committed, not yet hashed when the previous SMP died
                        self._hash(rs, rs.slot(r.slot), snap)
                # e.g. a rank out of range, or a layout that does not parse: drop it, start anyway
                except (ValueError, CorruptSnapshotError) as exc:
                    log.warning("[%s/smp] not adopting %s: %s", self.node, a.path.name, exc)
                    self.files.discard(a.path)
                    continue
                adopted.append(a)
        return adopted

    def _write_record(self, rs: RankSlots, sl: Slot) -> None:
        """Write the commit record of a committed slot (lock held)."""
        assert sl.step is not None
        layout = sl.layout
        if not layout and sl.template is not None and sl.snap is not None:
            layout = sl.template.render_unverified(sl.snap)
        try:
            rec = CommitRecord(rs.rank, sl.index, sl.gen, sl.capacity, sl.step, sl.seq, layout)
            records.write_record(sl.path, rec)
        except OSError as exc:  # the commit stands; only adoption after an SMP crash is lost
            log.warning(
                "[%s/%d %d] cannot write commit record: %s", self.node, rs.rank, sl.step, exc
            )


def _spans(manifest: NodeManifest, nbytes: int) -> list[tuple[int, ManifestEntry, StoredSnapshot]]:
    """Each rank's part of a rebuilt node's ``nbytes`` of data, as its manifest says: its
    offset, its entry and its checked layout.

    Raises:
        ValueError: the manifest does not cover exactly ``nbytes``, or an entry's layout
            does not fit its slot.
    """
    spans, off = [], 0
    for e in manifest.ranks:
        try:
            snap = parse_layout(e.layout, e.capacity)
        except CorruptSnapshotError as exc:
            raise ValueError(f"manifest entry of rank {e.rank}: {exc}") from exc
        if not (e.nbytes <= e.capacity and snap.used_bytes == e.nbytes):
            raise ValueError(f"manifest entry of rank {e.rank} does not fit its slot")
        spans.append((off, e, snap))
        off += e.nbytes
    if off != nbytes:
        raise ValueError(f"manifest covers {off} bytes, the rebuilt data has {nbytes}")
    return spans
