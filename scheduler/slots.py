"""State-slot pool: slot 0 is null, one running slot per running request, cache slots keyed by hash.

Slot kinds:
  FREE      unused.
  RUNNING   a running request's live state (its ring and trackers live in the same page).
  CACHED    a READY prefix state, hit-able and LRU-evictable; I1: keyed by the hash of tokens [0, p),
            it holds exactly the state after p tokens.
  PENDING   a prefix state that the in-flight step writes (publish or materialize); it becomes CACHED
            in `update`, so nobody can hit a state whose writing step has not run.
  RESERVED  held by a checkpoint producer until its chunk reaches the checkpoint.
Like `blocks.py`, the pool is part of the single-use scheduler state, written in place: `begin` keeps
the small per-slot arrays to restore if the transition raises, the hash maps have undo logs.
"""

from __future__ import annotations

import numpy as np

from scheduler.journal import UndoMap, set_writable

NULL_SLOT = 0
_NEVER = np.iinfo(np.int64).max  # LRU age of a slot that cannot be evicted


class SlotKind:
    """The kinds, as plain ints: numpy compares and stores an IntEnum member ~10x slower than an int."""

    FREE = 0
    RUNNING = 1
    CACHED = 2
    PENDING = 3
    RESERVED = 4


class SlotPool:
    """kind: [num_state_slots] int8 SlotKind. stamp: [num_state_slots] int64 LRU clock of CACHED slots.
    hash_to_slot / slot_to_hash: prefix states of kind CACHED, PENDING or RESERVED.
    num_free_or_cached: slots of kind FREE or CACHED (what an allocation may take), kept as a count.
    pinned: cached slots read by this step's hit copies (not evictable); evicted: hash keys evicted
    by this transition (checkpoint table: READY -> ABSENT). Both are reset by `begin`."""

    def __init__(self, num_slots: int) -> None:
        self.kind = np.zeros(num_slots, np.int8)
        self.kind[NULL_SLOT] = SlotKind.RUNNING  # never handed out; padding rows point at it
        self.stamp = np.zeros(num_slots, np.int64)
        self.hash_to_slot, self.slot_to_hash = UndoMap(), UndoMap()
        self.num_free_or_cached = num_slots - 1
        self.pinned: set[int] = set()
        self.evicted: list = []
        self._saved = None
        self.lock()

    def begin(self) -> None:
        self._saved = (self.kind.copy(), self.stamp.copy(), self.num_free_or_cached)
        set_writable(self._saved[:2], False)
        set_writable((self.kind, self.stamp), True)
        self.pinned, self.evicted = set(), []

    def rollback(self) -> None:
        self.kind, self.stamp, self.num_free_or_cached = self._saved
        self.hash_to_slot.rollback()
        self.slot_to_hash.rollback()

    def commit(self) -> None:
        self._saved = None
        self.hash_to_slot.commit()
        self.slot_to_hash.commit()
        self.lock()

    def lock(self) -> None:
        """Make `kind` and `stamp` read-only until the next `begin`."""
        set_writable((self.kind, self.stamp), False)

    def ready_slot(self, key) -> int | None:
        slot = self.hash_to_slot.get(key)
        return slot if slot is not None and self.kind[slot] == SlotKind.CACHED else None

    def num_available(self) -> int:
        return self.num_free_or_cached - len(self.pinned)

    def allocate(self, kind: int, key=None) -> int:
        """One slot of `kind` (optionally owning prefix hash `key`): a free one, else evict the LRU cached."""
        return self.allocate_many(kind, 1, None if key is None else [key])[0]

    def allocate_many(self, kind: int, count: int, keys: list | None = None) -> list[int]:
        """`count` slots of `kind` (owning the distinct prefix hashes `keys`, if given): free ones first,
        then LRU-evicted cached ones."""
        if count == 1:  # the common case: FREE is the smallest kind, so argmin finds the first free slot
            first = int(self.kind.argmin())
            slots = [first] if self.kind[first] == SlotKind.FREE else []
        else:
            slots = (self.kind == SlotKind.FREE).nonzero()[0][:count].tolist()
        if len(slots) < count:
            slots += self._evict_lru(count - len(slots))
        self.kind[slots] = kind
        self.num_free_or_cached -= count
        if keys is not None:
            assert not any(map(self.hash_to_slot.__contains__, keys)), "a prefix state already has a slot"
            # new keys, and slots that were free or just lost their keys: no undo lookups needed
            self.hash_to_slot.insert_new(dict(zip(keys, slots, strict=True)))
            self.slot_to_hash.insert_new(dict(zip(slots, keys, strict=True)))
        return slots

    def pin(self, slot: int, clock: int) -> None:
        self.pinned.add(slot)
        self.stamp[slot] = clock

    def release(self, slot: int) -> None:
        """Free a RUNNING, RESERVED or PENDING slot (dropping any hash it was going to hold)."""
        key = self.slot_to_hash.get(slot)
        if key is not None:
            self.slot_to_hash.pop(slot)
            self.hash_to_slot.pop(key)
        self.num_free_or_cached += 1
        self.kind[slot] = SlotKind.FREE

    def make_ready(self, slot: int, clock: int) -> None:
        self.num_free_or_cached += 1
        self.kind[slot] = SlotKind.CACHED
        self.stamp[slot] = clock

    def _evict_lru(self, count: int) -> list[int]:
        """The `count` least recently used unpinned CACHED slots (oldest first), their hashes dropped."""
        age = np.where(self.kind == SlotKind.CACHED, self.stamp, _NEVER)
        age[list(self.pinned)] = _NEVER
        if count == 1:  # the usual case; ties go to the lowest slot
            victims = age.argmin(keepdims=True)
        else:  # the same order as repeated argmins, without sorting the whole pool
            candidates = (age <= np.partition(age, count - 1)[count - 1]).nonzero()[0]
            victims = candidates[age[candidates].argsort(kind="stable")[:count]]
        if len(victims) < count or age[victims[-1]] == _NEVER:
            raise RuntimeError("no free or evictable state slot")
        victims = victims.tolist()
        keys = list(map(self.slot_to_hash.pop, victims))
        for key in keys:
            self.hash_to_slot.pop(key)
        self.evicted += keys
        return victims
