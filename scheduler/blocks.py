"""Paged KV block pool: allocate, ref-count, free, hash-cache and LRU-evict blocks; block 0 is null.

A block's chained hash key is kept both ways: `hash_to_block` (for prefix lookups) and `block_to_key`
(for eviction and to tell cached free blocks from uncached ones).
Free blocks are either uncached (no key; a stack, reused first, last released first) or cached
(still hit-able under their key; a FIFO ring, least recently released evicted first). The ring
deletes lazily: the block at ring position p (absolute, `queue_head <= p < queue_end`, stored at
`p % capacity`) is live only while `queue_pos[block] == p`; a hit that takes a free cached block,
or a second release, just moves `queue_pos`, and eviction skips dead entries. Full rings are
compacted (amortised), and the order is exact LRU.
The pool is part of the single-use scheduler state: a transition writes it in place through undo
logs (journal.py), so it costs O(blocks touched), never a copy of the pool (a large GPU pool has
~10^5-10^6 blocks), and `rollback` restores it if the transition raises.
"""

from __future__ import annotations

from itertools import islice, takewhile

import numpy as np

from scheduler.journal import UndoArray, UndoMap

NULL_BLOCK = 0
_NOT_QUEUED = -1


class BlockPool:
    """refs: [num_blocks] int32 live references (block-table entries) per block (`ref_count`).
    stack: [num_blocks] int32; its first `num_uncached` entries are the free uncached blocks.
    ring: [2 num_blocks] int32 the cached queue, positions [queue_head, queue_end) at `p % len(ring)`.
    positions: [num_blocks] int64 ring position of the block's live entry, -1 if none (`queue_pos`).
    num_cached_free: live ring entries (free blocks that are still hit-able).
    hash_to_block: the KV prefix cache (chained block hash key -> block id).
    block_to_key: the key each published block is cached under.
    Array reads go through the read-only views (`ref_count`, `queue_pos`), writes through the `UndoArray`s."""

    _SCALARS = ("num_uncached", "num_cached_free", "queue_head", "queue_end")

    def __init__(self, num_blocks: int) -> None:
        stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)  # block 1 on top: handed out first
        self.refs, self.stack = UndoArray(np.zeros(num_blocks, np.int32)), UndoArray(stack)
        self.ring = UndoArray(np.zeros(2 * num_blocks, np.int32))
        self.positions = UndoArray(np.full(num_blocks, _NOT_QUEUED, np.int64))
        self.hash_to_block, self.block_to_key = UndoMap(), UndoMap()
        self.num_uncached, self.num_cached_free, self.queue_head, self.queue_end = num_blocks - 1, 0, 0, 0
        self._saved = None

    @property
    def ref_count(self) -> np.ndarray:
        return self.refs.view

    @property
    def queue_pos(self) -> np.ndarray:
        return self.positions.view

    @property
    def num_free(self) -> int:
        return self.num_uncached + self.num_cached_free

    @property
    def free_uncached(self) -> np.ndarray:
        """The free uncached blocks, the next one to be handed out last."""
        return self.stack.view[:self.num_uncached].copy()

    @property
    def free_cached(self) -> np.ndarray:
        """The free cached blocks, least recently released first."""
        positions = np.arange(self.queue_head, self.queue_end)
        queue = self.ring.view[positions % len(self.ring.view)]
        return queue[self.queue_pos[queue] == positions]

    def begin(self) -> None:
        self._saved = tuple(getattr(self, name) for name in self._SCALARS)

    def rollback(self) -> None:
        for part in (self.refs, self.stack, self.ring, self.positions, self.hash_to_block, self.block_to_key):
            part.rollback()
        for name, value in zip(self._SCALARS, self._saved, strict=True):
            setattr(self, name, value)

    def commit(self) -> None:
        for part in (self.refs, self.stack, self.ring, self.positions, self.hash_to_block, self.block_to_key):
            part.commit()

    def cached_prefix_length(self, hashes: list, limit: int) -> int:
        """Number of leading hashes (at most `limit`) whose blocks are in the prefix cache."""
        return len(list(takewhile(self.hash_to_block.__contains__, islice(hashes, limit))))

    def num_free_after_taking(self, block_ids: np.ndarray) -> int:
        """Free blocks left if the cached `block_ids` (a prefix hit) get referenced."""
        return self.num_free - int(np.count_nonzero(self.ref_count[block_ids] == 0))

    def take(self, blocks: np.ndarray) -> None:
        """Reference existing, distinct blocks (a prefix hit or a shared producer prefix)."""
        if not blocks.size:
            return
        refs = self.ref_count[blocks]
        revived = blocks[refs == 0]  # free cached blocks leave the queue: their entries die
        self.num_cached_free -= len(revived)
        self.positions[revived] = _NOT_QUEUED
        self.refs[blocks] = refs + 1

    def allocate(self, count: int) -> np.ndarray:
        """`count` fresh blocks: uncached ones first, then the least recently released cached ones."""
        if count > self.num_free:
            raise RuntimeError(f"allocate({count}) with only {self.num_free} free blocks")
        take = min(count, self.num_uncached)
        out = self.stack.view[self.num_uncached - take:self.num_uncached][::-1].copy()  # not a view: kept
        self.num_uncached -= take
        if take < count:
            out = np.concatenate([out, self._evict_cached(count - take)])
        self.refs[out] = 1
        return out

    def _evict_cached(self, count: int) -> np.ndarray:
        """The `count` least recently released cached blocks, read off the ring a window at a time."""
        ring, capacity, out = self.ring.view, len(self.ring.view), []
        while count:
            positions = np.arange(self.queue_head, min(self.queue_head + 2 * count, self.queue_end))
            window = ring[positions % capacity]
            live = (self.queue_pos[window] == positions).nonzero()[0][:count]  # dead entries are skipped
            self.queue_head = int(positions[live[-1]]) + 1 if len(live) == count else int(positions[-1]) + 1
            out.append(window[live])
            count -= len(live)
        evicted = np.concatenate(out) if len(out) > 1 else out[0]
        evicted_list = evicted.tolist()
        self.hash_to_block.remove_many(list(map(self.block_to_key.__getitem__, evicted_list)))
        self.block_to_key.remove_many(evicted_list)
        self.positions[evicted] = _NOT_QUEUED
        self.num_cached_free -= len(evicted)
        return evicted

    def release(self, block_ids: np.ndarray | list[int], distinct: bool = True) -> None:
        """Drop one reference per entry of `block_ids`; blocks reaching 0 become free (cached ones stay
        hit-able). With `distinct=False` a block may appear as often as it is referenced (the shared
        prefix of several requests released together): it is freed at its last entry, so the order
        is that of releasing the entries one by one."""
        blocks = np.array(block_ids, np.int32)
        blocks = blocks[blocks != NULL_BLOCK]
        drop = 1
        if not distinct:
            blocks, drop = _by_last_entry(blocks)
        refs = self.ref_count[blocks] - drop
        self.refs[blocks] = refs
        freed = blocks[refs == 0]
        cached = np.fromiter(map(self.block_to_key.__contains__, freed.tolist()), bool, len(freed))
        uncached = freed[~cached]
        self.stack[self.num_uncached:self.num_uncached + len(uncached)] = uncached
        self.num_uncached += len(uncached)
        self._enqueue(freed[cached])

    def _enqueue(self, blocks: np.ndarray) -> None:
        capacity = len(self.ring.view)
        if self.queue_end + len(blocks) - self.queue_head > capacity:
            self._compact()  # leaves at most num_blocks live entries in a ring of 2 num_blocks
        positions = self.queue_end + np.arange(len(blocks))
        self.ring[positions % capacity] = blocks
        self.positions[blocks] = positions
        self.queue_end += len(blocks)
        self.num_cached_free += len(blocks)

    def _compact(self) -> None:
        """Move the live entries to fresh positions after queue_end, dropping the dead ones."""
        positions = np.arange(self.queue_head, self.queue_end)
        queue = self.ring.view[positions % len(self.ring.view)]
        live = queue[self.queue_pos[queue] == positions]
        self.queue_head = self.queue_end
        self.num_cached_free -= len(live)
        self._enqueue(live)

    def register(self, block_ids: np.ndarray | list[int], block_hashes: list) -> None:
        """Publish computed blocks under their chained hash keys: a block or a key already published
        keeps its entry, and of two blocks with one key in this call the first wins."""
        known, published = self.hash_to_block, self.block_to_key
        fresh = {}
        for block, key in zip(np.asarray(block_ids).tolist(), block_hashes, strict=True):
            if key not in known and block not in published and key not in fresh:
                fresh[key] = block
        if fresh:
            known.insert_new(fresh)
            published.insert_new({block: key for key, block in fresh.items()})


def _by_last_entry(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct blocks ordered by their last entry in `blocks`, and how often each appears
    (np.unique with its inverse maps, written out: it costs ~5x this at these sizes)."""
    if not blocks.size:
        return blocks, blocks
    order = blocks.argsort(kind="stable")  # within a run of equal blocks, the last entry comes last
    ordered = blocks[order]
    run_end = np.empty(len(blocks), bool)
    run_end[-1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=run_end[:-1])
    ends = run_end.nonzero()[0]
    counts = ends + 1
    counts[1:] -= ends[:-1] + 1
    by_last = order[ends].argsort()
    return ordered[ends][by_last], counts[by_last]
