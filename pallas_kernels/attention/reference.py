"""Pure-JAX ragged paged attention: packed varlen queries over a paged KV pool, causal per row, GQA."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tiles import HIGHEST
from pallas_kernels.varlen import chunk_table, gather_chunks, max_num_chunks, real_blocks, scatter_chunks

FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448: e4m3fn has no infinity, a cast past it would be NaN


def is_fp8(pool) -> bool:
    """Whether a pool holds float8 e4m3 values, each the stored tensor divided by its per-tensor scale."""
    return pool.dtype == jnp.float8_e4m3fn


def quantize(x, dtype, scale: float = 1.0):
    """x as a pool of `dtype` stores it: cast, or for an fp8 pool x / scale saturated to +-448 then cast (vLLM's
    `scaled_fp8_quant`)."""
    if jnp.dtype(dtype) != jnp.float8_e4m3fn:
        return x.astype(dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(dtype)


def write_kv(k, v, k_pool, v_pool, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0):
    """Store each token's K/V at flat slot `block * BS + offset` (padding tokens -> null block 0), quantized
    to the pools' dtype (`quantize`)."""
    num_blocks, block_size = k_pool.shape[:2]
    flat = (num_blocks * block_size,) + k_pool.shape[2:]
    k_pool = k_pool.reshape(flat).at[slot_mapping].set(quantize(k, k_pool.dtype, k_scale)).reshape(k_pool.shape)
    v_pool = v_pool.reshape(flat).at[slot_mapping].set(quantize(v, v_pool.dtype, v_scale)).reshape(v_pool.shape)
    return k_pool, v_pool


KEY_SPAN_BLOCKS = 8  # KV blocks per softmax step: [tile x 8 BS] score matmuls, not [1 x BS] ones per token
MAX_TILE = 64
BLOCK_QUERIES = 1024  # query tokens per loop trip; smaller blocks are slower on XLA:CPU (docs/benchmarks.md)


def tokens_per_tile(num_tokens: int, num_rows: int) -> int:
    """Query tokens that share one gather of their row's KV: 1 in decode buckets, up to 64 in prefill ones.

    A tile never straddles rows, so a bucket averaging T / R tokens a row gets tiles of about that size (a
    power of two): gathers shrink by the tile size while decode rows waste no query slots.
    """
    per_row = -(-num_tokens // max(num_rows, 1))
    return min(MAX_TILE, 1 << (per_row - 1).bit_length())


def _online_softmax_step(carry, scores, values):
    """FlashAttention-2's online softmax: the running max / sum update. scores [NC, HKV, C * Q, K] (-inf = masked)."""
    running_max, running_sum, acc = carry
    new_max = jnp.maximum(running_max, scores.max(-1))
    # A fully masked prefix keeps max = -inf; shift by 0 there so exp(-inf - 0) = 0, not NaN.
    safe_max = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    probs = jnp.exp(scores - safe_max[..., None])
    rescale = jnp.exp(running_max - safe_max)
    acc = rescale[..., None] * acc + jnp.einsum("ngmk,ngkd->ngmd", probs, values, precision=HIGHEST)
    return new_max, rescale * running_sum + probs.sum(-1), acc


@functools.partial(jax.jit, static_argnames=("scale", "k_scale", "v_scale"))
def ragged_paged_attention(q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale,
                           k_scale: float = 1.0, v_scale: float = 1.0):
    """Write the new K/V into the paged pool, then attend causally within each row.

    Query token i of row r sits at position context_lens[r] + i and sees cache positions 0..that position
    of row r, read through block_table[r]. One call mixes prefill chunks, decode and verify rows. Softmax
    in fp32. Each row's queries are cut into tiles (`tokens_per_tile`) that read the row's KV together, a
    span of `KEY_SPAN_BLOCKS` blocks per online-softmax step, like the Pallas kernel's programs. Tiles run in
    blocks of `BLOCK_QUERIES` query tokens, only the blocks that hold some row's tiles, each over the spans its
    own rows reach.

    Args:
      q: [T, HQ, Dh] packed queries; tokens at index >= cu_seqlens[-1] are padding.
      k, v: [T, HKV, Dh] new keys/values; query head h uses kv head h // (HQ // HKV).
      k_pool, v_pool: [NB, BS, HKV, Dh] paged cache; block 0 is the null block.
      slot_mapping: [T] i32 flat slot (block * BS + offset) per token; padding tokens -> 0.
      block_table: [R, MB] i32 block ids per row.
      cu_seqlens: [R+1] i32 row boundaries.
      context_lens: [R] i32 tokens of each row in the cache before this step (the plan's).
      scale: softmax scale.
      k_scale, v_scale: the pools' per-tensor scales: a pool entry times its scale is the key or value (fp8 pools).

    Returns:
      o: [T, HQ, Dh] in q.dtype (padding tokens zero), k_pool, v_pool updated.
    """
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows, max_blocks = block_table.shape
    block_size, num_kv_heads = k_pool.shape[1:3]
    tile = tokens_per_tile(num_tokens, num_rows)
    tiles_per_block = max(1, min(BLOCK_QUERIES // tile, max_num_chunks(num_tokens, num_rows, tile)))
    table = chunk_table(cu_seqlens, num_tokens, tile, multiple_of=tiles_per_block)
    rows = jnp.minimum(table.rows, num_rows - 1)
    in_tile = jnp.arange(tile)[None, :] < table.lengths[:, None]  # [NC, C]
    positions = (context_lens[rows] + table.offsets)[:, None] + jnp.arange(tile)  # [NC, C]
    last_position = positions[:, 0] + table.lengths - 1  # [NC]: keys past it are never written for the tile
    reach = jnp.where(table.lengths > 0, last_position + 1, 0)  # [NC]: keys a tile sees
    # the keys' scale folds into the queries' and the values' into the output: the pools are read as stored
    queries = gather_chunks(q.astype(jnp.float32) * (scale * k_scale), table, tile)
    group = num_q_heads // num_kv_heads
    # [NC, HKV, C * G, Dh]: each (tile, kv head) is one [C * G, Dh] x [Dh, K] matmul
    queries = queries.reshape(-1, tile, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    queries = queries.reshape(-1, num_kv_heads, tile * group, head_dim)
    visible_rows = lambda mask: jnp.repeat(mask, group, axis=1)[:, None]  # [NC, C, K] -> [NC, 1, C * G, K]
    span_blocks = min(KEY_SPAN_BLOCKS, max_blocks)
    span = span_blocks * block_size
    spans = jnp.pad(block_table, ((0, 0), (0, -max_blocks % span_blocks)))[rows]  # null block past the table

    def attend(first, out):
        """The tiles [first, first + tiles_per_block): an online softmax over the spans the block's rows reach."""
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, first, tiles_per_block)
        block_queries, block_positions, block_in_tile, block_last, block_spans = map(
            cut, (queries, positions, in_tile, last_position, spans))

        def step(j, carry):
            blocks = jax.lax.dynamic_slice_in_dim(block_spans, j * span_blocks, span_blocks, axis=1)  # [NB, SB]
            key_positions = j * span + jnp.arange(span)
            keys = k_pool[blocks].reshape(-1, span, num_kv_heads, head_dim).transpose(0, 2, 1, 3)  # [NB, HKV, K, Dh]
            scores = jnp.einsum("ngmd,ngkd->ngmk", block_queries, keys.astype(jnp.float32), precision=HIGHEST)
            visible = (key_positions <= block_positions[..., None]) & block_in_tile[..., None]  # [NB, C, K]
            scores = jnp.where(visible_rows(visible), scores, -jnp.inf)
            # Select, not multiply by a zero probability: an unwritten pool position may hold NaN or Inf.
            written = (key_positions <= block_last[:, None])[:, None, :, None]  # [NB, 1, K, 1]
            values = v_pool[blocks].reshape(-1, span, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
            values = jnp.where(written, values.astype(jnp.float32), 0.0)
            return _online_softmax_step(carry, scores, values)

        heads = block_queries.shape[:-1]
        init = (jnp.full(heads, -jnp.inf), jnp.zeros(heads), jnp.zeros(block_queries.shape))
        # only the spans the block's rows reach: the table is as wide as max_model_len, contexts are mostly shorter
        num_spans = jnp.minimum((jnp.max(cut(reach)) + span - 1) // span, spans.shape[1] // span_blocks)
        _, total, acc = jax.lax.fori_loop(0, num_spans, step, init)
        o = acc / jnp.where(total == 0, 1.0, total)[..., None]
        return jax.lax.dynamic_update_slice_in_dim(out, o, first, axis=0)

    # Only the blocks that hold tiles: the table has a partial tile's room in every row, mostly padding.
    o = jax.lax.fori_loop(0, real_blocks(table, num_rows, tiles_per_block),
                          lambda b, out: attend(b * tiles_per_block, out), jnp.zeros(queries.shape))
    o = o.reshape(-1, num_kv_heads, tile, group, head_dim).transpose(0, 2, 1, 3, 4) * v_scale  # [NC, C, HKV, G, Dh]
    return scatter_chunks(o, table).reshape(q.shape).astype(q.dtype), k_pool, v_pool
