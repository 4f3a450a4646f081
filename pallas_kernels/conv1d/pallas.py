"""Pallas (Triton backend) causal depthwise conv1d over packed rows and the window slot pool.

One program per (row, channel tile): the Kc-1 newest inputs stay in registers as a rolling window while
the program walks its row's tokens, so a token's conv reads no memory besides its own input.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import check_rows, zero_padding

MAX_BLOCK_D = 128


def _conv1d_kernel(
    cu_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32
    checkpoint_lens_ref,  # [R] i32 (-1: none)
    checkpoint_slots_ref,  # [R] i32 (0: none)
    x_ref,  # [T, D]
    weight_ref,  # [D, Kc]
    bias_ref,  # [D] f32
    window_ref,  # [S, Kc-1, D]
    y_ref,  # [T, D]
    window_out_ref,  # [S, Kc-1, D], aliases window_ref
    *,
    width: int,
    block_d: int,
    activation: bool,
):
    i_r, cols = pl.program_id(0), pl.ds(pl.program_id(1) * block_d, block_d)
    slot, bos, eos = slots_ref[i_r], cu_ref[i_r], cu_ref[i_r + 1]
    keep = has_initial_ref[i_r] != 0
    # where, not a product: a stale slot may hold NaN or Inf, and 0 * NaN is NaN.
    window = tuple(jnp.where(keep, window_ref[slot, j, cols].astype(jnp.float32), 0.0) for j in range(width))
    taps = [weight_ref[cols, i].astype(jnp.float32) for i in range(width + 1)]
    bias = bias_ref[cols]
    ckpt_len, ckpt_slot = checkpoint_lens_ref[i_r], checkpoint_slots_ref[i_r]

    def store_window(target, values):
        for j in range(width):
            window_out_ref[target, j, cols] = values[j].astype(window_out_ref.dtype)

    @pl.when((ckpt_len == 0) & (ckpt_slot > 0))
    def _():
        store_window(ckpt_slot, window)

    def step(t, win):
        x = x_ref[t, cols].astype(jnp.float32)
        y = sum(w * h for w, h in zip(taps, (*win, x), strict=True)) + bias
        y_ref[t, cols] = (y * jax.nn.sigmoid(y) if activation else y).astype(y_ref.dtype)
        win = (*win[1:], x)

        @pl.when((t - bos + 1 == ckpt_len) & (ckpt_slot > 0))
        def _():
            store_window(ckpt_slot, win)

        return win

    window = jax.lax.fori_loop(bos, eos, step, window)

    @pl.when(slot > 0)
    def _():
        store_window(slot, window)


def _conv1d_call(x, weight, bias, cu_seqlens, window_pool, per_row, *, activation, interpret):
    dim = x.shape[1]
    block_d = min(dim, MAX_BLOCK_D)
    if dim % block_d:
        raise ValueError(f"channel count {dim} must be a multiple of {block_d} (Triton tiles are powers of two)")
    bias = jnp.zeros(dim, jnp.float32) if bias is None else bias.astype(jnp.float32)
    operands = dict(cu_seqlens=cu_seqlens, **per_row, x=x, weight=weight, bias=bias, window=window_pool)
    kernel = functools.partial(_conv1d_kernel, width=weight.shape[1] - 1, block_d=block_d, activation=activation)
    y, window_pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(window_pool.shape, window_pool.dtype)),
        grid=(cu_seqlens.shape[0] - 1, dim // block_d),
        input_output_aliases={list(operands).index("window"): 1},
        interpret=interpret,
        name=f"conv1d_{block_d=}",
    )(*operands.values())
    return zero_padding(y, cu_seqlens, x.dtype), window_pool


@functools.partial(jax.jit, static_argnames=("activation", "interpret"), donate_argnames="window_pool")
def conv1d_prefill(
    x, weight, bias, cu_seqlens, window_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, activation=True, interpret=False,
):  # fmt: skip
    """Pallas conv1d prefill; contract in `pallas_kernels.conv1d.conv1d_prefill`."""
    check_rows(cu_seqlens, slots, "slots")
    none = jnp.zeros_like(slots)
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = none - 1, none
    per_row = dict(
        slots=slots, has_initial=has_initial.astype(jnp.int32), checkpoint_lens=checkpoint_lens,
        checkpoint_slots=checkpoint_slots,
    )  # fmt: skip
    return _conv1d_call(x, weight, bias, cu_seqlens, window_pool, per_row, activation=activation, interpret=interpret)

