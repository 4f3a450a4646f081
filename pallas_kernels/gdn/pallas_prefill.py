"""Pallas (Triton backend) chunked GDN prefill (WY/UT form, docs/kernels.md#gated-delta-rule) on the state pool.

Three calls in FLA's `chunk_gated_delta_rule_fwd` shape, over the per-row chunk table (no chunk straddles
two rows; surplus chunks of the static table exit at once):
  1. intra-chunk, grid (chunk, value head): G = cumsum(g), A = beta K K^T . Gamma, the blocked
     (I + A)^-1 (`wy`), w = (I + A)^-1 (beta e^G k) and u = (I + A)^-1 (beta v) (FLA `chunk_fwd_intra`);
  2. state pass, grid (row, value head, V tile): the only serial walk, two dots per chunk: stores each
     chunk's start state h, v_new = u - w h, and the checkpoint and final states (FLA `chunk_fwd_h`);
  3. output, grid (chunk, value head, V tile): o = (q e^G) h + (q k^T . Gamma) v_new (FLA `chunk_fwd_o`).
q/k are l2-normalised (and q scaled) by each kernel as it loads them. Dots take operands in the activation
dtype and accumulate in f32 (`wy.dot`); g, beta, the states and the pool stay f32.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn import cost
from pallas_kernels.gdn.reference import l2norm
from pallas_kernels.gdn.wy import (
    BLOCK,
    block_cumsum,
    dot_nt,
    dot_tn,
    lower_times,
    scaled_kkt,
    unit_lower_inverse_blocks,
)
from pallas_kernels.tiles import Dots, check_dot_sides, dividing_tile, int32
from pallas_kernels.varlen import check_rows, chunk_table, zero_padding

_f32 = jnp.float32


class _Config(NamedTuple):
    group: int  # value heads per qk head (value head h reads qk head h // group)
    chunk_size: int
    dots: Dots  # the activations' dtype, the dots' operands
    scale: float  # query scale
    normalise: bool  # l2-normalise q and k
    state_block_v: int  # V tile of the state pass
    output_block_v: int  # V tile of the output call
    num_warps: int
    num_stages: int


def _load_rows(ref, start, length, size, *index):
    """ref[start : start + size, *index] in its own dtype, zero past `length` rows."""
    view = ref.at[(pl.ds(start, size), *index)]
    mask = jnp.arange(size) < length
    return plt.load(view, mask=mask if view.ndim == 1 else mask[:, None], other=0)


def _store_rows(ref, start, length, value, *index):
    """ref[start : start + len(value), *index] = value, rows past `length` untouched."""
    size = value.shape[0]
    mask = (jnp.arange(size) < length)[:, None]
    plt.store(ref.at[(pl.ds(start, size), *index)], value.astype(ref.dtype), mask=mask)


def _keys(k, cfg):
    return l2norm(k) if cfg.normalise else k.astype(_f32)


def _queries(q, cfg):
    return _keys(q, cfg) * cfg.scale


def _intra_chunk_kernel(
    starts_ref,  # [NC] i32
    lengths_ref,  # [NC] i32, 0 for surplus chunks
    k_ref,  # [T, H, K]
    v_ref,  # [T, HV, V]
    g_ref,  # [T, HV] f32
    beta_ref,  # [T, HV] f32
    w_ref,  # [T, HV, K] dtype
    u_ref,  # [T, HV, V] dtype
    *,
    cfg: _Config,
):
    i_c, i_h = pl.program_id(0), pl.program_id(1)
    start, length = starts_ref[i_c], lengths_ref[i_c]
    offsets = range(0, cfg.chunk_size, BLOCK)

    def blocks(ref, *index):  # the chunk's rows as [16, ...] blocks, zero past its length
        return [_load_rows(ref, start + o, length - o, BLOCK, *index) for o in offsets]

    def store(ref, values):  # u first, then w: their [C, V] and [C, K] blocks are never live together
        for o, value in zip(offsets, values, strict=True):
            _store_rows(ref, start + o, length - o, value, i_h)

    @pl.when(length > 0)
    def _():
        k = [_keys(b, cfg) for b in blocks(k_ref, i_h // cfg.group)]
        beta, cum = blocks(beta_ref, i_h), block_cumsum(blocks(g_ref, i_h))
        inverse = unit_lower_inverse_blocks(scaled_kkt(k, beta, cum, cfg.dots), cfg.dots)
        beta_v = [b[:, None] * v for b, v in zip(beta, blocks(v_ref, i_h), strict=True)]
        store(u_ref, lower_times(inverse, beta_v, cfg.dots))
        beta_decayed_k = [(b * jnp.exp(c))[:, None] * k_b for b, c, k_b in zip(beta, cum, k, strict=True)]
        store(w_ref, lower_times(inverse, beta_decayed_k, cfg.dots))


def _state_after(state, k, v_new, cum, count, dots):
    """State after the chunk's first `count` tokens: e^{G_p} S + sum_{j<count} e^{G_p - G_j} k_j v_new_j.

    p = count - 1; the decay goes on v_new before its cast, as in FLA `chunk_fwd_h`.
    """
    positions = jnp.arange(cum.shape[0])
    cum_p = jnp.sum(jnp.where(positions == count - 1, cum, 0.0))
    # Mask before exp: G_p - G_j > 0 for j > p and may overflow.
    weights = jnp.exp(jnp.where(positions < count, cum_p - cum, -jnp.inf))
    return jnp.exp(cum_p) * state + dot_tn(k, v_new * weights[:, None], dots)


def _state_pass_kernel(
    cu_ref,  # [R+1] i32
    first_chunk_ref,  # [R] i32, the row's first chunk in the table
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32
    checkpoint_lens_ref,  # [R] i32 (-1: none)
    checkpoint_slots_ref,  # [R] i32 (0: none)
    k_ref,  # [T, H, K]
    w_ref,  # [T, HV, K] dtype
    u_ref,  # [T, HV, V] dtype
    g_ref,  # [T, HV] f32
    state_ref,  # [S, HV, K, V] f32
    h_ref,  # [NC, HV, K, V] in the dots' dtype, the state at each chunk's start
    v_new_ref,  # [T, HV, V] dtype
    state_out_ref,  # [S, HV, K, V] f32, aliases state_ref
    *,
    cfg: _Config,
    block_v: int,
):
    i_r, i_h = pl.program_id(0), pl.program_id(1)
    i_k, cols, size = i_h // cfg.group, pl.ds(pl.program_id(2) * block_v, block_v), cfg.chunk_size
    slot, bos, eos, first = slots_ref[i_r], cu_ref[i_r], cu_ref[i_r + 1], first_chunk_ref[i_r]
    ckpt_len, ckpt_slot = checkpoint_lens_ref[i_r], checkpoint_slots_ref[i_r]
    # where, not a product: a stale slot may hold NaN or Inf, and 0 * NaN is NaN.
    state = jnp.where(has_initial_ref[i_r] != 0, state_ref[slot, i_h, :, cols].astype(jnp.float32), 0.0)

    @pl.when((ckpt_len == 0) & (ckpt_slot > 0) & (slot > 0))
    def _():
        state_out_ref[ckpt_slot, i_h, :, cols] = state.astype(state_out_ref.dtype)

    def chunk(c, s):
        start = bos + c * size
        length = jnp.minimum(eos - start, size)
        h_ref[first + c, i_h, :, cols] = s.astype(h_ref.dtype)
        k = _keys(_load_rows(k_ref, start, length, size, i_k), cfg)
        cum = jnp.cumsum(_load_rows(g_ref, start, length, size, i_h))
        w = _load_rows(w_ref, start, length, size, i_h)
        v_new = _load_rows(u_ref, start, length, size, i_h, cols).astype(_f32) - cfg.dots(w, s)
        _store_rows(v_new_ref, start, length, v_new, i_h, cols)
        count = ckpt_len - c * size

        @pl.when((count >= 1) & (count <= length) & (ckpt_slot > 0) & (slot > 0))
        def _():
            after = _state_after(s, k, v_new, cum, count, cfg.dots)
            state_out_ref[ckpt_slot, i_h, :, cols] = after.astype(state_out_ref.dtype)

        return _state_after(s, k, v_new, cum, length, cfg.dots)

    state = jax.lax.fori_loop(0, (eos - bos + size - 1) // size, chunk, state)

    @pl.when(slot > 0)
    def _():
        state_out_ref[slot, i_h, :, cols] = state.astype(state_out_ref.dtype)


def _output_kernel(
    starts_ref,  # [NC] i32
    lengths_ref,  # [NC] i32, 0 for surplus chunks
    q_ref,  # [T, H, K]
    k_ref,  # [T, H, K]
    g_ref,  # [T, HV] f32
    h_ref,  # [NC, HV, K, V] in the dots' dtype
    v_new_ref,  # [T, HV, V] dtype
    o_ref,  # [T, HV, V] in v's dtype
    *,
    cfg: _Config,
    block_v: int,
):
    i_c, i_h = pl.program_id(0), pl.program_id(1)
    i_k, cols, size = i_h // cfg.group, pl.ds(pl.program_id(2) * block_v, block_v), cfg.chunk_size
    start, length = starts_ref[i_c], lengths_ref[i_c]

    @pl.when(length > 0)
    def _():
        q = _queries(_load_rows(q_ref, start, length, size, i_k), cfg)
        k = _keys(_load_rows(k_ref, start, length, size, i_k), cfg)
        cum = jnp.cumsum(_load_rows(g_ref, start, length, size, i_h))
        causal = jnp.arange(size)[:, None] >= jnp.arange(size)[None, :]
        # Mask before exp: G_i - G_j > 0 above the diagonal and may overflow.
        gamma = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], -jnp.inf))
        v_new = _load_rows(v_new_ref, start, length, size, i_h, cols)
        o = cfg.dots(q * jnp.exp(cum)[:, None], h_ref[i_c, i_h, :, cols])
        _store_rows(o_ref, start, length, o + cfg.dots(dot_nt(q, k, cfg.dots) * gamma, v_new), i_h, cols)


def _pallas_call(kernel, operands: dict, out_shape, grid, name, cfg, interpret, cost_estimate, aliases=None):
    """pl.pallas_call over named operands; `aliases` maps an operand name to the output it becomes."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases={list(operands).index(n): i for n, i in (aliases or {}).items()},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        cost_estimate=cost_estimate,
        name=name,
    )(*operands.values())


def _intra_chunk(table, k, v, g, beta, cfg, interpret):
    """Call 1: returns w [T, HV, K] and u [T, HV, V] in the activation dtype."""
    (num_tokens, num_heads, head_v), head_k = v.shape, k.shape[2]
    operands = dict(starts=table.starts, lengths=table.lengths, k=k, v=v, g=g, beta=beta)
    out_shape = (
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_k), cfg.dots.dtype),
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_v), cfg.dots.dtype),
    )
    grid = (table.starts.shape[0], num_heads)
    name = f"gdn_prefill_intra_chunk_chunk_size={cfg.chunk_size}"
    estimate = cost.intra_chunk(k, v, g, beta, cfg.dots.dtype, cfg.chunk_size)
    return _pallas_call(functools.partial(_intra_chunk_kernel, cfg=cfg), operands, out_shape, grid, name, cfg,
                        interpret, estimate)


def _state_pass(table, rows: dict, k, w, u, g, state_pool, cfg, interpret):
    """Call 2: returns h [NC, HV, K, V] (in the dots' dtype: the output call reads it only as a dot operand,
    so bf16 halves its traffic), v_new [T, HV, V] and the updated pool."""
    num_chunks, (num_heads, head_k, head_v) = table.starts.shape[0], state_pool.shape[1:]
    block_v = dividing_tile(head_v, cfg.state_block_v, "state_block_v")
    check_dot_sides(interpret, K=head_k, state_block_v=block_v)
    operands = dict(**rows, k=k, w=w, u=u, g=g, state=state_pool)
    out_shape = (
        jax.ShapeDtypeStruct((num_chunks, num_heads, head_k, head_v), cfg.dots.dtype),
        jax.ShapeDtypeStruct(u.shape, u.dtype),
        jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
    )
    grid = (rows["slots"].shape[0], num_heads, head_v // block_v)
    kernel = functools.partial(_state_pass_kernel, cfg=cfg, block_v=block_v)
    name = f"gdn_prefill_state_pass_{block_v=}_chunk_size={cfg.chunk_size}"
    estimate = cost.state_pass(k, w, u, g, state_pool, cfg.dots.dtype, rows["slots"].shape[0], num_chunks)
    return _pallas_call(kernel, operands, out_shape, grid, name, cfg, interpret, estimate, aliases={"state": 2})


def _output(table, q, k, g, h, v_new, out_dtype, cfg, interpret):
    """Call 3: o [T, HV, V] in out_dtype; padding tokens are never written."""
    head_v = v_new.shape[2]
    block_v = dividing_tile(head_v, cfg.output_block_v, "output_block_v")
    check_dot_sides(interpret, output_block_v=block_v)
    operands = dict(starts=table.starts, lengths=table.lengths, q=q, k=k, g=g, h=h, v_new=v_new)
    out_shape = jax.ShapeDtypeStruct(v_new.shape, out_dtype)
    grid = (table.starts.shape[0], v_new.shape[1], head_v // block_v)
    kernel = functools.partial(_output_kernel, cfg=cfg, block_v=block_v)
    name = f"gdn_prefill_output_{block_v=}_chunk_size={cfg.chunk_size}"
    estimate = cost.output(q, k, g, h, v_new, out_dtype, cfg.chunk_size)
    return _pallas_call(kernel, operands, out_shape, grid, name, cfg, interpret, estimate)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < BLOCK or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= {BLOCK} (whole 16-row blocks), got {chunk_size}")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "chunk_size", "state_block_v", "output_block_v", "num_warps",
                     "num_stages", "interpret"),
    donate_argnames="state_pool",
)
def gdn_prefill(
    q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, scale=None, use_qk_l2norm=True, chunk_size=64, state_block_v=32, output_block_v=64, num_warps=8,
    num_stages=2, interpret=False,
):  # fmt: skip
    """Pallas chunked prefill; contract in `pallas_kernels.gdn.gdn_prefill` (chunk_size: a power of two >= 16).

    state_block_v: the state pass holds a [K, BV] f32 tile per program: narrow tiles keep it in registers
      and give a single long row HV * V / BV programs.
    output_block_v: the output call has no carry and reuses its q k^T tile across BV columns.
    num_warps, num_stages: Triton launch parameters of all three calls. 8 warps: with 4 the three calls need
      234-255 registers a thread at chunk 64, at the limit (`benchmarks/aot_kernels.py`, bf16).
    """
    check_rows(cu_seqlens, slots, "slots")
    _check_chunk_size(chunk_size)
    num_tokens, num_heads = v.shape[:2]
    cfg = _Config(
        group=num_heads // q.shape[1], chunk_size=chunk_size, dots=Dots(jnp.result_type(q, k, v), interpret),
        scale=q.shape[2] ** -0.5 if scale is None else scale, normalise=use_qk_l2norm, state_block_v=state_block_v,
        output_block_v=output_block_v, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    table = chunk_table(cu_seqlens, num_tokens, chunk_size)
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = jnp.full_like(slots, -1), jnp.zeros_like(slots)
    first_chunk = jnp.searchsorted(table.rows, jnp.arange(slots.shape[0]))
    names = ("cu_seqlens", "first_chunk", "slots", "has_initial", "checkpoint_lens", "checkpoint_slots")
    rows = dict(zip(names, int32(cu_seqlens, first_chunk, slots, has_initial, checkpoint_lens, checkpoint_slots),
                    strict=True))
    g, beta = g.astype(_f32), beta.astype(_f32)
    w, u = _intra_chunk(table, k, v, g, beta, cfg, interpret)
    h, v_new, state_pool = _state_pass(table, rows, k, w, u, g, state_pool, cfg, interpret)
    o = _output(table, q, k, g, h, v_new, v.dtype, cfg, interpret)
    return zero_padding(o, cu_seqlens, v.dtype), state_pool
