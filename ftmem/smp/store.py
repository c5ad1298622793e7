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
    COMMITTED ----------------begin--> WRITING     (not the newest, not pinned)
    WRITING --commit--> COMMITTED                  (unverified; the hasher pins it meanwhile)
    WRITING --abort / restarted (the rank's copy failed, or the rank restarted: torn)--> FREE
    COMMITTED --verify--> COMMITTED                (verified: the layout carries the checksums)
    COMMITTED --drop (hashing failed, not pinned)--> FREE
    COMMITTED --discard_newer (a newer step of an abandoned run, not pinned)--> FREE
    EMPTY / FREE --adopt (a previous SMP's commit record)--> COMMITTED
    COMMITTED --pin / unpin--> COMMITTED           (pins counted; only COMMITTED slots are pinned)

Any other request raises :class:`StoreError` (a stale gen or step, a wrong state, a bad
index), except the late ones that are expected and ignored: an abort, drop, verify or unpin of
a slot replaced since (its gen moved on).

A COMMITTED slot is *verified* once the SMP has checksummed it (``verified``; the hasher
pins the slot meanwhile). Only verified snapshots are served to loads, protected and
flushed. The newest committed slot of a rank is never handed out for writing, so a crash
at any moment leaves the newest committed snapshot intact ("never block, never tear": when
no other slot is available the save is skipped, not waited for; each skip is counted per
reason). Pinned slots (hasher, peer exchange, flush) are never written, resized or dropped.
"""

from __future__ import annotations

import enum
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any

MAX_SLOT_BYTES = 1 << 40
"""The largest slot the SMP makes (a request for more is refused)."""


class SlotState(enum.Enum):
    """Life-cycle state of one slot."""

    EMPTY = "empty"
    ALLOCATING = "allocating"
    FREE = "free"
    WRITING = "writing"
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
    seq: int = 0
    """Commit sequence number: larger means committed later."""
    pinned: int = 0
    """Holders (hasher, peer exchange, flush) that need the data kept; pinned slots are not
    reused."""
    verified: bool = False
    """COMMITTED and checksummed by the SMP (the layout carries every extent's hash)."""

    def describe(self) -> dict[str, Any]:
        """Return a JSON-ready summary (no layout)."""
        return {
            "slot": self.index,
            "state": self.state.value,
            "gen": self.gen,
            "capacity": self.capacity,
            "step": self.step,
            "pinned": self.pinned,
            "verified": self.verified,
        }


@dataclass(frozen=True, slots=True)
class BeginDecision:
    """What :meth:`RankSlots.begin` decided: write into ``slot``, ``resize`` it, or ``skip``."""

    action: str  # "write" | "resize" | "skip"
    slot: int = -1
    reason: str = ""


class StoreError(Exception):
    """A request does not fit the slot's state (stale gen, wrong state, bad index)."""


@dataclass(frozen=True, slots=True)
class RankPiece:
    """One rank's committed slot of a step: where it is and how much of it the snapshot uses.

    A piece handed out by the store stands for one pin of that slot; give it back with
    :meth:`~ftmem.smp.slot_store.SlotStore.unpin`.
    """

    rank: int
    slot: int
    gen: int
    path: str
    capacity: int
    used: int
    layout: str


@dataclass(slots=True)
class RankSlots:
    """All slots of one rank plus its progress and statistics."""

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
    """Skipped snapshots per reason (the SMP's own refusals and those the rank reported)."""
    last_hash_s: float = 0.0
    hello_time: float | None = None
    """When the rank's current process first spoke to the SMP."""
    restored_time: float | None = None
    """When the rank's current process finished its restore (``DiscardNewer``)."""
    first_progress_time: float | None = None
    """The current process's first progress report."""
    in_process: bool = False
    """The current process runs under ``ftmem.run`` (it can rejoin a restart in process)."""
    _seq: int = 0

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [Slot(index=i) for i in range(self.nslots)]

    # -- queries ---------------------------------------------------------------------------
    def committed(self) -> list[Slot]:
        """Committed slots, newest step first (ties: later commit first)."""
        done = [s for s in self.slots if s.state is SlotState.COMMITTED]
        return sorted(done, key=lambda s: (s.step or 0, s.seq), reverse=True)

    def verified(self) -> list[Slot]:
        """Committed and verified slots, newest step first."""
        return [s for s in self.committed() if s.verified]

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
        """Committed slots of a step newer than ``step`` that no one holds (what
        :meth:`discard_newer` frees)."""
        return [
            s
            for s in self.slots
            if s.state is SlotState.COMMITTED
            and s.step is not None
            and s.step > step
            and not s.pinned
        ]

    def growable(self, capacity: int, but: int = -1) -> list[Slot]:
        """FREE or EMPTY slots (other than ``but``) smaller than ``capacity``: a PREPARE
        grows them too, so the next saves need no resize."""
        return [
            s
            for s in self.slots
            if s.index != but
            and s.state in (SlotState.FREE, SlotState.EMPTY)
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
        self.pid = pid
        torn = []
        for s in self.slots:
            if s.state is SlotState.WRITING:
                s.state, s.step, s.layout = SlotState.FREE, None, ""
                torn.append(s.index)
        return torn

    def begin(self, step: int, nbytes: int) -> BeginDecision:
        """Choose the slot to write ``step`` (``nbytes``) into, without ever touching the newest."""
        if any(s.state is SlotState.WRITING for s in self.slots):
            return BeginDecision("skip", reason="a copy is still being written")
        newest = self.newest()
        usable = [
            s
            for s in self.slots
            if s.pinned == 0
            and s is not newest
            and s.state in (SlotState.FREE, SlotState.EMPTY, SlotState.COMMITTED)
        ]
        if not usable:
            return BeginDecision("skip", reason="no slot is free (all held)")
        # Prefer never-committed slots, then the oldest committed one.
        usable.sort(key=lambda s: (s.state is SlotState.COMMITTED, s.seq))
        fitting = [s for s in usable if s.state is not SlotState.EMPTY and s.capacity >= nbytes]
        if not fitting:
            return BeginDecision("resize", slot=usable[0].index)
        target = fitting[0]
        target.state, target.step, target.layout = SlotState.WRITING, step, ""
        return BeginDecision("write", slot=target.index)

    def commit(self, index: int, gen: int, step: int, layout: str) -> None:
        """Mark slot ``index`` committed with ``step`` and its layout."""
        s = self.slot(index)
        if s.state is not SlotState.WRITING or s.gen != gen or s.step != step:
            raise StoreError(
                f"commit of step {step} to slot {index} gen {gen} does not match "
                f"its state {s.state.value} step {s.step} gen {s.gen}"
            )
        self._seq += 1
        s.state, s.layout, s.seq, s.verified = SlotState.COMMITTED, layout, self._seq, False
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
        s.layout, s.verified = layout, True
        return True

    def drop(self, index: int, gen: int) -> None:
        """Forget a committed slot that cannot be verified (its data is treated as lost)."""
        s = self.slot(index)
        if s.state is SlotState.COMMITTED and s.gen == gen:
            s.state, s.step, s.layout, s.verified = SlotState.FREE, None, "", False

    def abort(self, index: int, gen: int) -> None:
        """Give back a slot whose copy failed."""
        s = self.slot(index)
        if s.state is SlotState.WRITING and s.gen == gen:
            s.state, s.step, s.layout, s.verified = SlotState.FREE, None, "", False

    def discard_newer(self, step: int) -> list[int]:
        """Free committed slots with a step newer than ``step``; return the steps dropped."""
        dropped = []
        for s in self.newer_unpinned(step):
            assert s.step is not None
            dropped.append(s.step)
            s.state, s.step, s.layout, s.verified = SlotState.FREE, None, "", False
        return dropped

    def start_resize(self, index: int) -> Slot:
        """Mark a reusable slot ALLOCATING (its file is about to be replaced)."""
        s = self.slot(index)
        if s is self.newest() or s.pinned or s.state in (SlotState.WRITING, SlotState.ALLOCATING):
            raise StoreError(f"slot {index} of rank {self.rank} cannot be resized now")
        s.state, s.step, s.layout, s.verified = SlotState.ALLOCATING, None, "", False
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
        """Mark ALLOCATING the slot a rebuilt snapshot of ``step`` goes into: one already
        holding ``step`` (its data may be stale or corrupt), else a free one, else the oldest
        committed one, never a pinned, written or allocating one (the newest only if nothing
        else is left: the rebuilt step replaces what the group could not keep).

        Raises:
            StoreError: every slot is pinned, written or allocating.
        """
        newest = self.newest()
        candidates = [
            s
            for s in self.slots
            if not s.pinned and s.state not in (SlotState.WRITING, SlotState.ALLOCATING)
        ]
        holding = [s for s in candidates if s.state is SlotState.COMMITTED and s.step == step]
        free = [s for s in candidates if s.state in (SlotState.FREE, SlotState.EMPTY)]
        older = sorted((s for s in candidates if s is not newest), key=lambda s: s.seq)
        ranked = holding or free or older or candidates
        if not ranked:
            raise StoreError(f"rank {self.rank} has no slot to take a rebuilt snapshot")
        chosen = ranked[0]
        chosen.state, chosen.step, chosen.layout = SlotState.ALLOCATING, None, ""
        chosen.verified = False
        return chosen

    def finish_rebuild(
        self, index: int, path: str, capacity: int, step: int, layout: str, verified: bool
    ) -> Slot:
        """The rebuilt snapshot of ``step`` is in slot ``index``'s new file: commit it as the
        newest commit and pin it once (for the exchange that rebuilt it).

        Raises:
            StoreError: the slot is not ALLOCATING.
        """
        s = self._allocating(index)
        s.gen += 1
        s.path, s.capacity = path, capacity
        self._install(s, step, self.next_seq(), layout, verified)
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
        verified: bool = True,
    ) -> None:
        """Take over a committed slot left by a previous SMP of this node (see records.py);
        ``verified``: its layout carries every checksum.

        Raises:
            StoreError: the slot is neither EMPTY nor FREE.
        """
        s = self.slot(index)
        if s.state not in (SlotState.EMPTY, SlotState.FREE):
            raise StoreError(f"slot {index} of rank {self.rank} is {s.state.value}: not adopted")
        s.gen, s.path, s.capacity = gen, path, capacity
        self._install(s, step, seq, layout, verified)

    def _install(self, s: Slot, step: int, seq: int, layout: str, verified: bool) -> None:
        s.state = SlotState.COMMITTED
        s.step, s.seq, s.layout, s.verified = step, seq, layout, verified
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

    def describe(self) -> dict[str, Any]:
        """Return a JSON-ready summary for STATUS."""
        newest = self.newest()
        committed = self.committed()
        return {
            "pid": self.pid,
            "newest_committed": newest.step if newest else None,
            "committed_steps": [s.step for s in committed],
            "newest_verified": max((s.step or 0 for s in committed if s.verified), default=None),
            "verified_steps": [s.step for s in committed if s.verified],
            "skips": dict(self.skips),
            "last_hash_s": self.last_hash_s,
            "last_progress_time": self.last_progress_time,
            "last_progress_step": self.last_progress_step,
            "hello_time": self.hello_time,
            "restored_time": self.restored_time,
            "first_progress_time": self.first_progress_time,
            "in_process": self.in_process,
            "skipped": self.skipped,
            "last_stall_s": self.last_stall_s,
            "last_copy_s": self.last_copy_s,
            "commits": self.commits,
            "bytes_held": sum(s.capacity for s in self.slots),
            **_snapshot_sizes(newest.layout if newest else ""),
            "slots": [s.describe() for s in self.slots],
        }


@functools.lru_cache(maxsize=256)
def _snapshot_sizes(layout: str) -> dict[str, int]:
    """Bytes of a committed snapshot's tensors and objects, and what they would be without
    sharding the replicated state (the client says; equal when not sharded). Cached: STATUS
    is polled every second and a layout is parsed once."""
    try:
        doc = json.loads(layout) if layout else {}
        held = sum(int(t["nbytes"]) for t in doc.get("tensors", []))
        held += int(doc.get("objects", {}).get("nbytes", 0))
        unsharded = int(doc.get("unsharded_nbytes") or 0) or held
    except (ValueError, TypeError, KeyError, AttributeError):
        held = unsharded = 0
    return {"snapshot_bytes": held, "unsharded_bytes": unsharded}
