"""Gated DeltaNet decode, prefill and ReplaySSM verify as C++ XLA FFI kernels for CPU (`gdn.cc`,
docs/kernels.md#cpu-ffi-kernels).

XLA:CPU runs the reference's state gather, decay, reads, write and scatter as separate loops over the states;
the kernels walk each row's state once, in place in the donated pools. Prefill runs the recurrence token by token
as decode does: on a CPU that takes about half the reference's chunked form (whose matrix products pay off on
matrix units), and a row's state stays in cache through all its tokens. Same arguments, results and pool contract
as `pallas_kernels.gdn.gdn_decode` / `gdn_prefill` / `gdn_verify`, and one more precondition: no two rows aim at
the same slot other than the null slot 0 (the call fails; the scheduler never does it).

The library is built and registered by `pallas_kernels.cpu_ffi` (`available()`); without a compiler, or where
the build fails, the ops here run the reference. They also run it on bf16 state pools (the kernels read and
write f32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_ffi import result_like, runs_kernel
from pallas_kernels.gdn import reference
from pallas_kernels.gdn.reference import normalise_qk
from pallas_kernels.varlen import check_rows

DECODE_TARGET, PREFILL_TARGET, VERIFY_TARGET = "jaxhybrid_gdn_decode", "jaxhybrid_gdn_prefill", "jaxhybrid_gdn_verify"


def _token_inputs(q, k, v, g, beta, scale, use_qk_l2norm):
    """The kernels' f32 token inputs: q^ (scaled) and k^ per qk head as the reference normalises them, v, g, beta."""
    q_hat, k_hat = normalise_qk(q, k, scale, use_qk_l2norm)
    return q_hat, k_hat, *(x.astype(jnp.float32) for x in (v, g, beta))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnames="state_pool")
def _rows(q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, *, scale, use_qk_l2norm):
    """Rows token by token from their slots: decode, or prefill with `has_initial` (None: decode)."""
    tokens = _token_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    target, fresh = (DECODE_TARGET, ()) if has_initial is None else (PREFILL_TARGET, (has_initial.astype(jnp.int32),))
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(v.shape, jnp.float32), result_like(state_pool)),
                            input_output_aliases={6: 1})
    o, state_pool = call(*tokens, cu_seqlens.astype(jnp.int32), state_pool, slots.astype(jnp.int32), *fresh)
    return o.astype(v.dtype), state_pool


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"),
                   donate_argnames=("state_pool", "ring_k", "ring_u", "ring_g"))
def _verify(q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush, *,
            scale, use_qk_l2norm):
    tokens = _token_inputs(q, k, v, g, beta, scale, use_qk_l2norm)
    pools = (state_pool, ring_k, ring_u, ring_g)
    call = jax.ffi.ffi_call(VERIFY_TARGET, (jax.ShapeDtypeStruct(v.shape, jnp.float32), *map(result_like, pools)),
                            input_output_aliases={6: 1, 7: 2, 8: 3, 9: 4})
    trackers = (x.astype(jnp.int32) for x in (slots, ring_start, committed, flush))
    o, *pools = call(*tokens, cu_seqlens.astype(jnp.int32), *pools, *trackers)
    return o.astype(v.dtype), *pools


def gdn_decode(q, k, v, g, beta, cu_seqlens, state_pool, slots, *, scale=None, use_qk_l2norm=True):
    """`pallas_kernels.gdn.gdn_decode` on the CPU kernel (rows of any length run token by token)."""
    check_rows(cu_seqlens, slots, "slots")
    if not runs_kernel(state_pool):
        return reference.gdn_decode(q, k, v, g, beta, cu_seqlens, state_pool, slots, scale=scale,
                                    use_qk_l2norm=use_qk_l2norm)
    return _rows(q, k, v, g, beta, cu_seqlens, state_pool, slots, None, scale=scale, use_qk_l2norm=use_qk_l2norm)


def gdn_prefill(q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None,
                checkpoint_slots=None, *, scale=None, use_qk_l2norm=True, chunk_size):
    """`pallas_kernels.gdn.gdn_prefill` on the CPU kernel. Mid-row checkpoints (`checkpoint_lens`, which the
    engine does not use: its producers end their rows at the checkpoint) run the reference, chunked by
    `chunk_size`, as do bf16 state pools."""
    check_rows(cu_seqlens, slots, "slots")
    if checkpoint_lens is not None or not runs_kernel(state_pool):
        return reference.gdn_prefill(q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens,
                                     checkpoint_slots, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    return _rows(q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, scale=scale,
                 use_qk_l2norm=use_qk_l2norm)


def gdn_verify(
    q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, max_query_len=None, max_committed=None,
):  # fmt: skip
    """`pallas_kernels.gdn.gdn_verify` on the CPU kernel; it stops at each row's own T_r and `committed`, so the
    static bounds matter only to the reference it falls back to."""
    check_rows(cu_seqlens, slots, "slots")
    args = (q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush)
    if not runs_kernel(state_pool, ring_k, ring_u, ring_g):
        return reference.gdn_verify(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, max_query_len=max_query_len,
                                    max_committed=max_committed)
    return _verify(*args, scale=scale, use_qk_l2norm=use_qk_l2norm)
