"""Per-rank snapshot slots and their state machine (pure: no sockets, no files, no locks).

:class:`RankSlots` holds one rank's slots; :class:`~ftmem.smp.slot_store.SlotStore` holds every
rank's behind one lock and is the only way the SMP's threads change them. Every transition of
a slot, with the method that makes it (the same name on both classes)::

    EMPTY ------start_resize------> ALLOCATING --finish_resize (file made)--> FREE
    FREE -------start_resize------> ALLOCATING --finish_resize (failed)-----> EMPTY
    COMMITTED --start_resize------> ALLOCATING     (not the newest, not pinned: a rank's PREPARE)
    EMPTY / FREE / COMMITTED --start_rebuild--> ALLOCATING
                                                   (not pinned; a COMMITTED one may be the newest,
                                                    or hold the rebuilt step already)
    ALLOCATING --finish_rebuild--> COMMITTED       (verified if the manifest had checksums; pinned)
    FREE ---------------------begin--> WRITING
    COMMITTED / GRANTED ------begin--> WRITING     (not the newest, not pinned)
    FREE / COMMITTED ---------grant--> GRANTED     (at a COMMIT, for the rank's next save:
                                                    not the newest, not pinned, verified;
                                                    conditional while its step may be needed)
    GRANTED (conditional) ----settle--> GRANTED    (every rank of the node committed past
                                                    its step: the rank may write it)
    GRANTED (conditional) ----revoke--> COMMITTED  (a pin wants its step first)
    GRANTED ------------------begin--> COMMITTED   (an explicit BEGIN gives the grant back;
                                                    FREE if a restarted rank asks: maybe torn)
    WRITING / GRANTED --commit--> COMMITTED        (unverified; the hasher pins it meanwhile)
    WRITING --abort / restarted (the rank's copy failed, or the rank restarted: torn)--> FREE
    GRANTED --abort--> FREE                        (the copy into it failed: maybe torn)
    COMMITTED --verify--> COMMITTED                (verified: the layout carries the checksums)
    COMMITTED --drop (hashing failed, not pinned)--> FREE
    COMMITTED --discard_newer (a newer step of an abandoned run, not pinned)--> FREE
    EMPTY / FREE --adopt (a previous SMP's commit record)--> COMMITTED
    COMMITTED --pin / unpin--> COMMITTED           (pins counted; only COMMITTED slots are pinned)

Any other request raises :class:`StoreError` (a stale gen or step, a wrong state, a bad
index), except the expected late ones, which are ignored: an abort, drop, verify or unpin of a
slot replaced since (its gen moved on).

A GRANTED slot is promised to the rank's next save, which writes it without asking again (the
reply to the COMMIT of step N grants the slot for N+1: one message per save). Until that save
commits, the slot may still hold its older ``step``: loads may read it (they check every
checksum, so a copy begun meanwhile is seen as corrupt), but it is never pinned, protected or
flushed. A grant is *conditional* (``grant_after``) while that older step may still be the
newest every rank of the node has committed: the rank writes the slot only once the grant
board says ready (``settle``: every rank committed a newer step); until then a pin of that
step takes the slot back (``revoke``). Ready is final.

A COMMITTED slot is *verified* once the SMP has checksummed it (the hasher pins it meanwhile);
only verified snapshots are served to loads, protected and flushed. The newest committed slot
of a rank is never handed out for writing, so a crash at any moment leaves it intact: with no
other slot available the save is skipped (counted per reason), never waited for. Pinned slots
(hasher, peer exchange, flush) are never written, resized or dropped.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ftmem.format.layout import RegisteredLayout, StoredSnapshot
from ftmem.protocol.messages import Decision
from ftmem.protocol.status import RankProgress, SlotStatus


class SlotState(enum.Enum):
    """Life-cycle state of one slot."""

    EMPTY = "empty"
    ALLOCATING = "allocating"
    FREE = "free"
    WRITING = "writing"
    GRANTED = "granted"
    COMMITTED = "committed"


@dataclass(slots=True)
class Slot:
    """One slot: a shared-memory file and what it holds."""

    index: int
    state: SlotState = SlotState.EMPTY
    gen: int = 0
    path: str = ""
    capacity: int = 0
    step: int | None = None
    layout: str = ""
    """The committed snapshot's layout document once verified (with every checksum)."""
    snap: StoredSnapshot | None = None
    """The committed snapshot's parsed layout (checksums not needed: extents and sizes)."""
    template: RegisteredLayout | None = None
    """The registered layout it was committed with (None: ``layout`` holds the whole
    document, e.g. an adopted or rebuilt snapshot); the checksums are filled into it."""
    seq: int = 0
    """Commit sequence number: larger means committed later."""
    pinned: int = 0
    """Holders (hasher, peer exchange, flush) that need the data kept."""
    verified: bool = False
    """COMMITTED and checksummed by the SMP (the layout carries every extent's hash)."""

    def clear(self, state: SlotState, step: int | None = None) -> None:
        """Move to ``state``, holding ``step`` (None: nothing), without layout or checksums."""
        self.state, self.step, self.layout, self.snap = state, step, "", None
        self.verified, self.template = False, None

    def status(self) -> SlotStatus:
        """This slot in the SMP's STATUS (no layout)."""
        return SlotStatus(
            self.index, self.state.value, self.gen, self.capacity, self.step, self.pinned,
            self.verified,
        )  # fmt: skip

    def piece(self, rank: int, used: int) -> RankPiece:
        """This slot as ``rank``'s piece of its step, of which the snapshot uses ``used``."""
        return RankPiece(rank, self.index, self.gen, self.path, self.capacity, used, self.layout)


def _newest_first(slots: Iterable[Slot]) -> list[Slot]:
    """``slots`` by step, newest first (ties: the later commit first)."""
    return sorted(slots, key=lambda s: (s.step or 0, s.seq), reverse=True)


@dataclass(frozen=True, slots=True)
class BeginDecision:
    """What :meth:`RankSlots.begin` decided: write into ``slot``, ``resize`` it, or ``skip``."""

    action: Decision
    slot: int = -1
    reason: str = ""


class StoreError(Exception):
    """A request does not fit the slot's state (stale gen, wrong state, bad index)."""


@dataclass(frozen=True, slots=True)
class RankPiece:
    """One rank's committed slot of a step and how much of it the snapshot uses; one pin of
    that slot, given back with :meth:`~ftmem.smp.slot_store.SlotStore.unpin`."""

    rank: int
    slot: int
    gen: int
    path: str
    capacity: int
    used: int
    layout: str


@dataclass(slots=True)
class RankSlots:
    """All slots of one rank plus its progress and statistics (fields named as in its STATUS
    entry, :class:`~ftmem.protocol.status.RankProgress`, mean the same)."""

    rank: int
    nslots: int
    slots: list[Slot] = field(default_factory=list)
    pid: int | None = None
    last_progress_time: float | None = None
    last_progress_step: int | None = None
    skipped: int = 0
    last_stall_s: float = 0.0
    last_copy_s: float = 0.0
    commits: int = 0
    skips: dict[str, int] = field(default_factory=dict)
    last_hash_s: float = 0.0
    hello_time: float | None = None
    restored_time: float | None = None
    restored_step: int | None = None
    first_progress_time: float | None = None
    in_process: bool = False
    granted_to: int | None = None
    """The pid of the process the GRANTED slot was promised to."""
    grant_after: int | None = None
    """Set while the grant is conditional: the step its slot holds (see the module docstring)."""
    layouts: dict[int, RegisteredLayout] = field(default_factory=dict)
    """Registered layouts by id (SlotStore keeps at most MAX_LAYOUTS, oldest first)."""
    _seq: int = 0

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [Slot(index=i) for i in range(self.nslots)]

    # -- queries ---------------------------------------------------------------------------
    def committed(self) -> list[Slot]:
        """Committed slots, newest step first (ties: later commit first)."""
        return _newest_first(s for s in self.slots if s.state is SlotState.COMMITTED)

    def keepable(self) -> list[Slot]:
        """The verified slots a pin may take, newest step first: the committed ones and a
        conditionally granted one (a pin revokes its grant, :meth:`revoke`)."""
        g = self.granted() if self.grant_after is not None else None
        return _newest_first(
            s
            for s in self.slots
            if s.verified and (s.state is SlotState.COMMITTED or (s is g and s.step is not None))
        )

    def unverified(self) -> list[Slot]:
        """Committed slots the SMP has not checksummed yet."""
        return [s for s in self.slots if s.state is SlotState.COMMITTED and not s.verified]

    def count_skip(self, reason: str) -> None:
        """Count one skipped snapshot for ``reason``."""
        self.skips[reason] = self.skips.get(reason, 0) + 1
        self.skipped += 1

    def newest(self) -> Slot | None:
        """The most recently committed slot, or None."""
        done = [s for s in self.slots if s.state is SlotState.COMMITTED]
        return max(done, key=lambda s: s.seq) if done else None

    def newer_unpinned(self, step: int) -> list[Slot]:
        """Committed (or granted) slots of a step newer than ``step`` that no one holds
        (what :meth:`discard_newer` frees)."""
        return [
            s
            for s in self.slots
            if s.state in (SlotState.COMMITTED, SlotState.GRANTED)
            and s.step is not None
            and s.step > step
            and not s.pinned
        ]

    def readable(self) -> list[Slot]:
        """Verified slots a load may read, newest step first: the committed ones and those
        granted to the next save that still hold their older step."""
        held = (SlotState.COMMITTED, SlotState.GRANTED)
        return _newest_first(
            s for s in self.slots if s.verified and s.step is not None and s.state in held
        )

    def growable(self, capacity: int, but: int = -1) -> list[Slot]:
        """Slots (other than ``but``) smaller than ``capacity`` that a PREPARE may grow, so
        the next saves need no resize: EMPTY, FREE, GRANTED, and COMMITTED ones that are
        neither the newest nor pinned (the newest committed snapshot always survives)."""
        newest = self.newest()
        return [
            s
            for s in self.slots
            if s.index != but
            and s is not newest
            and not s.pinned
            and s.state in (SlotState.FREE, SlotState.EMPTY, SlotState.GRANTED, SlotState.COMMITTED)
            and s.capacity < capacity
        ]

    def slot(self, index: int) -> Slot:
        """Return slot ``index`` or raise StoreError."""
        if not 0 <= index < len(self.slots):
            raise StoreError(f"rank {self.rank} has no slot {index}")
        return self.slots[index]

    # -- transitions -----------------------------------------------------------------------
    def progress(self, step: int | None, now: float | None = None) -> None:
        """Record that the rank made progress (a save or a heartbeat)."""
        self.last_progress_time = time.time() if now is None else now
        if self.first_progress_time is None and self.hello_time is not None:
            self.first_progress_time = self.last_progress_time
        if step is not None:
            self.last_progress_step = step

    def restarted(self, pid: int, rejoined: bool = False) -> list[int]:
        """The rank (re)started (``rejoined``: the same process, in process): free the slots
        it was writing (torn); return their indices."""
        if pid != self.pid or self.hello_time is None or rejoined:  # this process's phases
            self.hello_time, self.restored_time, self.first_progress_time = time.time(), None, None
            self.restored_step = None
        self.pid = pid
        torn = []
        for s in self.slots:
            if s.state is SlotState.WRITING:
                s.clear(SlotState.FREE)
                torn.append(s.index)
        return torn

    def begin(self, step: int, nbytes: int) -> BeginDecision:
        """Choose the slot to write ``step`` (``nbytes``) into, never the newest; a slot
        granted to this save is given back first."""
        if any(s.state is SlotState.WRITING for s in self.slots):
            return BeginDecision(Decision.SKIP, reason="a copy is still being written")
        self.release_grant()
        target = self._choose(nbytes)
        if target.action is not Decision.WRITE:
            return target
        s = self.slots[target.slot]
        s.clear(SlotState.WRITING, step)
        return target

    def grant(self, nbytes: int, needed: int | None = None) -> BeginDecision:
        """Promise a slot of at least ``nbytes`` to the rank's next save (-> GRANTED, keeping
        its older step until that save commits); a ``resize`` or ``skip`` grants nothing.
        ``needed``: the newest step every rank of the node has committed; a slot holding it
        or a newer one is granted conditionally (``grant_after``, see the module docstring)."""
        self.release_grant()
        d = self._choose(nbytes)
        if d.action is Decision.WRITE:
            s = self.slots[d.slot]
            if s.state is SlotState.FREE:
                s.clear(SlotState.GRANTED)
            s.state = SlotState.GRANTED
            self.granted_to = self.pid
            if s.step is not None and needed is not None and s.step >= needed:
                self.grant_after = s.step
        return d

    def settle(self, needed: int | None) -> bool:
        """A conditional grant becomes ready once ``needed`` (the newest step every rank of
        the node has committed) is past its slot's step; True if it just did."""
        if self.grant_after is None or needed is None or needed <= self.grant_after:
            return False
        self.grant_after = None
        return True

    def revoke(self, index: int) -> bool:
        """Take back slot ``index`` if it is conditionally granted (-> COMMITTED, its step
        intact: the rank has not been told it may write it); True if it was."""
        s = self.slot(index)
        if s.state is not SlotState.GRANTED or self.grant_after is None:
            return False
        s.state, self.grant_after = SlotState.COMMITTED, None
        return True

    def granted(self) -> Slot | None:
        """The slot granted to the rank's next save, if any."""
        return next((s for s in self.slots if s.state is SlotState.GRANTED), None)

    def release_grant(self) -> Slot | None:
        """Give back the slot granted to the next save (None: none): COMMITTED again if it
        holds a step and the process it was promised to asks (it did not write it), else FREE
        (a process that died may have begun to write it)."""
        s = self.granted()
        self.grant_after = None
        if s is not None:
            if s.step is not None and self.granted_to == self.pid:
                s.state = SlotState.COMMITTED
            else:
                s.clear(SlotState.FREE)
        return s

    def _choose(self, nbytes: int) -> BeginDecision:
        """The slot a save of ``nbytes`` may write: never the newest committed or a pinned
        one; never-committed slots first, then the oldest committed one."""
        newest = self.newest()
        usable = [
            s
            for s in self.slots
            if s.pinned == 0
            and s is not newest
            and s.state in (SlotState.FREE, SlotState.EMPTY, SlotState.COMMITTED)
        ]
        if not usable:
            if any(s.state is SlotState.ALLOCATING for s in self.slots):
                return BeginDecision(Decision.SKIP, reason="slots are being allocated")
            return BeginDecision(Decision.SKIP, reason="no slot is free (all held)")
        usable.sort(key=lambda s: (s.state is SlotState.COMMITTED, s.seq))
        fitting = [s for s in usable if s.state is not SlotState.EMPTY and s.capacity >= nbytes]
        if not fitting:
            return BeginDecision(Decision.RESIZE, slot=usable[0].index)
        return BeginDecision(Decision.WRITE, slot=fitting[0].index)

    def commit(
        self,
        index: int,
        gen: int,
        step: int,
        snap: StoredSnapshot | None = None,
        template: RegisteredLayout | None = None,
    ) -> None:
        """Mark slot ``index`` committed with ``step`` and its parsed layout: a slot being
        written with ``step``, or the slot granted to this save."""
        s = self.slot(index)
        granted = s.state is SlotState.GRANTED
        if not (granted or (s.state is SlotState.WRITING and s.step == step)) or s.gen != gen:
            raise StoreError(
                f"commit of step {step} to slot {index} gen {gen} does not match "
                f"its state {s.state.value} step {s.step} gen {s.gen}"
            )
        if granted:
            self.grant_after = None
        self._seq += 1
        s.state, s.step, s.layout, s.snap = SlotState.COMMITTED, step, "", snap
        s.seq, s.verified, s.template = self._seq, False, template
        self.commits += 1

    def commit_stats(self, stall_s: float, copy_s: float, skipped: int) -> None:
        """Record what the rank reported with its commit (its own skip count may be ahead)."""
        self.last_stall_s, self.last_copy_s = stall_s, copy_s
        self.skipped = max(self.skipped, skipped)

    def verify(self, index: int, gen: int, step: int, layout: str) -> bool:
        """The SMP checksummed slot ``index``: store the layout with its checksums. False if
        the slot was replaced or dropped meanwhile (the result is stale)."""
        s = self.slot(index)
        if s.state is not SlotState.COMMITTED or s.gen != gen or s.step != step:
            return False
        s.layout, s.verified, s.template = layout, True, None
        return True

    def drop(self, index: int, gen: int) -> None:
        """Forget a committed slot that cannot be verified (its data is treated as lost)."""
        s = self.slot(index)
        if s.state is SlotState.COMMITTED and s.gen == gen:
            s.clear(SlotState.FREE)

    def abort(self, index: int, gen: int) -> None:
        """Give back a slot whose copy failed (written, or granted: maybe torn either way)."""
        s = self.slot(index)
        if s.state in (SlotState.WRITING, SlotState.GRANTED) and s.gen == gen:
            if s.state is SlotState.GRANTED:
                self.grant_after = None
            s.clear(SlotState.FREE)

    def discard_newer(self, step: int) -> list[int]:
        """Free committed slots with a step newer than ``step``; return the steps dropped."""
        dropped = []
        for s in self.newer_unpinned(step):
            assert s.step is not None
            dropped.append(s.step)
            s.clear(SlotState.FREE)
        return dropped

    def start_resize(self, index: int) -> Slot:
        """Mark a reusable slot ALLOCATING (its file is about to be replaced)."""
        s = self.slot(index)
        if s is self.newest() or s.pinned or s.state in (SlotState.WRITING, SlotState.ALLOCATING):
            raise StoreError(f"slot {index} of rank {self.rank} cannot be resized now")
        if s.state is SlotState.GRANTED:
            self.grant_after = None
        s.clear(SlotState.ALLOCATING)
        return s

    def finish_resize(self, index: int, path: str, capacity: int, ok: bool) -> None:
        """The new file of slot ``index`` exists (ok: FREE) or could not be made (EMPTY again).

        Raises:
            StoreError: the slot is not ALLOCATING.
        """
        s = self._allocating(index)
        s.gen += 1
        if ok:
            s.state, s.path, s.capacity = SlotState.FREE, path, capacity
        else:
            s.state, s.path, s.capacity = SlotState.EMPTY, "", 0

    def start_rebuild(self, step: int) -> Slot:
        """Mark ALLOCATING the slot a rebuilt snapshot of ``step`` goes into: one holding
        ``step`` (maybe stale), else a free one, else the oldest committed one (the newest only
        if nothing else is left), never a pinned, written, granted or allocating one.

        Raises:
            StoreError: every slot is pinned, written or allocating.
        """
        newest = self.newest()
        candidates = [
            s
            for s in self.slots
            if not s.pinned
            and s.state not in (SlotState.WRITING, SlotState.ALLOCATING, SlotState.GRANTED)
        ]
        holding = [s for s in candidates if s.state is SlotState.COMMITTED and s.step == step]
        free = [s for s in candidates if s.state in (SlotState.FREE, SlotState.EMPTY)]
        older = sorted((s for s in candidates if s is not newest), key=lambda s: s.seq)
        ranked = holding or free or older or candidates
        if not ranked:
            raise StoreError(f"rank {self.rank} has no slot to take a rebuilt snapshot")
        chosen = ranked[0]
        chosen.clear(SlotState.ALLOCATING)
        return chosen

    def finish_rebuild(
        self, index: int, path: str, capacity: int, step: int, layout: str, snap: StoredSnapshot
    ) -> Slot:
        """The rebuilt snapshot of ``step`` is in slot ``index``'s new file: commit it as the
        newest commit and pin it once (for the exchange).

        Raises:
            StoreError: the slot is not ALLOCATING.
        """
        s = self._allocating(index)
        s.gen += 1
        s.path, s.capacity = path, capacity
        self._install(s, step, self.next_seq(), layout, snap)
        return self.pin(index)

    def adopt(
        self,
        index: int,
        gen: int,
        path: str,
        capacity: int,
        step: int,
        seq: int,
        layout: str,
        snap: StoredSnapshot,
    ) -> None:
        """Take over a committed slot left by a previous SMP of this node (see records.py).

        Raises:
            StoreError: the slot is neither EMPTY nor FREE.
        """
        s = self.slot(index)
        if s.state not in (SlotState.EMPTY, SlotState.FREE):
            raise StoreError(f"slot {index} of rank {self.rank} is {s.state.value}: not adopted")
        s.gen, s.path, s.capacity = gen, path, capacity
        self._install(s, step, seq, layout, snap)

    def _install(self, s: Slot, step: int, seq: int, layout: str, snap: StoredSnapshot) -> None:
        """Commit ``s`` as holding ``snap`` (verified when its layout carries every checksum)."""
        s.state, s.template = SlotState.COMMITTED, None
        s.step, s.seq, s.layout, s.verified, s.snap = step, seq, layout, snap.verified, snap
        self._seq = max(self._seq, seq)

    def _allocating(self, index: int) -> Slot:
        s = self.slot(index)
        if s.state is not SlotState.ALLOCATING:
            raise StoreError(f"slot {index} of rank {self.rank} is {s.state.value}, not allocating")
        return s

    def pin(self, index: int) -> Slot:
        """Count one more holder of committed slot ``index`` (it is kept until unpinned).

        Raises:
            StoreError: the slot is not COMMITTED.
        """
        s = self.slot(index)
        if s.state is not SlotState.COMMITTED:
            raise StoreError(f"slot {index} of rank {self.rank} is {s.state.value}: not pinned")
        s.pinned += 1
        return s

    def unpin(self, index: int, gen: int) -> bool:
        """Count one holder of slot ``index`` (generation ``gen``) less; False (nothing
        changed) if the slot was replaced since or holds no pin."""
        s = self.slot(index)
        if s.gen != gen or s.pinned <= 0:
            return False
        s.pinned -= 1
        return True

    def next_seq(self) -> int:
        """A commit sequence number newer than every slot's (for a slot installed by a rebuild)."""
        self._seq += 1
        return self._seq

    def status(self, rank: int) -> RankProgress:
        """This rank's entry in the SMP's STATUS."""
        newest = self.newest()
        committed = self.committed()
        snap = newest.snap if newest else None
        held = sum(t.nbytes for t in snap.tensors) + snap.objects_nbytes if snap else 0
        return RankProgress(
            rank=rank,
            pid=self.pid,
            last_progress_time=self.last_progress_time,
            last_progress_step=self.last_progress_step,
            newest_committed=newest.step if newest else None,
            hello_time=self.hello_time,
            restored_time=self.restored_time,
            restored_step=self.restored_step,
            first_progress_time=self.first_progress_time,
            in_process=self.in_process,
            committed_steps=[s.step or 0 for s in committed],
            newest_verified=max((s.step or 0 for s in committed if s.verified), default=None),
            verified_steps=[s.step or 0 for s in committed if s.verified],
            commits=self.commits,
            skipped=self.skipped,
            skips=dict(self.skips),
            last_stall_s=self.last_stall_s,
            last_copy_s=self.last_copy_s,
            last_hash_s=self.last_hash_s,
            bytes_held=sum(s.capacity for s in self.slots),
            snapshot_bytes=held,
            # what the snapshot would hold without sharding the replicated state
            unsharded_bytes=(snap.unsharded_nbytes or held) if snap else 0,
            slots=[s.status() for s in self.slots],
        )
