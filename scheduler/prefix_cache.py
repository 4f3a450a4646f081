"""Chained block hashes and the align-mode prefix hit: KV blocks plus a READY state slot at one position.

Hashes are chained (`hash((parent, block tokens))`), so hash i names the whole prefix [0, (i+1) h)
and two requests share it iff they share those tokens. Python's tuple-of-int hash is not salted, so
hashes (and with them every scheduling decision) are the same across runs.

A hit at position p needs the KV blocks [0, p) cached and a READY state slot keyed by hash p/h - 1
(I1: that slot holds exactly the state after p tokens). Hits are taken only where such a state
exists, i.e. at Mamba block boundaries or declared checkpoints. Under EAGLE/MTP block drop the KV
part gives up its last matched block first (vLLM's full-attention manager does the same because the
drafter needs that block's hidden states), which moves the hit one block back. A longer state that
is still PENDING (being written by this very step) defers the request by one step instead.
"""

from __future__ import annotations

from typing import NamedTuple

from scheduler.blocks import BlockPool, BlockPoolEdit
from scheduler.slots import SlotKind, SlotPoolEdit

ROOT_HASH = 0x6A68  # parent of the first block


def new_hashes(hashes: list[int], tokens, num_full_blocks: int, unit: int) -> list[int]:
    """Chained hashes of blocks [len(hashes), num_full_blocks), continuing the chain `hashes`."""
    out, parent = [], hashes[-1] if hashes else ROOT_HASH
    for index in range(len(hashes), num_full_blocks):
        parent = hash((parent, tuple(tokens[index * unit:(index + 1) * unit])))
        out.append(parent)
    return out


def hash_at(hashes: list[int], position: int, unit: int) -> int:
    """Key of the prefix [0, position); position is a positive multiple of the hash unit."""
    return hashes[position // unit - 1]


class PrefixHit(NamedTuple):
    """num_tokens: hit length p (0 = no hit). block_ids: the p/h cached KV blocks. slot: the READY
    state slot to copy into the running slot (0 when no hit). deferred: a longer state is PENDING."""

    num_tokens: int
    block_ids: tuple[int, ...]
    slot: int
    deferred: bool


NO_HIT = PrefixHit(0, (), 0, False)


def find_hit(blocks: BlockPool | BlockPoolEdit, slots: SlotPoolEdit, hashes: list[int],
             prefill_end: int, unit: int, block_drop: bool) -> PrefixHit:
    """Longest usable prefix hit for a request whose known tokens end at `prefill_end`."""
    limit = min(len(hashes), (prefill_end - 1) // unit)  # keep at least one token to compute
    num_kv = blocks.cached_prefix_length(hashes, limit)
    if block_drop:
        num_kv = max(num_kv - 1, 0)
    slot_of = list(map(slots.hash_to_slot.data().get, hashes[:num_kv]))
    for count in range(num_kv, 0, -1):
        slot = slot_of[count - 1]
        if slot is None or slots.kind[slot] == SlotKind.RESERVED:
            continue
        if slots.kind[slot] == SlotKind.PENDING:
            return PrefixHit(0, (), 0, True)
        return PrefixHit(count * unit, _block_ids(blocks, hashes[:count]), slot, False)
    return NO_HIT


def _block_ids(blocks: BlockPool | BlockPoolEdit, hashes: list[int]) -> tuple[int, ...]:
    return tuple(map(blocks.hash_to_block.data().__getitem__, hashes))


def checkpoint_hit(blocks: BlockPool | BlockPoolEdit, slots: SlotPoolEdit, hashes: list[int],
                   position: int, unit: int) -> PrefixHit:
    """A hit at exactly the declared checkpoint (no block drop: the position was chosen by the user)."""
    count = position // unit
    slot = slots.ready_slot(hashes[count - 1])
    if slot is None or blocks.cached_prefix_length(hashes, count) < count:
        return NO_HIT
    return PrefixHit(position, _block_ids(blocks, hashes[:count]), slot, False)
