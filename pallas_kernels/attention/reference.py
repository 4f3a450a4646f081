"""Pure-JAX ragged paged attention: packed varlen queries over a paged KV pool, causal per row, GQA."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import HIGHEST, token_rows


def write_kv(k, v, k_pool, v_pool, slot_mapping):
    """Store each token's K/V at flat slot `block * BS + offset` (padding tokens -> null block 0)."""
    num_blocks, block_size = k_pool.shape[:2]
    flat = (num_blocks * block_size,) + k_pool.shape[2:]
    k_pool = k_pool.reshape(flat).at[slot_mapping].set(k.astype(k_pool.dtype)).reshape(k_pool.shape)
    v_pool = v_pool.reshape(flat).at[slot_mapping].set(v.astype(v_pool.dtype)).reshape(v_pool.shape)
    return k_pool, v_pool


def _online_softmax_step(carry, scores, values):
    """FlashAttention-2 §3.1.1 running max / sum update. scores [T, G, Q, BS] (-inf = masked)."""
    running_max, running_sum, acc = carry
    new_max = jnp.maximum(running_max, scores.max(-1))
    # A fully masked prefix keeps max = -inf; shift by 0 there so exp(-inf - 0) = 0, not NaN.
    safe_max = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    probs = jnp.exp(scores - safe_max[..., None])
    rescale = jnp.exp(running_max - safe_max)
    acc = rescale[..., None] * acc + jnp.einsum("tgqb,tbgd->tgqd", probs, values, precision=HIGHEST)
    return new_max, rescale * running_sum + probs.sum(-1), acc


@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_paged_attention(q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale):
    """Write the new K/V into the paged pool, then attend causally within each row.

    Query token i of row r sits at position context_lens[r] + i and sees cache positions 0..that position
    of row r, read through block_table[r]. One call mixes prefill
    chunks, decode and verify rows. Softmax in fp32.

    Args:
      q: [T, HQ, Dh] packed queries; tokens at index >= cu_seqlens[-1] are padding.
      k, v: [T, HKV, Dh] new keys/values; query head h uses kv head h // (HQ // HKV).
      k_pool, v_pool: [NB, BS, HKV, Dh] paged cache; block 0 is the null block.
      slot_mapping: [T] i32 flat slot (block * BS + offset) per token; padding tokens -> 0.
      block_table: [R, MB] i32 block ids per row.
      cu_seqlens: [R+1] i32 row boundaries.
      context_lens: [R] i32 tokens of each row in the cache before this step (the plan's).
      scale: softmax scale.

    Returns:
      o: [T, HQ, Dh] in q.dtype (padding tokens zero), k_pool, v_pool updated.
    """
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows = block_table.shape[0]
    block_size, num_kv_heads = k_pool.shape[1:3]
    tok = token_rows(cu_seqlens, num_tokens)
    rows = jnp.minimum(tok.rows, num_rows - 1)
    query_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    positions = context_lens[rows] + tok.positions  # [T]
    group = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, -1, head_dim) * scale

    def step(block_index, carry):
        blocks = block_table[rows, block_index]  # [T]
        keys = k_pool[blocks].astype(jnp.float32)  # [T, BS, HKV, Dh]
        scores = jnp.einsum("tgqd,tbgd->tgqb", group, keys, precision=HIGHEST)
        key_positions = block_index * block_size + jnp.arange(block_size)
        visible = (key_positions[None, :] <= positions[:, None]) & tok.valid[:, None]  # [T, BS]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        # Select, not multiply by a zero probability: an unwritten pool position may hold NaN or Inf.
        values = jnp.where(visible[:, :, None, None], v_pool[blocks].astype(jnp.float32), 0.0)
        return _online_softmax_step(carry, scores, values)

    heads = (num_tokens, num_kv_heads, num_q_heads // num_kv_heads)
    init = (jnp.full(heads, -jnp.inf), jnp.zeros(heads), jnp.zeros(heads + (head_dim,)))
    # only the blocks some row reaches: the table is as wide as max_model_len, contexts are mostly shorter
    reach = jnp.where(query_lens > 0, context_lens + query_lens, 0)
    num_blocks = (jnp.max(reach, initial=0) + block_size - 1) // block_size
    _, total, acc = jax.lax.fori_loop(0, jnp.minimum(num_blocks, block_table.shape[1]), step, init)
    o = acc / jnp.where(total == 0, 1.0, total)[..., None]
    return o.reshape(q.shape).astype(q.dtype), k_pool, v_pool
