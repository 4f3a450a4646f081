"""Pallas (Triton backend) causal depthwise conv1d over packed rows and the window slot pool.

Every program is an independent (token tile, channel tile) pair. A row's tokens from position Kc-1 on are
cut into tiles of `block_t`: tap j of a tile is one [block_t, block_d] load of the row's inputs shifted by
j - (Kc-1), and the taps are multiply-added in f32. Those loads never start before the row's first token,
so they read no other row and never start before the buffer (interpret mode returns NaN for a slice with
a negative start, masked or not). The first Kc-1 tokens of a row read the slot's window instead: the
program of the row's first tile computes them one by one, then stores the row's final and checkpoint
windows. Padding tokens get zero tiles of their own, so the output needs no pass after the kernel.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.conv1d import cost
from pallas_kernels.tiles import dividing_tile, int32
from pallas_kernels.varlen import check_rows


def _tile_table(cu_seqlens: jax.Array, num_tokens: int, block_t: int, width: int) -> dict[str, jax.Array]:
    """Per program: the row it serves (R: a padding tile or a surplus program), first token, token count.

    Regions are each row's positions >= Kc-1, then the padding before cu_seqlens[0] and after
    cu_seqlens[-1]. Every row gets at least one tile, even an empty region: that tile's program owns the
    row's head tokens and windows. Each region wastes at most one partial tile, so T // block_t + R + 2
    programs cover any bucket; surplus programs get zero tokens.
    """
    num_rows = cu_seqlens.shape[0] - 1
    starts = jnp.concatenate([cu_seqlens[:-1] + width, jnp.stack([0, cu_seqlens[-1]])])  # [R+2]
    ends = jnp.concatenate([cu_seqlens[1:], jnp.stack([cu_seqlens[0], num_tokens])])
    num_tiles = (jnp.maximum(ends - starts, 0) + block_t - 1) // block_t
    num_tiles = num_tiles.at[:num_rows].max(1)
    first_tile = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(num_tiles, dtype=jnp.int32)])
    program = jnp.arange(num_tokens // block_t + num_rows + 2, dtype=jnp.int32)
    region = jnp.minimum(jnp.searchsorted(first_tile, program, side="right") - 1, num_rows + 2).astype(jnp.int32)
    surplus = region == num_rows + 2
    region = jnp.minimum(region, num_rows + 1)
    tile_start = starts[region] + (program - first_tile[region]) * block_t
    tile_length = jnp.where(surplus, 0, jnp.clip(ends[region] - tile_start, 0, block_t))
    return dict(tile_rows=jnp.minimum(region, num_rows), tile_starts=tile_start, tile_lengths=tile_length)


def _silu(y, activation: bool):
    return y * jax.nn.sigmoid(y) if activation else y


def _conv_tile(x_ref, y_ref, taps, bias, start, in_tile, cols, *, width: int, activation: bool):
    """Outputs of tokens [start, start + block_t) whose taps all read the row's own tokens."""
    block_t = in_tile.shape[0]
    y = 0.0
    for j, w in enumerate(taps):
        x = plt.load(x_ref.at[pl.ds(start - width + j, block_t), cols], mask=in_tile, other=0)
        y = y + w * x.astype(jnp.float32)
    plt.store(y_ref.at[pl.ds(start, block_t), cols], _silu(y + bias, activation).astype(y_ref.dtype), mask=in_tile)


def _head_outputs(x_ref, y_ref, window, taps, bias, bos, row_length, cols, *, activation: bool):
    """Outputs of the row's first Kc-1 tokens, whose taps reach into its initial window [Kc-1][block_d]."""
    width = len(window)

    def extended(m):  # input m of (window ++ row tokens), m static
        return window[m].astype(jnp.float32) if m < width else x_ref[bos + m - width, cols].astype(jnp.float32)

    def store_output(p):  # row token p, p static
        y = sum(w * extended(p + j) for j, w in enumerate(taps))
        y_ref[bos + p, cols] = _silu(y + bias, activation).astype(y_ref.dtype)

    for p in range(width):
        pl.when(p < row_length)(functools.partial(store_output, p))


def _store_window_after(x_ref, window_out_ref, window, bos, count, target, cols):
    """window_out[target] = the last Kc-1 of (window ++ the row's first `count` tokens)."""
    width = len(window)
    for m in range(width):
        index = count + m  # into window ++ tokens
        token = jnp.clip(bos + index - width, 0, x_ref.shape[0] - 1)  # used only where index >= width
        value = x_ref[token, cols].astype(window_out_ref.dtype)
        for k in range(width):
            value = jnp.where(index == k, window[k], value)
        window_out_ref[target, m, cols] = value


def _conv1d_kernel(
    cu_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32
    checkpoint_lens_ref,  # [R] i32 (-1: none)
    checkpoint_slots_ref,  # [R] i32 (0: none)
    tile_rows_ref,  # [NT] i32, R: padding tile or surplus program
    tile_starts_ref,  # [NT] i32, first token of the tile
    tile_lengths_ref,  # [NT] i32, tokens in the tile
    x_ref,  # [T, D]
    weight_ref,  # [D, Kc]
    bias_ref,  # [D] f32
    window_ref,  # [S, >= Kc-1, D]
    y_ref,  # [T, D]
    window_out_ref,  # [S, >= Kc-1, D], aliases window_ref
    *,
    width: int,
    block_t: int,
    block_d: int,
    activation: bool,
):
    i_t, cols = pl.program_id(0), pl.ds(pl.program_id(1) * block_d, block_d)
    row, start, tile_length = tile_rows_ref[i_t], tile_starts_ref[i_t], tile_lengths_ref[i_t]
    num_rows = slots_ref.shape[0]
    in_tile = (jnp.arange(block_t) < tile_length)[:, None]
    taps = [weight_ref[cols, j].astype(jnp.float32) for j in range(width + 1)]
    bias = bias_ref[cols]

    @pl.when(row == num_rows)
    def _():
        plt.store(y_ref.at[pl.ds(start, block_t), cols], jnp.zeros((block_t, block_d), y_ref.dtype), mask=in_tile)

    @pl.when(row < num_rows)
    def _():
        _conv_tile(x_ref, y_ref, taps, bias, start, in_tile, cols, width=width, activation=activation)

    i_r = jnp.minimum(row, num_rows - 1)
    bos, row_length, slot = cu_ref[i_r], cu_ref[i_r + 1] - cu_ref[i_r], slots_ref[i_r]
    ckpt_len, ckpt_slot = checkpoint_lens_ref[i_r], checkpoint_slots_ref[i_r]

    @pl.when((row < num_rows) & (start == bos + width))  # the row's first tile owns its head and windows
    def _():
        # where, not a product: a stale slot may hold NaN or Inf, and 0 * NaN is NaN.
        window = [jnp.where(has_initial_ref[i_r] != 0, window_ref[slot, j, cols], 0) for j in range(width)]
        _head_outputs(x_ref, y_ref, window, taps, bias, bos, row_length, cols, activation=activation)

        # the final window first, then the checkpoint, as the reference writes them
        @pl.when(slot > 0)
        def _():
            _store_window_after(x_ref, window_out_ref, window, bos, row_length, slot, cols)

        @pl.when((slot > 0) & (ckpt_slot > 0) & (ckpt_len >= 0) & (ckpt_len <= row_length))
        def _():
            _store_window_after(x_ref, window_out_ref, window, bos, ckpt_len, ckpt_slot, cols)


def _conv1d_call(x, weight, bias, cu_seqlens, window_pool, per_row, *, activation, block_t, block_d, num_warps,
                 num_stages, interpret):  # fmt: skip
    (num_tokens, dim), width = x.shape, weight.shape[1] - 1
    if block_t & (block_t - 1):
        raise ValueError(f"block_t {block_t} must be a power of two (Triton tiles)")
    block_d = dividing_tile(dim, block_d, "block_d")
    bias = jnp.zeros(dim, jnp.float32) if bias is None else bias.astype(jnp.float32)
    tiles = _tile_table(cu_seqlens, num_tokens, block_t, width)
    operands = dict(cu_seqlens=cu_seqlens, **per_row, **tiles, x=x, weight=weight, bias=bias, window=window_pool)
    kernel = functools.partial(_conv1d_kernel, width=width, block_t=block_t, block_d=block_d, activation=activation)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(window_pool.shape, window_pool.dtype)),
        grid=(tiles["tile_rows"].shape[0], dim // block_d),
        input_output_aliases={list(operands).index("window"): 1},
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        cost_estimate=cost.conv1d(x, weight, bias, window_pool, per_row["slots"].shape[0], activation=activation),
        name=f"conv1d_prefill_{block_t=}_{block_d=}",
    )(*operands.values())


@functools.partial(
    jax.jit,
    static_argnames=("activation", "block_t", "block_d", "num_warps", "num_stages", "interpret"),
    donate_argnames="window_pool",
)
def conv1d_prefill(
    x, weight, bias, cu_seqlens, window_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, activation=True, block_t=32, block_d=128, num_warps=4, num_stages=2, interpret=False,
):  # fmt: skip
    """Pallas conv1d prefill; contract in `pallas_kernels.conv1d.conv1d_prefill`.

    block_t, block_d: token and channel tile (powers of two; block_d shrinks to the largest power of two dividing D).
    num_warps, num_stages: Triton launch parameters.
    """
    check_rows(cu_seqlens, slots, "slots")
    none = jnp.zeros_like(slots)
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = none - 1, none
    names = ("slots", "has_initial", "checkpoint_lens", "checkpoint_slots")
    per_row = dict(zip(names, int32(slots, has_initial, checkpoint_lens, checkpoint_slots), strict=True))
    launch = dict(block_t=block_t, block_d=block_d, num_warps=num_warps, num_stages=num_stages)
    return _conv1d_call(
        x, weight, bias, cu_seqlens, window_pool, per_row, activation=activation, **launch, interpret=interpret
    )
