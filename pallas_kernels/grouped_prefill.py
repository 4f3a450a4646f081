"""Two-phase prefill for same-step checkpoint pairing (DESIGN "Application-directed checkpoints").

Phase 1 runs every producer row in one packed call, which leaves each producer's checkpoint in a slot
(its running slot when its chunk is cut at the checkpoint, else the op's `checkpoint_slots`). The
checkpoint pages are then copied into the consumers' running slots on device, and phase 2 runs every
other row in one packed call. The scheduler packs producer rows first, so both phases reuse the same
token buffers with rewritten `cu_seqlens`: rows of the other phase become zero-length rows aimed at
the null slot and their tokens become padding.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.common import copy_slots

# run(cu_seqlens, pool, slots, has_initial) -> (outputs [T, ...], pool): one op's pool-level prefill
# with its token arrays and options bound, e.g. functools.partial over `gdn_prefill`.
PrefillFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def grouped_prefill(
    run: PrefillFn,
    cu_seqlens: jax.Array,
    num_producers: jax.Array,
    pool: jax.Array,
    slots: jax.Array,
    has_initial: jax.Array,
    copy_src: jax.Array,
    copy_dst: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Run producers, copy their checkpoints into consumer slots, then run everything else.

    Args:
      run: the op's prefill, see `PrefillFn`; called twice with the same shapes (one compile).
      cu_seqlens: [R+1] i32 of all rows; rows [0, num_producers) are the producers.
      num_producers: i32 scalar (data, not static).
      pool: the op's slot pool ([S, ...]), updated in place.
      slots: [R] i32 running slots.  has_initial: [R] bool (consumers: True, they start from the copy).
      copy_src, copy_dst: [M] i32 slot pairs copied between the phases (padding pairs: 0 -> 0).

    Returns:
      outputs [T, ...] of both phases, pool.
    """
    producer = jnp.arange(slots.shape[0]) < num_producers
    split = cu_seqlens[num_producers]
    out1, pool = run(jnp.minimum(cu_seqlens, split), pool, jnp.where(producer, slots, 0), has_initial & producer)
    pool = copy_slots(pool, copy_src, copy_dst)
    out2, pool = run(jnp.maximum(cu_seqlens, split), pool, jnp.where(producer, 0, slots), has_initial & ~producer)
    first_phase = jnp.arange(out1.shape[0]) < split
    return jnp.where(first_phase.reshape((-1,) + (1,) * (out1.ndim - 1)), out1, out2), pool
