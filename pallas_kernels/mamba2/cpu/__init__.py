"""Mamba2 SSD decode, prefill and ReplaySSM verify as C++ XLA FFI kernels for CPU (`ssd.cc`,
docs/kernels.md#cpu-ffi-kernels).

XLA:CPU runs the reference's state gather, decay, read-out, write and scatter as separate loops over the states;
the kernels walk each row's state once per token, in place in the donated pools; prefill too, token by token (as
in `pallas_kernels.gdn.cpu`). Same arguments, results and pool contract as `pallas_kernels.mamba2.ssd_decode` /
`ssd_prefill` / `ssd_verify`, and one more precondition: no two rows aim at the same slot other than the null
slot 0 (the call fails; the scheduler never does it).

The library is built and registered by `pallas_kernels.cpu_ffi` (`available()`); without a compiler, or where
the build fails, the ops here run the reference. They also run it on bf16 state pools (the kernels read and
write f32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_ffi import result_like, runs_kernel
from pallas_kernels.mamba2 import reference
from pallas_kernels.mamba2.reference import _f32
from pallas_kernels.varlen import check_rows

DECODE_TARGET, PREFILL_TARGET, VERIFY_TARGET = "jaxhybrid_ssd_decode", "jaxhybrid_ssd_prefill", "jaxhybrid_ssd_verify"


@functools.partial(jax.jit, donate_argnames="state_pool")
def _rows(x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial):
    """Rows token by token from their slots: decode, or prefill with `has_initial` (None: decode)."""
    target, fresh = (DECODE_TARGET, ()) if has_initial is None else (PREFILL_TARGET, (has_initial.astype(jnp.int32),))
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(x.shape, jnp.float32), result_like(state_pool)),
                            input_output_aliases={7: 1})
    y, state_pool = call(*_f32(x, dt, A, B, C, D), cu_seqlens.astype(jnp.int32), state_pool, slots.astype(jnp.int32),
                         *fresh)
    return y.astype(x.dtype), state_pool


@functools.partial(jax.jit, donate_argnames=("state_pool", "ring_x", "ring_dt", "ring_B"))
def _verify(x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush):
    pools = (state_pool, ring_x, ring_dt, ring_B)
    call = jax.ffi.ffi_call(VERIFY_TARGET, (jax.ShapeDtypeStruct(x.shape, jnp.float32), *map(result_like, pools)),
                            input_output_aliases={7: 1, 8: 2, 9: 3, 10: 4})
    trackers = (t.astype(jnp.int32) for t in (slots, ring_start, committed, flush))
    y, *pools = call(*_f32(x, dt, A, B, C, D), cu_seqlens.astype(jnp.int32), *pools, *trackers)
    return y.astype(x.dtype), *pools


def ssd_decode(x, dt, A, B, C, D, cu_seqlens, state_pool, slots):
    """`pallas_kernels.mamba2.ssd_decode` on the CPU kernel (rows of any length run token by token)."""
    check_rows(cu_seqlens, slots, "slots")
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, slots)
    return _rows(*args, None) if runs_kernel(state_pool) else reference.ssd_decode(*args)


def ssd_prefill(x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None,
                checkpoint_slots=None, *, chunk_size):
    """`pallas_kernels.mamba2.ssd_prefill` on the CPU kernel. Mid-row checkpoints (`checkpoint_lens`, which the
    engine does not use: its producers end their rows at the checkpoint) run the reference, chunked by
    `chunk_size`, as do bf16 state pools."""
    check_rows(cu_seqlens, slots, "slots")
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial)
    if checkpoint_lens is not None or not runs_kernel(state_pool):
        return reference.ssd_prefill(*args, checkpoint_lens, checkpoint_slots, chunk_size=chunk_size)
    return _rows(*args)


def ssd_verify(
    x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush,
    *, max_query_len=None, max_committed=None,
):  # fmt: skip
    """`pallas_kernels.mamba2.ssd_verify` on the CPU kernel; it stops at each row's own T_r and `committed`, so
    the static bounds matter only to the reference it falls back to."""
    check_rows(cu_seqlens, slots, "slots")
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush)
    if not runs_kernel(state_pool, ring_x, ring_dt, ring_B):
        return reference.ssd_verify(*args, max_query_len=max_query_len, max_committed=max_committed)
    return _verify(*args)
