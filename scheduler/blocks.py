"""Paged KV block pool: allocate, ref-count, free, hash-cache and LRU-evict blocks; block 0 is null.

A block's chained hash is kept both ways: `hash_to_block` (a `PMap`, for prefix lookups) and
`block_hash` (a `PArray`, 0 = none, so that releasing or publishing many blocks is vectorised).
Free blocks sit in two queues: `free_uncached` (no cached contents, reused first, a stack) and the
cached queue (still hit-able under their hash; least recently released first, so allocation evicts
LRU). The cached queue deletes lazily: entry i of `cached_queue` is the queue position
`queue_head + i`, and it is live only while `queue_pos[block]` says so; a hit that takes a free
cached block, or a second release, just moves `queue_pos`, and eviction skips dead entries. So no
transition filters the queue (compaction is amortised), and the order is exact LRU.
A `BlockPool` value is immutable; `schedule`/`update` call `edit()` for a private `BlockPoolEdit`
and `freeze()` it. Ref counts, hashes and queue positions are persistent (`PArray`, `PMap`), so a
transition costs O(blocks touched) plus one copy of the queues' tails, never a copy of the pool.
"""

from __future__ import annotations

import operator
from itertools import compress
from typing import NamedTuple

import numpy as np

from scheduler.persistent import PArray, PMap, frozen

NULL_BLOCK = 0
_NOT_QUEUED = -1


class BlockPool(NamedTuple):
    """refs: [num_blocks] int32 live references (block-table entries) per block (`ref_count`).
    free_uncached: [F] int32 free blocks without a hash, taken from the end.
    cached_queue: [Q] int32 released cached blocks, oldest first, dead entries included.
    queue_head: queue position of cached_queue[0].
    queue_pos: [num_blocks] int64 queue position of the block's live entry, -1 if none.
    num_cached_free: live entries (free blocks that are still hit-able).
    hash_to_block: the KV prefix cache (chained block hash -> block id).
    block_hash: [num_blocks] int64 the hash each cached block is published under, 0 if none."""

    refs: PArray
    free_uncached: np.ndarray
    cached_queue: np.ndarray
    queue_head: int
    queue_pos: PArray
    num_cached_free: int
    hash_to_block: PMap
    block_hash: PArray

    @staticmethod
    def create(num_blocks: int) -> BlockPool:
        free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)  # so block 1 is handed out first
        return BlockPool(PArray(np.zeros(num_blocks, np.int32)), frozen(free), frozen(free[:0].copy()), 0,
                         PArray(np.full(num_blocks, _NOT_QUEUED, np.int64)), 0, PMap(),
                         PArray(np.zeros(num_blocks, np.int64)))

    @property
    def ref_count(self) -> np.ndarray:
        return self.refs.get()

    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + self.num_cached_free

    @property
    def free_cached(self) -> np.ndarray:
        """The live entries of the cached queue: free cached blocks, least recently released first."""
        queue = self.cached_queue
        return queue[self.queue_pos.get()[queue] == self.queue_head + np.arange(len(queue))]

    def edit(self) -> BlockPoolEdit:
        return BlockPoolEdit(self)

    def cached_prefix_length(self, hashes: list[int], limit: int) -> int:
        """Number of leading hashes (at most `limit`) whose blocks are in the prefix cache."""
        found = list(map(self.hash_to_block.data().__contains__, hashes[:limit]))
        return found.index(False) if False in found else len(found)


class BlockPoolEdit:
    """A private, mutable working copy of a BlockPool inside one transition."""

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self.refs = pool.refs.edit()
        self.ref_count = self.refs.view  # reads; writes go through `refs`
        self.positions = pool.queue_pos.edit()
        self.queue_pos = self.positions.view
        self._uncached_end = len(pool.free_uncached)  # free_uncached[:end] are still free
        self._consumed = 0                            # cached_queue[:consumed] were popped by evictions
        self._queue_end = pool.queue_head + len(pool.cached_queue)  # the next release's queue position
        self._released_uncached: list[int] = []
        self._released_cached: list[int] = []         # queue positions [pool end, _queue_end) ...
        self._released_consumed = 0                   # ... of which the first ones were evicted
        self.hash_to_block = pool.hash_to_block.edit()
        self.hashes = pool.block_hash.edit()
        self.block_hash = self.hashes.view  # reads; writes go through `hashes`
        self.num_free = pool.num_free
        self.num_cached_free = pool.num_cached_free

    def freeze(self) -> BlockPool:
        pool = self._pool
        uncached = pool.free_uncached[:self._uncached_end]
        if self._released_uncached:
            uncached = np.concatenate([uncached, np.array(self._released_uncached, np.int32)])
        queue = pool.cached_queue[self._consumed:]
        head = pool.queue_head + self._consumed + self._released_consumed
        if len(self._released_cached) > self._released_consumed:
            released = np.array(self._released_cached[self._released_consumed:], np.int32)
            queue = np.concatenate([queue, released])
        if len(queue) > 2 * self.num_cached_free + 1024:  # mostly dead entries: keep the live ones
            queue = queue[self.queue_pos[queue] == head + np.arange(len(queue))]
            head = self._queue_end
            self.positions[queue] = head + np.arange(len(queue))
        return BlockPool(self.refs.freeze(), frozen(uncached), frozen(queue), head, self.positions.freeze(),
                         self.num_cached_free, self.hash_to_block.freeze(), self.hashes.freeze())

    def cached_prefix_length(self, hashes: list[int], limit: int) -> int:
        return BlockPool.cached_prefix_length(self, hashes, limit)  # type: ignore[arg-type]

    def num_free_after_taking(self, block_ids: tuple[int, ...]) -> int:
        """Free blocks left if the cached `block_ids` (a prefix hit) get referenced."""
        return self.num_free - int(np.count_nonzero(self.ref_count[list(block_ids)] == 0))

    def take(self, block_ids: tuple[int, ...]) -> None:
        """Reference existing, distinct blocks (a prefix hit or a shared producer prefix)."""
        if not block_ids:
            return
        blocks = np.array(block_ids, np.int32)
        refs = self.ref_count[blocks]
        revived = blocks[refs == 0]  # free cached blocks leave the queue: their entries die
        self.num_free -= len(revived)
        self.num_cached_free -= len(revived)
        self.positions[revived] = _NOT_QUEUED
        self.refs[blocks] = refs + 1

    def allocate(self, count: int) -> np.ndarray:
        """`count` fresh blocks: uncached ones first, then the least recently released cached ones."""
        if count > self.num_free:
            raise RuntimeError(f"allocate({count}) with only {self.num_free} free blocks")
        chosen = [self._released_uncached.pop() for _ in range(min(count, len(self._released_uncached)))]
        take = min(count - len(chosen), self._uncached_end)
        block_ids = self._pool.free_uncached[self._uncached_end - take:self._uncached_end][::-1]
        self._uncached_end -= take
        evicted = self._evict_cached(count - len(chosen) - take) if len(chosen) + take < count else []
        parts = [np.array(chosen, np.int32), block_ids, np.array(evicted, np.int32)]
        out = np.concatenate(parts) if chosen or evicted else block_ids.copy()
        self.refs[out] = 1
        self.num_free -= count
        return out

    def _evict_cached(self, count: int) -> list[int]:
        out: list[int] = []
        queue, head = self._pool.cached_queue, self._pool.queue_head
        while len(out) < count:
            if self._consumed < len(queue):
                block, position = int(queue[self._consumed]), head + self._consumed
                self._consumed += 1
            else:  # the whole old queue is consumed: go on with this edit's releases
                block = self._released_cached[self._released_consumed]
                position = head + len(queue) + self._released_consumed
                self._released_consumed += 1
            if self.queue_pos[block] != position:
                continue  # a dead entry: the block was hit or released again since
            self.hash_to_block.pop(int(self.block_hash[block]))
            self.hashes[block] = 0
            self.positions[block] = _NOT_QUEUED
            self.num_cached_free -= 1
            out.append(block)
        return out

    def release(self, block_ids: np.ndarray | list[int]) -> None:
        """Drop one reference from each (distinct) block; blocks reaching 0 become free (cached ones stay
        hit-able)."""
        blocks = np.array(block_ids, np.int32)
        blocks = blocks[blocks != NULL_BLOCK]
        refs = self.ref_count[blocks] - 1
        self.refs[blocks] = refs
        freed = blocks[refs == 0]
        self.num_free += len(freed)
        cached = self.block_hash[freed] != 0
        queued = freed[cached]
        self.positions[queued] = self._queue_end + np.arange(len(queued))
        self._queue_end += len(queued)
        self.num_cached_free += len(queued)
        self._released_cached += queued.tolist()
        self._released_uncached += freed[~cached].tolist()

    def register(self, block_ids: list[int], block_hashes: list[int]) -> None:
        """Publish computed blocks under their chained hashes (first writer wins on duplicates)."""
        unknown = map(operator.not_, map(self.hash_to_block.data().__contains__, block_hashes))
        fresh = (np.fromiter(unknown, bool, len(block_hashes)) & (self.block_hash[block_ids] == 0)).tolist()
        if not any(fresh):
            return
        keys, blocks = compress(block_hashes, fresh), compress(block_ids, fresh)
        # built from the back, so that of two blocks with one hash the first one is written last and stays
        published = dict(zip(reversed(list(keys)), reversed(list(blocks)), strict=True))
        self.hash_to_block.update(published)
        self.hashes[np.fromiter(published.values(), np.int64)] = np.fromiter(published, np.int64)
