"""Pallas (Triton backend) ragged paged attention: one kernel for prefill chunks, decode and verify rows.

Grid: (query tile, query head). Each row's queries are cut into tiles of `block_q` tokens (a tile never
straddles rows; FLA `prepare_chunk_indices`); the tile table is built in XLA so the grid is static and
surplus programs exit. A program walks its row's KV blocks through the block table with an online
softmax (FlashAttention-2 §3.1.1). New K/V are written into the pool by XLA before the kernel runs, so the
kernel only reads the pools.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention.reference import write_kv
from pallas_kernels.common import chunk_table, zero_padding


def _attention_kernel(
    tile_rows_ref,  # [NQ] i32, row of each tile (R for surplus tiles)
    tile_starts_ref,  # [NQ] i32, first token of the tile
    tile_lens_ref,  # [NQ] i32, tokens in the tile (0 for surplus tiles)
    cu_seqlens_ref,  # [R+1] i32
    context_lens_ref,  # [R] i32 tokens before this step
    block_table_ref,  # [R, MB] i32
    q_ref,  # [T, HQ, Dh]
    k_pool_ref,  # [NB, BS, HKV, Dh]
    v_pool_ref,  # [NB, BS, HKV, Dh]
    o_ref,  # [T, HQ, Dh]
    *, block_q, block_size, group, scale,
):  # fmt: skip
    i_tile, i_head = pl.program_id(0), pl.program_id(1)
    tile_len = tile_lens_ref[i_tile]

    @pl.when(tile_len > 0)
    def _():
        row, start = tile_rows_ref[i_tile], tile_starts_ref[i_tile]
        row_start, context_len = cu_seqlens_ref[row], context_lens_ref[row]
        offsets = jnp.arange(block_q)
        in_tile = offsets < tile_len
        positions = context_len + (start - row_start) + offsets  # [BQ]
        q = plt.load(q_ref.at[pl.ds(start, block_q), i_head, :], mask=in_tile[:, None], other=0.0)
        q = q.astype(jnp.float32) * scale
        kv_head = i_head // group
        last_position = context_len + (start - row_start) + tile_len - 1

        def body(j, carry):
            running_max, running_sum, acc = carry
            block = block_table_ref[row, j]
            keys = k_pool_ref[block, :, kv_head, :].astype(jnp.float32)  # [BS, Dh]
            key_positions = j * block_size + jnp.arange(block_size)
            # Select, not multiply by a zero probability: a block's unwritten tail may hold NaN or Inf.
            values = jnp.where(
                (key_positions <= last_position)[:, None], v_pool_ref[block, :, kv_head, :].astype(jnp.float32), 0.0
            )
            scores = jnp.dot(q, keys.T, preferred_element_type=jnp.float32)  # [BQ, BS]
            visible = key_positions[None, :] <= positions[:, None]
            scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(running_max, scores.max(axis=1))
            safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
            probs = jnp.where(visible, jnp.exp(scores - safe_max[:, None]), 0.0)
            rescale = jnp.exp(running_max - safe_max)
            acc = rescale[:, None] * acc + jnp.dot(probs, values, preferred_element_type=jnp.float32)
            return new_max, rescale * running_sum + probs.sum(axis=1), acc

        head_dim = q.shape[-1]
        init = (
            jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
            jnp.zeros((block_q, head_dim), jnp.float32),
        )
        num_blocks = last_position // block_size + 1
        _, total, acc = jax.lax.fori_loop(0, num_blocks, body, init)
        out = acc / jnp.where(total == 0.0, 1.0, total)[:, None]
        plt.store(o_ref.at[pl.ds(start, block_q), i_head, :], out.astype(o_ref.dtype), mask=in_tile[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "interpret"))
def ragged_paged_attention(
    q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale,
    block_q: int = 16, interpret: bool = False,
):  # fmt: skip
    """Same contract as `reference.ragged_paged_attention`; `block_q` query tokens per program."""
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pool.shape[1:3]
    # Loads past the last token are masked, but the tile's pl.ds must stay inside the array.
    padded_q = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    table = chunk_table(cu_seqlens, num_tokens, block_q)
    kernel = functools.partial(
        _attention_kernel, block_q=block_q, block_size=block_size, group=num_q_heads // num_kv_heads, scale=scale
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(padded_q.shape, q.dtype),
        grid=(table.rows.shape[0], num_q_heads),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=2),
        name=f"ragged_paged_attention_{block_q=}_{block_size=}",
    )(table.rows, table.starts, table.lengths, cu_seqlens, context_lens, block_table, padded_q, k_pool, v_pool)
    return zero_padding(out[:num_tokens], cu_seqlens, q.dtype), k_pool, v_pool
