"""Pallas (Triton backend) ragged paged attention: one kernel for prefill chunks, decode and verify rows.

Grid: (query tile, KV head, KV split). A tile holds `tokens_per_tile` tokens of one row (a tile never
straddles rows; FLA `prepare_chunk_indices`) times the whole GQA group of the KV head, packed token-major
into the M rows of the dots: row m is token m // GP, query head m % GP of the group (GP = the group padded
to a power of two). Each KV block is then read once per group instead of once per query head, and a
decode row with group 8 fills 8 rows of M, not 1. The tile table is built in XLA so the grid is static;
surplus tiles exit at once.

Split-KV (flash-decoding): with num_splits S > 1, split s of a tile walks the s-th of S equal runs of the
tile's KV blocks and writes its unnormalised accumulator, running max and running sum to f32 partial
outputs; XLA merges the S partials with the log-sum-exp rule. A split past a short row's blocks runs no
block and writes max = -inf, sum = 0, which the merge weighs 0. With S = 1 the kernel normalises and
writes q.dtype directly. New K/V are written into the pool by XLA before the kernel runs, so the kernel
only reads the pools.

Precision: both dots take q.dtype operands (K/V and the probabilities are cast to it; bf16/fp16 run on
tensor cores at `tiles.dot_precision`) and accumulate in f32; softmax statistics and the accumulator stay f32.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention import cost
from pallas_kernels.attention.reference import write_kv
from pallas_kernels.tiles import HIGHEST, Dots, check_dot_sides
from pallas_kernels.varlen import chunk_table, max_num_chunks, zero_padding

MIN_BLOCK_M = 16  # Triton's tensor-core dots want M >= 16
# Programs that fill an H100/H200 (132 SMs) several times over: more splits only add partials to merge.
TARGET_PROGRAMS = 1024
MIN_SPLIT_KEYS = 512  # a split shorter than this spends more on its partial write and merge than it saves
MAX_SPLITS = 16


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def tile_shape(group: int, block_m: int) -> tuple[int, int]:
    """(tokens per tile, padded group) with tokens * padded group = max(block_m, padded group) dot rows."""
    group_pad = _next_pow2(group)
    return max(1, block_m // group_pad), group_pad


def default_block_m(num_tokens: int, num_rows: int, dtype) -> int:
    """16 dot rows for decode/verify-sized buckets (<= 4 tokens a row: a verify row with 3 drafts) and for f32
    queries, else 64.

    A decode row fills only `group` of the M rows, so small M wastes less there; prefill chunks want the
    larger M to read each KV block for more tokens at once. f32 dots are IEEE FMA loops, not tensor-core
    fragments: at M 64 and head dim 256 they need more registers than a thread has and spill
    (`benchmarks/aot_kernels.py`).
    """
    return MIN_BLOCK_M if num_tokens <= 4 * num_rows or jnp.dtype(dtype) == jnp.float32 else 64


def default_num_splits(num_tiles: int, num_kv_heads: int, max_context: int) -> int:
    """Enough KV splits to fill the GPU when the (tile, KV head) grid is small and contexts are long."""
    by_occupancy = TARGET_PROGRAMS // (num_tiles * num_kv_heads)
    return max(1, min(max_context // MIN_SPLIT_KEYS, by_occupancy, MAX_SPLITS))


def _online_softmax_step(carry, scores, values, dots):
    """FlashAttention-2's online softmax: the running max / sum update; scores [M, BS] f32 (-inf = masked)."""
    running_max, running_sum, acc = carry
    new_max = jnp.maximum(running_max, scores.max(axis=1))
    # A fully masked prefix keeps max = -inf; shift by 0 there so exp(-inf - 0) = 0, not NaN.
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    probs = jnp.exp(scores - safe_max[:, None])
    rescale = jnp.exp(running_max - safe_max)
    pv = dots(probs, values)
    return new_max, rescale * running_sum + probs.sum(axis=1), rescale[:, None] * acc + pv


def _attend_blocks(q, positions, row, kv_head, first_block, end_block, last_position, refs, *, block_size, scale,
                   dots):
    """Online softmax of q [M, Dh] over KV blocks [first_block, end_block) of `row`; returns (max, sum, acc)."""
    block_table_ref, k_pool_ref, v_pool_ref = refs

    def body(j, carry):
        block = block_table_ref[row, j]
        key_positions = j * block_size + jnp.arange(block_size)
        keys = k_pool_ref[block, :, kv_head, :].astype(q.dtype)  # [BS, Dh]
        # Select, not multiply by a zero probability: a block's unwritten tail may hold NaN or Inf.
        values = v_pool_ref[block, :, kv_head, :].astype(q.dtype)
        values = jnp.where((key_positions <= last_position)[:, None], values, 0)
        scores = dots(q, keys.T) * scale  # [M, BS]
        scores = jnp.where(key_positions[None, :] <= positions[:, None], scores, -jnp.inf)
        return _online_softmax_step(carry, scores, values, dots)

    num_m, head_dim = q.shape
    init = (
        jnp.full((num_m,), -jnp.inf, jnp.float32),
        jnp.zeros((num_m,), jnp.float32),
        jnp.zeros((num_m, head_dim), jnp.float32),
    )
    return jax.lax.fori_loop(first_block, end_block, body, init)


def _attention_kernel(
    tile_rows_ref,  # [NQ] i32, row of each tile (R for surplus tiles)
    tile_starts_ref,  # [NQ] i32, first token of the tile
    tile_lens_ref,  # [NQ] i32, tokens in the tile (0 for surplus tiles)
    cu_seqlens_ref,  # [R+1] i32
    context_lens_ref,  # [R] i32 tokens before this step
    block_table_ref,  # [R, MB] i32
    q_ref,  # [T + BT, HKV, GP, Dh], the GQA groups of q
    k_pool_ref,  # [NB, BS, HKV, Dh]
    v_pool_ref,  # [NB, BS, HKV, Dh]
    # S = 1: o [T + BT, HKV, GP, Dh]; else f32 acc [S, T + BT, HKV, GP, Dh], max and sum [S, T + BT, HKV, GP]
    *out_refs,
    tokens_per_tile, block_size, num_splits, scale, dots,
):  # fmt: skip
    i_tile, kv_head, i_split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile_len = tile_lens_ref[i_tile]

    @pl.when(tile_len > 0)
    def _():
        row, start = tile_rows_ref[i_tile], tile_starts_ref[i_tile]
        first_position = context_lens_ref[row] + start - cu_seqlens_ref[row]
        last_position = first_position + tile_len - 1
        in_tile = jnp.arange(tokens_per_tile) < tile_len
        tile = q_ref.at[pl.ds(start, tokens_per_tile), kv_head]  # [BT, GP, Dh]
        q = plt.load(tile, mask=jnp.broadcast_to(in_tile[:, None, None], tile.shape), other=0)
        group_pad, head_dim = q.shape[1:]
        q = q.reshape(tokens_per_tile * group_pad, head_dim)
        # Rows of tokens past the tile's end act as its last token, so they read nothing stale.
        token = jnp.minimum(jnp.arange(q.shape[0]) // group_pad, tile_len - 1)
        num_blocks = jnp.minimum(last_position // block_size + 1, block_table_ref.shape[1])
        per_split = (num_blocks + num_splits - 1) // num_splits
        first_block = i_split * per_split
        end_block = jnp.minimum(first_block + per_split, num_blocks)  # <= first_block: an idle split
        refs = (block_table_ref, k_pool_ref, v_pool_ref)
        running_max, running_sum, acc = _attend_blocks(
            q, first_position + token, row, kv_head, first_block, end_block, last_position, refs,
            block_size=block_size, scale=scale, dots=dots,
        )  # fmt: skip
        if num_splits == 1:  # every row sees key 0, so its sum is >= 1
            (o_ref,) = out_refs
            _store_tile(o_ref, (), start, kv_head, in_tile, acc / running_sum[:, None])
        else:
            for part_ref, part in zip(out_refs, (acc, running_max, running_sum), strict=True):
                _store_tile(part_ref, (i_split,), start, kv_head, in_tile, part)


def _store_tile(ref, split, start, kv_head, in_tile, value):
    """Store value [M, ...] into the tile's [BT, GP, ...] of ref [*split, T + BT, HKV, GP, ...]; real tokens only."""
    # One .at with every index: interpret mode mis-shapes a masked store through a chained .at.
    tile = ref.at[(*split, pl.ds(start, in_tile.shape[0]), kv_head)]
    value = value.reshape(tile.shape).astype(ref.dtype)
    mask = jnp.broadcast_to(in_tile.reshape((-1,) + (1,) * (value.ndim - 1)), tile.shape)
    plt.store(tile, value, mask=mask)


def _merge_splits(acc, running_max, running_sum):
    """Log-sum-exp merge of split partials: acc [S, ..., Dh], max and sum [S, ...] -> normalised [..., Dh]."""
    # Finite for every real token (the split holding key 0 sees it); padding tokens are zeroed later.
    top = running_max.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # padding tokens: every split idle; exp(-inf - -inf) is NaN
    weight = jnp.exp(running_max - top)  # idle splits (max -inf) weigh 0
    return (weight[..., None] * acc).sum(axis=0) / (weight * running_sum).sum(axis=0)[..., None]


def _partial_shapes(num_splits, padded_shape):
    acc = jax.ShapeDtypeStruct((num_splits,) + padded_shape, jnp.float32)
    stat = jax.ShapeDtypeStruct((num_splits,) + padded_shape[:-1], jnp.float32)
    return acc, stat, stat


@functools.partial(jax.jit, static_argnames=("scale", "k_scale", "v_scale", "block_m", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def ragged_paged_attention(
    q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale,
    k_scale: float = 1.0, v_scale: float = 1.0, block_m: int | None = None, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int = 2,
    interpret: bool = False,
):  # fmt: skip
    """Same contract as `reference.ragged_paged_attention`. An fp8 pool's entries are cast to q.dtype in the
    kernel, k_scale folds into the softmax scale and v_scale into the output.

    block_m: dot rows per program (power of two >= 16); None = `default_block_m`.
    num_splits: KV splits per tile (1 = no split); None = `default_num_splits`.
    num_warps, num_stages: Triton launch parameters.
    """
    k_pool, v_pool = write_kv(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)
    num_tokens, num_q_heads, head_dim = q.shape
    num_rows, max_blocks = block_table.shape
    block_size, num_kv_heads = k_pool.shape[1:3]
    block_m = default_block_m(num_tokens, num_rows, q.dtype) if block_m is None else block_m
    if block_m < MIN_BLOCK_M or block_m != _next_pow2(block_m):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK_M}, got {block_m}")
    check_dot_sides(interpret, block_size=block_size, head_dim=head_dim)  # the scores and P.V dots
    group = num_q_heads // num_kv_heads
    tokens_per_tile, group_pad = tile_shape(group, block_m)
    num_tiles = max_num_chunks(num_tokens, num_rows, tokens_per_tile)
    if num_splits is None:
        num_splits = default_num_splits(num_tiles, num_kv_heads, max_blocks * block_size)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    # Loads past the last token are masked, but the tile's pl.ds must stay inside the array.
    grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    grouped = jnp.pad(grouped, ((0, tokens_per_tile), (0, 0), (0, group_pad - group), (0, 0)))
    table = chunk_table(cu_seqlens, num_tokens, tokens_per_tile)
    out_shape = jax.ShapeDtypeStruct(grouped.shape, q.dtype)
    # IEEE for f32 (HIGHEST): these [M, Dh] x [Dh, BS] tiles fit its FMA loops, and 3xTF32's split operands
    # spill at Dh 256 (`benchmarks/aot_kernels.py`)
    dots = Dots(q.dtype, interpret, f32_on_gpu=HIGHEST)
    kernel = functools.partial(
        _attention_kernel,
        tokens_per_tile=tokens_per_tile, block_size=block_size, num_splits=num_splits, scale=scale * k_scale,
        dots=dots,
    )  # fmt: skip
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape if num_splits == 1 else _partial_shapes(num_splits, grouped.shape),
        grid=(num_tiles, num_kv_heads, num_splits),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost.attention(q, k_pool, block_table, num_splits),
        name=f"ragged_paged_attention_{block_m=}_{group=}_{num_splits=}",
    )(table.rows, table.starts, table.lengths, cu_seqlens, context_lens, block_table, grouped, k_pool, v_pool)
    out = outs if num_splits == 1 else _merge_splits(*outs)
    out = out[:num_tokens, :, :group].reshape(q.shape)
    if v_scale != 1.0:
        out = (out.astype(jnp.float32) * v_scale).astype(q.dtype)
    return zero_padding(out, cu_seqlens, q.dtype), k_pool, v_pool
