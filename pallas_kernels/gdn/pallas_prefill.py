"""Pallas (Triton backend) chunked GDN prefill (WY/UT form, kernels_models §1.4) on the state pool.

One program per (row, value head, V tile) walks its row's chunks in order with the [K, BV] state tile in
registers (the FLA `chunk_gated_delta_rule_fwd_h` loop fused with the intra-chunk work). The unit lower
triangular inverse (I + A)^-1 is the reference's row-by-row forward substitution, written with masks and
reductions because the Triton backend cannot index a row of an in-register tile.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import HIGHEST, check_rows, zero_padding
from pallas_kernels.gdn.reference import normalise_qk, unit_lower_inverse

MAX_BLOCK_V = 64


def _dot(a, b):
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)


def _dot_nt(a, b):
    """a b^T without materialising b^T."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _dot_tn(a, b):
    """a^T b without materialising a^T."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=jnp.float32)


def _load_chunk(ref, start, length, size, index, cols=None):
    """Rows [start, start + size) of ref[:, index(, cols)], zero past `length` (f32)."""
    rows = pl.ds(start, size)
    view = ref.at[rows, index] if cols is None else ref.at[rows, index, cols]
    mask = jnp.arange(size) < length
    if view.ndim == 2:
        mask = mask[:, None]
    return plt.load(view, mask=mask, other=0).astype(jnp.float32)


def _gdn_prefill_kernel(
    cu_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32
    checkpoint_lens_ref,  # [R] i32 (-1: none)
    checkpoint_slots_ref,  # [R] i32 (0: none)
    q_ref,  # [T, H, K] f32, normalised and scaled
    k_ref,  # [T, H, K] f32, normalised
    v_ref,  # [T, HV, V]
    g_ref,  # [T, HV] f32
    beta_ref,  # [T, HV] f32
    state_ref,  # [S, HV, K, V] f32
    o_ref,  # [T, HV, V] f32
    state_out_ref,  # [S, HV, K, V] f32, aliases state_ref
    *,
    group: int,
    block_v: int,
    chunk_size: int,
):
    i_r, i_h = pl.program_id(0), pl.program_id(1)
    i_k, cols = i_h // group, pl.ds(pl.program_id(2) * block_v, block_v)
    slot, bos, eos = slots_ref[i_r], cu_ref[i_r], cu_ref[i_r + 1]
    ckpt_len, ckpt_slot = checkpoint_lens_ref[i_r], checkpoint_slots_ref[i_r]
    # where, not a product: a stale slot may hold NaN or Inf, and 0 * NaN is NaN.
    state = jnp.where(has_initial_ref[i_r] != 0, state_ref[slot, i_h, :, cols], 0.0)
    row_i = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 0)
    col_j = jax.lax.broadcasted_iota(jnp.int32, (chunk_size, chunk_size), 1)
    positions = jnp.arange(chunk_size)

    @pl.when((ckpt_len == 0) & (ckpt_slot > 0) & (slot > 0))
    def _():
        state_out_ref[ckpt_slot, i_h, :, cols] = state

    def chunk(c, s):
        start = bos + c * chunk_size
        length = jnp.minimum(eos - start, chunk_size)
        q = _load_chunk(q_ref, start, length, chunk_size, i_k)  # [C, K]
        k = _load_chunk(k_ref, start, length, chunk_size, i_k)
        v = _load_chunk(v_ref, start, length, chunk_size, i_h, cols)  # [C, BV]
        g = _load_chunk(g_ref, start, length, chunk_size, i_h)  # [C]
        beta = _load_chunk(beta_ref, start, length, chunk_size, i_h)
        cum = jnp.cumsum(g)
        # Mask before exp: G_i - G_j > 0 above the diagonal and may overflow.
        gamma = jnp.exp(jnp.where(row_i >= col_j, cum[:, None] - cum[None, :], -jnp.inf))
        a = jnp.where(row_i > col_j, beta[:, None] * _dot_nt(k, k) * gamma, 0.0)
        inverse = unit_lower_inverse(a)
        u = _dot(inverse, beta[:, None] * v)
        w = _dot(inverse, (beta * jnp.exp(cum))[:, None] * k)
        v_new = u - _dot(w, s)  # corrections relative to the chunk's start state
        o = _dot(q * jnp.exp(cum)[:, None], s) + _dot(_dot_nt(q, k) * gamma, v_new)
        plt.store(o_ref.at[pl.ds(start, chunk_size), i_h, cols], o, mask=(positions < length)[:, None])

        def state_after(count):  # e^{G_p} S + sum_{j<count} e^{G_p - G_j} k_j v_new_j, p = count - 1
            cum_p = jnp.sum(jnp.where(positions == count - 1, cum, 0.0))
            weights = jnp.where(positions < count, jnp.exp(cum_p - cum), 0.0)
            return jnp.exp(cum_p) * s + _dot_tn(k * weights[:, None], v_new)

        count = ckpt_len - c * chunk_size

        @pl.when((count >= 1) & (count <= length) & (ckpt_slot > 0) & (slot > 0))
        def _():
            state_out_ref[ckpt_slot, i_h, :, cols] = state_after(count)

        return state_after(length)

    num_chunks = (eos - bos + chunk_size - 1) // chunk_size
    state = jax.lax.fori_loop(0, num_chunks, chunk, state)

    @pl.when(slot > 0)
    def _():
        state_out_ref[slot, i_h, :, cols] = state


@functools.partial(
    jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size", "interpret"), donate_argnames="state_pool"
)
def gdn_prefill(
    q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, scale=None, use_qk_l2norm=True, chunk_size=64, interpret=False,
):  # fmt: skip
    """Pallas chunked prefill; contract in `pallas_kernels.gdn.gdn_prefill`."""
    check_rows(cu_seqlens, slots, "slots")
    num_tokens, num_heads, head_v = v.shape
    block_v = min(head_v, MAX_BLOCK_V)
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    none = jnp.zeros_like(slots)
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = none - 1, none
    operands = dict(
        cu_seqlens=cu_seqlens, slots=slots, has_initial=has_initial.astype(jnp.int32),
        checkpoint_lens=checkpoint_lens, checkpoint_slots=checkpoint_slots, q=qn, k=kn, v=v,
        g=g.astype(jnp.float32), beta=beta.astype(jnp.float32), state=state_pool,
    )  # fmt: skip
    kernel = functools.partial(
        _gdn_prefill_kernel, group=num_heads // q.shape[1], block_v=block_v, chunk_size=chunk_size
    )
    o, state_pool = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_heads, head_v), jnp.float32),
            jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        ),
        grid=(slots.shape[0], num_heads, head_v // block_v),
        input_output_aliases={list(operands).index("state"): 1},
        interpret=interpret,
        name=f"gdn_prefill_{block_v=}_{chunk_size=}",
    )(*operands.values())
    return zero_padding(o, cu_seqlens, v.dtype), state_pool
