"""Slot pools: gathers and scatters of whole row states around the null slot 0, checkpoint slots, and a state
carried through each row's chunks (or blocks of rows) in place on its pool."""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.varlen import ChunkTable, real_blocks


def gather_slots(pool: jax.Array, slots: jax.Array, has_initial: jax.Array | None = None) -> jax.Array:
    """pool[slots] -> [R, ...]; rows without an initial state read zeros, whatever the slot holds."""
    rows = pool[slots]
    if has_initial is None:
        return rows
    return jnp.where(has_initial.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, 0).astype(pool.dtype)


def scatter_slots(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """pool[slots] = rows, except slot 0: the null slot is never written (padding rows aim there)."""
    target = jnp.where(slots > 0, slots, pool.shape[0])
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


def checkpoint_targets(cu_seqlens, slots, checkpoint_lens, checkpoint_slots):
    """Slots receiving each row's checkpoint: 0 (skip) for rows aimed at the null slot or too short."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return jnp.where((slots > 0) & (checkpoint_lens <= lengths), checkpoint_slots, 0)


def store_checkpoints(pool, cu_seqlens, slots, checkpoint_lens, checkpoint_slots, checkpoint):
    """Scatter each row's checkpoint state, when asked, to its checkpoint slot."""
    if checkpoint_lens is None:
        return pool
    return scatter_slots(pool, checkpoint_targets(cu_seqlens, slots, checkpoint_lens, checkpoint_slots), checkpoint)


def copy_slots(pool: jax.Array, src_slots: jax.Array, dst_slots: jax.Array) -> jax.Array:
    """pool[dst] = pool[src] for each pair; pairs aimed at the null slot 0 are skipped."""
    return scatter_slots(pool, dst_slots, pool[src_slots])


# A block of rows' states that stays in a core's cache (L2 is 1 MiB on the EPYC we measure) between the ops of
# `in_row_blocks`.
ROW_BLOCK_BYTES = 2**20


def in_row_blocks(fn: Callable, pool: Any, per_row: tuple[jax.Array, ...], row_bytes: int) -> tuple[Any, Any]:
    """(pool, outs) <- fn(pool, *block) over blocks of the [R, ...] `per_row` arrays, in a loop carrying the pool
    (updated in place) and stacking the blocks' outputs back to [R, ...].

    Whole-batch ops over the states read and write every state from memory once per op; a block of about
    `ROW_BLOCK_BYTES` of states (`row_bytes` each) stays in cache from its gather through its scatter
    (docs/benchmarks.md#where-a-cpu-decode-step-goes).
    """
    rows = per_row[0].shape[0]
    block = math.gcd(rows, max(1, ROW_BLOCK_BYTES // row_bytes))
    blocks = [x.reshape(rows // block, block, *x.shape[1:]) for x in per_row]
    pool, outs = jax.lax.scan(lambda pool, xs: fn(pool, *xs), pool, blocks)
    return pool, jax.tree.map(lambda y: y.reshape(rows, *y.shape[2:]), outs)


CHUNK_BLOCK = 8  # chunks prepared together: the table's padding (about one chunk per row of the bucket) is skipped


def carry_chunks(prepare: Callable, chunk: Callable, table: ChunkTable, pool: jax.Array, slots: jax.Array,
                 has_initial: jax.Array, out: jax.ShapeDtypeStruct, checkpoint_counts: jax.Array | None = None,
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Each row's state carried through its chunks in order, block by block of `CHUNK_BLOCK` chunks, on the pool.

    `prepare(block)` does the work that needs no state for the chunks of `block` (a `ChunkTable` of
    `CHUNK_BLOCK` chunks, the token fields unchanged): a pytree with those chunks on its leading axis. Then
    `chunk(prepared, state, count)`, with `prepared` one chunk's slice -> (its output, the state after it, the
    state after its first `count` tokens or None), where `state` is the state before the chunk and `count` is its
    entry of `checkpoint_counts` (None without checkpoints).

    A row's state starts from `pool[slots[row]]` (zeros where `has_initial` is False) and the state after each of
    its chunks is written back there in place (never to the null slot 0): no whole-batch gather, select or scatter
    of the rows' states (8 MB each for 64 GDN rows of the vs_vllm model), so a row without tokens, such as a
    decode row of a mixed step aimed at the null slot, costs nothing. A fresh row without tokens gets zeros.

    Only blocks that hold some row's chunks run, in a loop as long as they are: a prefill bucket's table is sized
    for a partial chunk in every row and is largely padding (at chunk 16, 128 slots for the 71 real chunks of a
    1,024-token step over 64 rows), which preparing the whole table at once also computed.
    The table's length must be a multiple of `CHUNK_BLOCK` (`chunk_table(..., multiple_of=CHUNK_BLOCK)`).
    Returns (outputs [NC, *out.shape] (zeros for padding chunks), the pool, checkpoint states [R, ...] or None, a
    row's initial state where it has no checkpoint)."""
    if table.rows.shape[0] % CHUNK_BLOCK:  # a clamped last block would misalign with its chunks
        raise ValueError(f"chunk table of {table.rows.shape[0]} chunks is not whole blocks of {CHUNK_BLOCK}")
    num_rows, num_slots = slots.shape[0], pool.shape[0]
    num_real = jnp.sum(table.rows < num_rows)

    def step(first, prepared, i, carry):
        state, pool, checkpoint, outs = carry
        n = first + i
        row = table.rows[n]
        index = jnp.minimum(row, num_rows - 1)
        slot = slots[index]
        # the carried pool: no other row writes this slot, and reading the argument would keep a copy of it alive
        initial = lambda: jnp.where(has_initial[index], pool[slot].astype(jnp.float32), 0.0)
        state = jax.lax.cond(table.first[n], initial, lambda: state)
        count = None if checkpoint_counts is None else checkpoint_counts[n]
        output, state, at = chunk(jax.tree.map(lambda x: x[i], prepared), state, count)
        if count is not None:
            checkpoint = checkpoint.at[jnp.where(count > 0, row, num_rows)].set(at, mode="drop")
        target = jnp.where((row < num_rows) & (slot > 0), slot, num_slots)
        pool = pool.at[target].set(state.astype(pool.dtype), mode="drop")
        return state, pool, checkpoint, outs.at[n].set(output)

    def block(b, carry):
        first = b * CHUNK_BLOCK
        prepared = prepare(table.block(first, CHUNK_BLOCK))
        last = jnp.minimum(num_real - first, CHUNK_BLOCK)
        return jax.lax.fori_loop(0, last, functools.partial(step, first, prepared), carry)

    checkpoint = None if checkpoint_counts is None else gather_slots(pool, slots, has_initial).astype(jnp.float32)
    pool = _reset_empty_rows(pool, table, slots, has_initial)
    outs = jnp.zeros(table.rows.shape + out.shape, out.dtype)
    carry = (jnp.zeros(pool.shape[1:], jnp.float32), pool, checkpoint, outs)
    _, pool, checkpoint, outs = jax.lax.fori_loop(0, real_blocks(table, num_rows, CHUNK_BLOCK), block, carry)
    return outs, pool, checkpoint


def _reset_empty_rows(pool: jax.Array, table: ChunkTable, slots: jax.Array, has_initial: jax.Array) -> jax.Array:
    """Zeros in the slots of fresh rows without tokens (a row without tokens ends in its initial state), one slot per
    loop trip, usually none: cheaper than a scatter over every row's slot in every call."""
    lengths = jnp.zeros(slots.shape[0], jnp.int32).at[table.rows].add(table.lengths, mode="drop")
    fresh = (lengths == 0) & ~has_initial & (slots > 0)
    order = jnp.argsort(~fresh, stable=True)  # fresh rows first
    zero = jnp.zeros(pool.shape[1:], pool.dtype)
    return jax.lax.fori_loop(0, jnp.sum(fresh), lambda i, pool: pool.at[slots[order[i]]].set(zero), pool)


def carry_rows(run: Callable, initial_state: jax.Array) -> tuple[Any, jax.Array]:
    """`run(pool, slots, has_initial) -> (outputs, pool)` on per-row initial states [R, ...] rather than a pool:
    each row gets a slot of its own after a null slot 0. Returns (outputs, final states [R, ...])."""
    pool = jnp.concatenate([jnp.zeros_like(initial_state[:1]), initial_state])
    num_rows = initial_state.shape[0]
    outputs, pool = run(pool, jnp.arange(1, num_rows + 1, dtype=jnp.int32), jnp.ones(num_rows, bool))
    return outputs, pool[1:]
