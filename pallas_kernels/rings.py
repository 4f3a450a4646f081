"""ReplaySSM rings: appending a step's entries, folding committed entries into a state, and the
snapshot-every-position baseline's reads and writes."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.pools import scatter_slots
from pallas_kernels.varlen import dense_to_rows, token_rows

# `pin` fences each small term of a recurrent update, and the state update as a whole, into expressions that every
# program computes alike: XLA:CPU contracts mul and add into FMAs, so an expression fused with different neighbours
# could round differently, and ReplaySSM with W = 1 must reproduce plain decoding bit for bit. The references' reads
# are sums of products, not dots, for the same reason: XLA:CPU's dots round differently with the batch's size, and
# `in_row_blocks` makes blocks of other sizes.
pin = jax.lax.optimization_barrier


def fold_ring(advance: Callable, state: jax.Array, rings: tuple[jax.Array, ...], ring_start: jax.Array,
              count: jax.Array, max_count: int) -> jax.Array:
    """One row's state advanced by its ring entries (ring_start + j) % E, j < count <= max_count: `advance(state,
    *entry)` with entry j of each [X, E, ...] ring page.

    Unrolled to the static bound: under vmap a loop to each row's own count becomes a while loop that copies the
    batch's states every trip (docs/benchmarks.md#where-a-cpu-decode-step-goes). Entries past
    `count` are zeros, which `advance` must map to the state itself (a decay of e^0 and a write of zero): that
    costs no select over the state."""
    width = rings[0].shape[1]
    for j in range(max_count):
        index = (ring_start + j) % width
        state = advance(state, *(jnp.where(j < count, jnp.take(ring, index, axis=1), 0) for ring in rings))
    return state


def append_ring(page: jax.Array, new: jax.Array, ring_start, committed, lengths) -> jax.Array:
    """Write new entries i < lengths[r] at ring index (ring_start + committed + i) % E, per row.

    page: [R, X, E, ...] (ring axis 2); new: [R, X, N <= E, ...] in logical order. Other entries are kept. One
    select per new entry (N is 1 + k), cheaper on XLA:CPU than a gather that rotates the new entries into place."""
    width = page.shape[2]
    logical = (jnp.arange(width)[None, :] - ring_start[:, None] - committed[:, None]) % width  # [R, E]
    expand = (slice(None), None, slice(None)) + (None,) * (page.ndim - 3)
    for i in range(new.shape[2]):
        take = ((logical == i) & (i < lengths[:, None]))[expand]
        page = jnp.where(take, new[:, :, i : i + 1], page)
    return page


def append_dense_rows(rings, new_entries, slots, ring_start, committed, lengths) -> tuple:
    """`append_ring` for each (ring pool [S, X, E, ...], row tokens [R, N <= E, X, ...]) pair, on the rows' slots."""
    return tuple(
        scatter_slots(ring, slots, append_ring(ring[slots], jnp.moveaxis(new, 1, 2), ring_start, committed, lengths))
        for ring, new in zip(rings, new_entries, strict=True)
    )


def append_tokens(ring: jax.Array, values: jax.Array, cu_seqlens, slots, ring_start, committed) -> jax.Array:
    """Scatter each packed token's entry to ring index (ring_start + committed + i) % E of its row's slot.

    ring: [S, X, E, ...]; values: [T, X, ...], token i of row r. Padding tokens and the null slot drop.
    Same result as `append_ring` on gathered pages, without touching the other entries.
    """
    num_slots, width = ring.shape[0], ring.shape[2]
    tok = token_rows(cu_seqlens, values.shape[0])
    rows = jnp.minimum(tok.rows, slots.shape[0] - 1)
    index = (ring_start[rows] + committed[rows] + tok.positions) % width
    target = jnp.where(tok.valid & (slots[rows] > 0), slots[rows], num_slots)
    return ring.at[target, :, index].set(values.astype(ring.dtype), mode="drop")


def snapshot_at(state_pool: jax.Array, snapshots: jax.Array, slots: jax.Array, ring_start: jax.Array,
                count: jax.Array) -> jax.Array:
    """[R, H, ...] f32 state of each slot after its first `count` entries, with snapshots for entries:
    S0 when count == 0, else the snapshot at ring index (ring_start + count - 1) % E.

    state_pool: [S, H, ...]; snapshots: [S, H, E, ...] the full state after each ring entry.
    """
    entry = (ring_start + count - 1) % snapshots.shape[2]
    taken = snapshots[slots[:, None], jnp.arange(snapshots.shape[1])[None, :], entry[:, None]]
    live = (count > 0).reshape((-1,) + (1,) * (taken.ndim - 1))
    return jnp.where(live, taken, state_pool[slots]).astype(jnp.float32)


def store_snapshots(state_pool, snapshots, checkpoint, states, cu_seqlens, slots, ring_start, committed, flush,
                    num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """A snapshot verify's writes: flushed rows' live state `checkpoint` [R, H, ...] becomes S0, and the state
    after each row token, `states` [R, Tq, H, ...], goes to its ring position (`append_tokens`)."""
    state_pool = scatter_slots(state_pool, jnp.where(flush, slots, 0), checkpoint)
    packed = dense_to_rows(states, cu_seqlens, num_tokens)
    return state_pool, append_tokens(snapshots, packed, cu_seqlens, slots, ring_start, committed)


@functools.partial(jax.jit, donate_argnames="state_pool")
def snapshot_materialize(state_pool, snapshots, src_slots, dst_slots, ring_start, num_entries) -> jax.Array:
    """state_pool[dst] = the state of src after num_entries entries (`snapshot_at`): a whole-state copy,
    so XLA on every backend. dst 0 = skip; src and snapshots untouched."""
    return scatter_slots(state_pool, dst_slots, snapshot_at(state_pool, snapshots, src_slots, ring_start, num_entries))
