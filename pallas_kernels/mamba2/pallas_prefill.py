"""Pallas (Triton backend) Mamba2 SSD chunked varlen prefill (kernels_models §2.3) on the state pool.

Grid and state tiles as in `pallas_kernels.mamba2.pallas`; each program walks its row in sub-chunks of
block_t tokens (masked loads past the row end) with its [block_p, N] state tile in registers.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import HIGHEST, check_rows, int32, zero_padding
from pallas_kernels.mamba2.pallas import check_tiles, pool_call, program_tile

_f32 = jnp.float32


def _chunk_step(state, x, dt, a, b, c, precision):
    """Chunked SSD (§2.3) on one sub-chunk of BT tokens from state [BP, N]; x [BT, BP]; dt [BT]; b, c [BT, N].

    Returns (y without the D x skip [BT, BP], state after the sub-chunk). Masked tokens have dt = 0 and
    zero x/B/C, so they neither decay nor feed the state.
    """
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=_f32)
    cum = jnp.cumsum(dt * a)  # [BT]
    total = jnp.sum(dt * a)
    xdt = x * dt[:, None]
    positions = jnp.arange(cum.shape[0])
    lower = positions[:, None] >= positions[None, :]
    # exp(segsum): mask before exp, the upper triangle is positive and may overflow.
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    y_diag = dot(dot(c, b.T) * decay, xdt)
    y_off = jnp.exp(cum)[:, None] * dot(c, state.T)
    state = jnp.exp(total) * state + dot((xdt * jnp.exp(total - cum)[:, None]).T, b)
    return y_diag + y_off, state


def _scan_tokens(
    state, begin, end, x_ref, dt_ref, B_ref, C_ref, y_ref, *, head, group, p0, a, d, block_t, block_p, precision
):
    """Walk tokens [begin, end) in sub-chunks of block_t, writing y; returns the state after them."""
    offsets = jnp.arange(block_t)

    def body(i, s):
        start = begin + i * block_t
        mask = offsets < end - start
        x = plt.load(x_ref.at[pl.ds(start, block_t), head, pl.ds(p0, block_p)], mask=mask[:, None], other=0)
        dt = plt.load(dt_ref.at[pl.ds(start, block_t), head], mask=mask, other=0).astype(_f32)
        b = plt.load(B_ref.at[pl.ds(start, block_t), group, :], mask=mask[:, None], other=0).astype(_f32)
        c = plt.load(C_ref.at[pl.ds(start, block_t), group, :], mask=mask[:, None], other=0).astype(_f32)
        x = x.astype(_f32)
        y, s = _chunk_step(s, x, dt, a, b, c, precision)
        out = (y + d * x).astype(y_ref.dtype)
        plt.store(y_ref.at[pl.ds(start, block_t), head, pl.ds(p0, block_p)], out, mask=mask[:, None])
        return s

    return jax.lax.fori_loop(0, pl.cdiv(end - begin, block_t), body, state)


def _ssd_prefill_kernel(
    cu_seqlens_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32, 0/1
    checkpoint_lens_ref,  # [R] i32
    checkpoint_slots_ref,  # [R] i32, 0 = no checkpoint
    A_ref,  # [NH] f32
    D_ref,  # [NH] f32
    x_ref,  # [T + BT, NH, P], padded so every sub-chunk slice stays inside
    dt_ref,  # [T + BT, NH] f32
    B_ref,  # [T + BT, G, N]
    C_ref,  # [T + BT, G, N]
    state_ref,  # [S, NH, P, N] f32, aliased to state_out_ref
    y_ref,  # [T + BT, NH, P]
    state_out_ref,  # [S, NH, P, N] f32
    *, heads_per_group, block_p, block_t, precision,
):  # fmt: skip
    i_row = pl.program_id(0)
    head, group, p0 = program_tile(heads_per_group, block_p)
    slot, begin, end = slots_ref[i_row], cu_seqlens_ref[i_row], cu_seqlens_ref[i_row + 1]
    tile = (slot, head, pl.ds(p0, block_p), slice(None))
    # where, not a product: a stale slot may hold NaN.
    state = jnp.where(has_initial_ref[i_row] != 0, state_ref[tile].astype(_f32), 0.0)
    scan = functools.partial(
        _scan_tokens, x_ref=x_ref, dt_ref=dt_ref, B_ref=B_ref, C_ref=C_ref, y_ref=y_ref, head=head, group=group,
        p0=p0, a=A_ref[head], d=D_ref[head], block_t=block_t, block_p=block_p, precision=precision,
    )  # fmt: skip
    # The checkpoint splits the row into two walks, so the state there is the first walk's final state.
    checkpoint_end, checkpoint_slot = begin + checkpoint_lens_ref[i_row], checkpoint_slots_ref[i_row]
    split = jnp.minimum(checkpoint_end, end)
    state = scan(state, begin, split)

    @pl.when((checkpoint_slot > 0) & (slot > 0) & (checkpoint_end <= end))
    def _():
        state_out_ref[checkpoint_slot, head, pl.ds(p0, block_p), :] = state.astype(state_out_ref.dtype)

    state = scan(state, split, end)

    @pl.when(slot > 0)
    def _():
        state_out_ref[tile] = state.astype(state_out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "block_p", "block_t", "precision", "interpret"),
    donate_argnames="state_pool",
)
def ssd_prefill(
    x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, chunk_size=128, block_p=32, block_t=64, precision=HIGHEST, interpret=False,
):  # fmt: skip
    """Same contract as `reference.ssd_prefill`; one program per (row, head, block_p rows of P).

    Each program walks its row in sub-chunks of min(block_t, chunk_size) tokens from the row start (and
    from the checkpoint), so every chunk boundary is a sub-chunk boundary: results equal the chunked
    reference up to rounding. Checkpoint slots must not be running slots of other rows. `precision` of the
    in-kernel dots: HIGHEST is IEEE fp32 in Triton (matches the fp32 reference); DEFAULT is TF32 on GPU.
    """
    check_rows(cu_seqlens, slots, "slots")
    block_p, block_t = check_tiles(state_pool, block_p), min(block_t, chunk_size)
    if block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} (min of block_t and chunk_size) must be a power of two")
    if not interpret and min(block_p, block_t, state_pool.shape[-1]) < 16:
        raise ValueError(f"Triton dots need tiles >= 16: {block_p=}, {block_t=}, N={state_pool.shape[-1]}")
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = jnp.zeros_like(slots), jnp.zeros_like(slots)
    metadata = int32(cu_seqlens, slots, has_initial, checkpoint_lens, checkpoint_slots)
    padded = [jnp.pad(v, ((0, block_t),) + ((0, 0),) * (v.ndim - 1)) for v in (x, dt, B, C)]
    operands = [*metadata, A.astype(_f32), D.astype(_f32), *padded, state_pool]
    heads_per_group = x.shape[1] // B.shape[1]
    kernel = functools.partial(
        _ssd_prefill_kernel, heads_per_group=heads_per_group, block_p=block_p, block_t=block_t, precision=precision
    )
    y, state_pool = pool_call(
        kernel, operands, (padded[0], state_pool), num_rows=slots.shape[0], block_p=block_p, interpret=interpret,
        name=f"ssd_prefill_{block_p=}_{block_t=}", num_stages=2,
    )  # fmt: skip
    return zero_padding(y[: x.shape[0]], cu_seqlens, x.dtype), state_pool
