"""Chained block hashes and the align-mode prefix hit: KV blocks plus a READY state slot at one position.

Hashes are chained (`hash((parent, digest of the block's tokens))`), so hash i names the whole prefix
[0, (i+1) h) and two requests share it iff they share those tokens (up to 64-bit collisions: these
hashes are not built to resist crafted prompts, like vLLM's builtin-hash option). Neither the
digest nor Python's int-tuple hash is salted, so hashes (and with them every scheduling decision)
are the same across runs.

A hit at position p needs the KV blocks [0, p) cached and a READY state slot keyed by hash p/h - 1
(I1: that slot holds exactly the state after p tokens). Hits are taken only where such a state
exists, i.e. at Mamba block boundaries or declared checkpoints. Under EAGLE/MTP block drop the KV
part gives up its last matched block first (vLLM's full-attention manager does the same because the
drafter needs that block's hidden states), which moves the hit one block back. A longer state that
is still PENDING (being written by this very step) defers the request by one step instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from scheduler.blocks import BlockPool, BlockPoolEdit
from scheduler.persistent import frozen
from scheduler.slots import SlotKind, SlotPoolEdit

ROOT_HASH = 0x6A68  # parent of the first block


@functools.cache
def _weights(unit: int) -> np.ndarray:
    return np.random.default_rng(ROOT_HASH).integers(0, 2**63, unit, dtype=np.uint64) * 2 + 1  # odd


def unit_digests(tokens: np.ndarray, unit: int) -> np.ndarray:
    """uint64 digest of each run of `unit` tokens along the last axis (its length a multiple of
    `unit`): a random-weighted sum of the tokens mod 2^64, one numpy call for any number of units."""
    return (tokens.reshape(*tokens.shape[:-1], -1, unit).astype(np.uint64) * _weights(unit)).sum(axis=-1)


def chain_hashes(parent: int, digests: list[int]) -> list[int]:
    """Chained hashes of consecutive units given their digests, the first unit's parent being `parent`;
    the chain step is Python's unsalted int-tuple hash."""
    out = []
    for digest in digests:
        parent = hash((parent, digest)) or 1  # 0 means "no hash" in BlockPool.block_hash
        out.append(parent)
    return out


class PrefixHit(NamedTuple):
    """num_tokens: hit length p (0 = no hit). block_ids: [p/h] int32 read-only, the cached KV blocks. slot: the READY
    state slot to copy into the running slot (0 when no hit). deferred: a longer state is PENDING."""

    num_tokens: int
    block_ids: np.ndarray
    slot: int
    deferred: bool


NO_HIT = PrefixHit(0, frozen(np.zeros(0, np.int32)), 0, False)


def cached_units(blocks: BlockPool | BlockPoolEdit, hashes: list[int], prefill_end: int, unit: int) -> int:
    """Leading hash units of a request (known tokens end at `prefill_end`) whose KV blocks are cached,
    keeping at least one token to compute."""
    return blocks.cached_prefix_length(hashes, min(len(hashes), (prefill_end - 1) // unit))


def find_hit(blocks: BlockPool | BlockPoolEdit, slots: SlotPoolEdit, hashes: list[int], num_cached: int, unit: int,
             block_drop: bool) -> PrefixHit:
    """Longest usable prefix hit within the first `num_cached` hash units (`cached_units`)."""
    num_kv = max(num_cached - 1, 0) if block_drop else num_cached
    # states are cached at few of these positions (a long prompt has thousands): collect those in one
    # comprehension, then try them longest first
    cached = [(count, slot) for count, slot in enumerate(map(slots.hash_to_slot.data().get, hashes[:num_kv]), 1)
              if slot is not None]
    for count, slot in reversed(cached):
        if slots.kind[slot] == SlotKind.RESERVED:
            continue
        if slots.kind[slot] == SlotKind.PENDING:
            return PrefixHit(0, NO_HIT.block_ids, 0, True)
        return PrefixHit(count * unit, _block_ids(blocks, hashes[:count]), slot, False)
    return NO_HIT


def _block_ids(blocks: BlockPool | BlockPoolEdit, hashes: list[int]) -> np.ndarray:
    return frozen(np.fromiter(map(blocks.hash_to_block.data().__getitem__, hashes), np.int32, len(hashes)))


def checkpoint_hit(blocks: BlockPool | BlockPoolEdit, slots: SlotPoolEdit, hashes: list[int], position: int,
                   unit: int, num_cached: int) -> PrefixHit:
    """A hit at exactly the declared checkpoint (no block drop: the position was chosen by the user);
    `num_cached` as for `find_hit`."""
    count = position // unit
    slot = slots.ready_slot(hashes[count - 1])
    if slot is None or num_cached < count:
        return NO_HIT
    return PrefixHit(position, _block_ids(blocks, hashes[:count]), slot, False)
