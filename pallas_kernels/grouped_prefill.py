"""Two-phase prefill for same-step checkpoint pairing (docs/kernels.md#grouped-prefill).

Phase 1 runs every producer row in one packed call, which leaves each producer's checkpoint in a slot
(its running slot when its chunk is cut at the checkpoint, else the op's `checkpoint_slots`). The
checkpoint pages are then copied into the consumers' running slots on device, and phase 2 runs every
other row in one packed call. The scheduler packs producer rows first (after any rows the caller made
zero-length), so both phases reuse the same token buffers with rewritten `cu_seqlens`: rows of the other
phase become zero-length rows aimed at the null slot and their tokens become padding. A step without
pair copies needs no phases and runs one call.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.pools import copy_slots

# run(cu_seqlens, pool, slots, has_initial) -> (outputs [T, ...], pool): one op's pool-level prefill
# with its token arrays and options bound, e.g. functools.partial over `gdn_prefill`; the pool may be a
# pytree of slot pools (a layer's conv window and state), all copied between the phases.
PrefillFn = Callable[[jax.Array, Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


def grouped_prefill(
    run: PrefillFn,
    cu_seqlens: jax.Array,
    num_producers: jax.Array,
    pool: Any,
    slots: jax.Array,
    has_initial: jax.Array,
    copy_src: jax.Array,
    copy_dst: jax.Array,
) -> tuple[jax.Array, Any]:
    """Run producers, copy their checkpoints into consumer slots, then run everything else.

    Args:
      run: the op's prefill, see `PrefillFn`; called twice with the same shapes (one compile).
      cu_seqlens: [R+1] i32 of all rows; rows [0, num_producers) are the producers.
      num_producers: i32 scalar (data, not static).
      pool: the op's slot pool ([S, ...]) or a pytree of them, updated in place.
      slots: [R] i32 running slots.  has_initial: [R] bool (consumers: True, they start from the copy).
      copy_src, copy_dst: [M] i32 slot pairs copied between the phases (padding pairs: 0 -> 0).

    Returns:
      outputs [T, ...] of both phases, pool.
    """

    # without pair copies there is one phase over every row; the op is traced once either way
    paired = jnp.any(copy_dst > 0)
    split = jnp.where(paired, cu_seqlens[num_producers], cu_seqlens[-1])
    producer = jnp.arange(slots.shape[0]) < jnp.where(paired, num_producers, slots.shape[0])

    def phase(i, carry):
        out, pool = carry
        first = i == 0
        in_phase = producer == first
        cu = jnp.where(first, jnp.minimum(cu_seqlens, split), jnp.maximum(cu_seqlens, split))
        phase_out, pool = run(cu, pool, jnp.where(in_phase, slots, 0), has_initial & in_phase)
        pool = jax.lax.cond(first & paired, lambda p: jax.tree.map(lambda x: copy_slots(x, copy_src, copy_dst), p),
                            lambda p: p, pool)
        tokens = jnp.arange(out.shape[0])
        mine = (tokens < split) == first
        return jnp.where(mine.reshape((-1,) + (1,) * (out.ndim - 1)), phase_out, out), pool

    out = jax.eval_shape(lambda: run(cu_seqlens, pool, slots, has_initial)[0])
    return jax.lax.fori_loop(0, 1 + paired.astype(jnp.int32), phase, (jnp.zeros(out.shape, out.dtype), pool))
