"""Paged KV block pool: allocate, ref-count, free, hash-cache and LRU-evict blocks; block 0 is null.

A block's chained hash is kept both ways: `hash_to_block` (a `PMap`, for prefix lookups) and
`block_hash` (a `PArray`, 0 = none, so that releasing or publishing many blocks is vectorised).
Free blocks sit in two queues: `free_uncached` (no cached contents, reused first) and `free_cached`
(still hit-able under their hash; least recently released first, so allocation evicts LRU). A
`BlockPool` value is immutable; `schedule`/`update` call `edit()` for a private `BlockPoolEdit` and
`freeze()` it. The ref counts (`PArray`) and the hash maps (`PMap`) are persistent, so a transition
costs O(blocks touched) plus slicing the free queues, never a copy of the pool.
"""

from __future__ import annotations

import operator
from itertools import compress
from typing import NamedTuple

import numpy as np

from scheduler.persistent import PArray, PMap, frozen

NULL_BLOCK = 0


class BlockPool(NamedTuple):
    """refs: [num_blocks] int32 live references (block-table entries) per block (`ref_count`).
    free_uncached: [F1] int32 free blocks without a hash, taken from the end.
    free_cached: [F2] int32 free blocks that keep their hash, least recently released first.
    hash_to_block: the KV prefix cache (chained block hash -> block id).
    block_hash: [num_blocks] int64 the hash each cached block is published under, 0 if none."""

    refs: PArray
    free_uncached: np.ndarray
    free_cached: np.ndarray
    hash_to_block: PMap
    block_hash: PArray

    @staticmethod
    def create(num_blocks: int) -> BlockPool:
        free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)  # so block 1 is handed out first
        return BlockPool(PArray(np.zeros(num_blocks, np.int32)), frozen(free), frozen(free[:0].copy()), PMap(),
                         PArray(np.zeros(num_blocks, np.int64)))

    @property
    def ref_count(self) -> np.ndarray:
        return self.refs.get()

    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

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
        self._uncached_end = len(pool.free_uncached)  # free_uncached[:end] are still free
        self._cached_start = 0                        # free_cached[start:] are still free (unless taken)
        self._released_uncached: list[int] = []
        self._released_cached: list[int] = []
        self._revived: set[int] = set()  # cached free blocks referenced again by a hit
        self.hash_to_block = pool.hash_to_block.edit()
        self.hashes = pool.block_hash.edit()
        self.block_hash = self.hashes.view  # reads; writes go through `hashes`
        self.num_free = pool.num_free

    def freeze(self) -> BlockPool:
        uncached = self._pool.free_uncached[:self._uncached_end]
        if self._released_uncached:
            uncached = np.concatenate([uncached, np.array(self._released_uncached, np.int32)])
        cached = self._pool.free_cached[self._cached_start:]
        if self._revived:  # hits took blocks out of the queue: drop their (now stale) entries
            taken = np.zeros(len(self.ref_count), bool)
            taken[list(self._revived)] = True
            cached = cached[~taken[cached]]
        if self._released_cached:
            cached = np.concatenate([cached, self._released_queue()])
        return BlockPool(self.refs.freeze(), frozen(uncached), frozen(cached), self.hash_to_block.freeze(),
                         self.hashes.freeze())

    def _released_queue(self) -> np.ndarray:
        # a block released twice in one edit (released, hit, released) is queued at its last release
        last_first = [b for b in dict.fromkeys(reversed(self._released_cached)) if self.ref_count[b] == 0]
        return np.array(last_first[::-1], np.int32)

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
        revived = blocks[refs == 0].tolist()
        self.num_free -= len(revived)
        self._revived.update(revived)
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
        queue = self._pool.free_cached
        while len(out) < count:
            if self._cached_start < len(queue):
                block = int(queue[self._cached_start])
                self._cached_start += 1
            else:
                block = self._released_cached.pop(0)
            if self.ref_count[block] or not self.block_hash[block]:
                continue  # referenced again by a hit, or a stale duplicate entry
            self.hash_to_block.pop(int(self.block_hash[block]))
            self.hashes[block] = 0
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
        self._released_cached += freed[cached].tolist()
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
