"""Chained block hash keys and the align-mode prefix hit: KV blocks plus a READY state slot at one position.

Keys are chained BLAKE2b-256 digests: key i = H(key i-1 || the unit's tokens as little-endian int32),
so key i names the whole prefix [0, (i+1) h) and two requests share it iff they share those tokens.
A collision-resistant digest matters in a shared server: with a weak one, one user can craft a prompt
whose blocks collide with another's and read that prompt's KV and recurrent state as a prefix hit
(vLLM met this class of bug and moved to SHA-256). The chain starts at `root_hash(cache_salt)`:
requests share prefixes only under the same salt, so tenants can keep theirs apart. The salt is
digested under its own BLAKE2b personalisation, a different hash function from the chain's: a salt
whose bytes spell `parent || unit` would otherwise name that unit's key and let its tenant hit another
tenant's prefix a block late. Nothing is randomised per process, so keys, and with them every
scheduling decision, are the same across runs.

A hit at position p needs the KV blocks [0, p) cached and a READY state slot keyed by key p/h - 1
(I1: that slot holds exactly the state after p tokens). Hits are taken only where such a state
exists, i.e. at Mamba block boundaries or declared checkpoints. Under EAGLE/MTP block drop the KV
part gives up its last matched block first (vLLM's full-attention manager does the same because the
drafter needs that block's hidden states), which moves the hit one block back. A longer state that
is still PENDING (being written by this very step) defers the request by one step instead.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import NamedTuple

import numpy as np

from scheduler.blocks import BlockPool
from scheduler.journal import frozen
from scheduler.slots import SlotKind, SlotPool

KEY_BYTES = 32
ROOT_HASH = blake2b(b"jaxhybrid prefix cache", digest_size=KEY_BYTES).digest()  # parent of an unsalted first block
SALT_PERSON = b"jaxhybrid salt"  # the salt's own domain: no salt digest equals a chain key H(parent || unit)


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: prefixes are shared only between requests of one salt."""
    if cache_salt is None:
        return ROOT_HASH
    return blake2b(cache_salt.encode(), digest_size=KEY_BYTES, person=SALT_PERSON).digest()


def chain_hashes(parent: bytes, tokens: np.ndarray, unit: int) -> list[bytes]:
    """Chained keys of the consecutive full units of `unit` tokens in `tokens`, the first unit's parent
    being `parent`: one C-level digest per unit, never a Python loop over tokens."""
    data = np.ascontiguousarray(tokens, "<i4").tobytes()
    step, out = 4 * unit, []
    for start in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[start:start + step], digest_size=KEY_BYTES).digest()
        out.append(parent)
    return out


class PrefixHit(NamedTuple):
    """num_tokens: hit length p (0 = no hit). block_ids: [p/h] int32 read-only, the cached KV blocks. slot: the READY
    state slot to copy into the running slot (0 when no hit). deferred: the longest cached state, after
    num_tokens tokens, is PENDING (written by this very step): no hit now (block_ids empty, slot 0)."""

    num_tokens: int
    block_ids: np.ndarray
    slot: int
    deferred: bool


NO_HIT = PrefixHit(0, frozen(np.zeros(0, np.int32)), 0, False)


def cached_units(blocks: BlockPool, hashes: list[bytes], end: int, unit: int) -> int:
    """Leading hash units of a request whose KV blocks are cached, all before position `end` - 1 (the
    last known token, or the first that asks for a logit): at least that token is computed."""
    return blocks.cached_prefix_length(hashes, min(len(hashes), (end - 1) // unit))


def find_hit(blocks: BlockPool, slots: SlotPool, hashes: list[bytes], num_cached: int, unit: int,
             block_drop: bool) -> PrefixHit:
    """Longest usable prefix hit within the first `num_cached` hash units (`cached_units`)."""
    num_kv = max(num_cached - 1, 0) if block_drop else num_cached
    # states are cached at few of these positions (a long prompt has thousands): collect those in one
    # comprehension, then try them longest first
    cached = [(count, slot) for count, slot in enumerate(map(slots.hash_to_slot.get, hashes[:num_kv]), 1)
              if slot is not None]
    for count, slot in reversed(cached):
        if slots.kind[slot] == SlotKind.RESERVED:
            continue
        if slots.kind[slot] == SlotKind.PENDING:  # num_tokens says which state is being written
            return PrefixHit(count * unit, NO_HIT.block_ids, 0, True)
        return PrefixHit(count * unit, _block_ids(blocks, hashes[:count]), slot, False)
    return NO_HIT


def _block_ids(blocks: BlockPool, hashes: list[bytes]) -> np.ndarray:
    return frozen(np.fromiter(map(blocks.hash_to_block.__getitem__, hashes), np.int32, len(hashes)))


def checkpoint_hit(blocks: BlockPool, slots: SlotPool, hashes: list[bytes], position: int,
                   unit: int, num_cached: int) -> PrefixHit:
    """A hit at exactly the declared checkpoint (no block drop: the position was chosen by the user);
    `num_cached` as for `find_hit`."""
    count = position // unit
    slot = slots.ready_slot(hashes[count - 1])
    if slot is None or num_cached < count:
        return NO_HIT
    return PrefixHit(position, _block_ids(blocks, hashes[:count]), slot, False)
