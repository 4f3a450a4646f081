"""Pallas (Triton backend) kernels for GDN decode, ReplaySSM verify and materialize.

One program per (row, value head, V tile): the [K, BV] state tile stays in registers while the ring
entries and the row's tokens are applied (columns of the K-major state evolve independently). Ring
appends of (k^, u, g) happen in XLA around the kernel, so no program writes what another one reads.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn import cost
from pallas_kernels.gdn.reference import normalise_qk
from pallas_kernels.rings import append_tokens
from pallas_kernels.tiles import dividing_tile
from pallas_kernels.varlen import check_rows, zero_padding


def _fold_ring(ring_k_ref, ring_u_ref, ring_g_ref, slot, i_k, i_h, cols, ring_start, count, state):
    """Advance a [K, BV] state tile by ring entries (ring_start + j) % E, j < count."""
    width = ring_g_ref.shape[2]

    def fold(j, s):
        i = (ring_start + j) % width
        s = jnp.exp(ring_g_ref[slot, i_h, i]) * s
        return s + ring_k_ref[slot, i_k, i][:, None] * ring_u_ref[slot, i_h, i, cols][None, :]

    return jax.lax.fori_loop(0, count, fold, state)


def _token(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, i_k, i_h, cols):
    """Token t on a [K, BV] state tile, its read-out stored to o_ref; returns (state, delta u)."""
    k, q = k_ref[t, i_k], q_ref[t, i_k]
    s = jnp.exp(g_ref[t, i_h]) * s  # decay before the read (docs/kernels.md#gated-delta-rule)
    delta = beta_ref[t, i_h] * (v_ref[t, i_h, cols].astype(jnp.float32) - jnp.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * delta[None, :]
    o_ref[t, i_h, cols] = jnp.sum(s * q[:, None], axis=0)
    return s, delta


def _gdn_replay_kernel(
    cu_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    start_ref,  # [R] i32 ring_start
    committed_ref,  # [R] i32
    flush_ref,  # [R] i32
    q_ref,  # [T, H, K] f32, normalised and scaled
    k_ref,  # [T, H, K] f32, normalised
    v_ref,  # [T, HV, V]
    g_ref,  # [T, HV] f32
    beta_ref,  # [T, HV] f32
    ring_k_ref,  # [S, H, E, K] f32
    ring_u_ref,  # [S, HV, E, V] f32
    ring_g_ref,  # [S, HV, E] f32
    state_ref,  # [S, HV, K, V] f32
    o_ref,  # [T, HV, V] f32
    delta_ref,  # [T, HV, V] f32, the corrected updates u of the row's tokens
    state_out_ref,  # [S, HV, K, V] f32, aliases state_ref
    *,
    group: int,
    block_v: int,
    write_final: bool,
):
    i_r, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i_k, cols = i_h // group, pl.ds(i_v * block_v, block_v)
    slot = slots_ref[i_r]
    state = state_ref[slot, i_h, :, cols].astype(jnp.float32)  # a bf16 state pool computes in f32
    state = _fold_ring(
        ring_k_ref, ring_u_ref, ring_g_ref, slot, i_k, i_h, cols, start_ref[i_r], committed_ref[i_r], state
    )

    @pl.when((flush_ref[i_r] != 0) & (slot > 0))
    def _():  # a flush makes S0 + committed entries the new checkpoint
        state_out_ref[slot, i_h, :, cols] = state.astype(state_out_ref.dtype)

    def step(t, s):
        s, delta = _token(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, i_k, i_h, cols)
        delta_ref[t, i_h, cols] = delta
        return s

    state = jax.lax.fori_loop(cu_ref[i_r], cu_ref[i_r + 1], step, state)
    if write_final:

        @pl.when(slot > 0)
        def _():
            state_out_ref[slot, i_h, :, cols] = state.astype(state_out_ref.dtype)


_STATIC = ("scale", "use_qk_l2norm", "block_v", "num_warps", "num_stages", "interpret")


def _launch(num_warps, num_stages, interpret):
    """The pallas_call arguments every launcher here shares: Triton's launch parameters, interpret mode."""
    return dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret)


def _replay_call(q, k, v, g, beta, cu_seqlens, state_pool, rings, trackers, *, write_final, block_v, num_warps,
                 num_stages, interpret):
    """Launch `_gdn_replay_kernel`; returns (o f32, delta, state_pool)."""
    num_tokens, num_heads, head_v = v.shape
    block_v = dividing_tile(head_v, block_v, "block_v")
    operands = dict(
        cu_seqlens=cu_seqlens, **trackers, q=q, k=k, v=v, g=g.astype(jnp.float32),
        beta=beta.astype(jnp.float32), **rings, state=state_pool,
    )  # fmt: skip
    kernel = functools.partial(
        _gdn_replay_kernel, group=num_heads // q.shape[1], block_v=block_v, write_final=write_final
    )
    token_out = jax.ShapeDtypeStruct((num_tokens, num_heads, head_v), jnp.float32)
    return pl.pallas_call(
        kernel,
        out_shape=(token_out, token_out, jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)),
        grid=(cu_seqlens.shape[0] - 1, num_heads, head_v // block_v),
        input_output_aliases={list(operands).index("state"): 2},
        **_launch(num_warps, num_stages, interpret),
        cost_estimate=cost.replay(q, k, v, g, beta, state_pool, **rings, num_rows=cu_seqlens.shape[0] - 1,
                                  write_final=write_final),
        name=f"gdn_replay_{block_v=}_{write_final=}",
    )(*operands.values())


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state_pool", "ring_k", "ring_u", "ring_g"))
def gdn_verify(
    q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, block_v=32, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Pallas ReplaySSM verify/decode; contract in `pallas_kernels.gdn.gdn_verify`."""
    check_rows(cu_seqlens, slots, "slots")
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    trackers = dict(slots=slots, ring_start=ring_start, committed=committed, flush=flush.astype(jnp.int32))
    rings = dict(ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)
    o, delta, state_pool = _replay_call(
        qn, kn, v, g, beta, cu_seqlens, state_pool, rings, trackers, write_final=False, block_v=block_v,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
    rings = (
        append_tokens(ring, new, cu_seqlens, slots, ring_start, committed)
        for ring, new in ((ring_k, kn), (ring_u, delta), (ring_g, g))
    )
    return (zero_padding(o, cu_seqlens, v.dtype), state_pool, *rings)


def _gdn_snapshot_kernel(
    cu_ref, slots_ref, start_ref, committed_ref, flush_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
    snapshots_ref, state_ref, o_ref, snapshots_out_ref, state_out_ref, *, group: int, block_v: int,
):  # fmt: skip
    """The snapshot baseline: the live state is read whole, and the state after every token is stored.

    Operands as `_gdn_replay_kernel`'s, with snapshots [S, HV, E, K, V] f32 (aliased to snapshots_out_ref) in
    place of the rings and no delta output.
    """
    i_r, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i_k, cols = i_h // group, pl.ds(i_v * block_v, block_v)
    slot, committed, width = slots_ref[i_r], committed_ref[i_r], snapshots_ref.shape[2]
    first, new = cu_ref[i_r], start_ref[i_r] + committed  # ring index of the row's first new entry
    live = snapshots_ref[slot, i_h, (new + width - 1) % width, :, cols]
    state = jnp.where(committed > 0, live, state_ref[slot, i_h, :, cols].astype(jnp.float32))

    @pl.when((flush_ref[i_r] != 0) & (slot > 0))
    def _():
        state_out_ref[slot, i_h, :, cols] = state.astype(state_out_ref.dtype)

    def step(t, s):
        s, _ = _token(t, s, q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, i_k, i_h, cols)

        @pl.when(slot > 0)
        def _():
            snapshots_out_ref[slot, i_h, (new + t - first) % width, :, cols] = s

        return s

    jax.lax.fori_loop(first, cu_ref[i_r + 1], step, state)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state_pool", "snapshots"))
def gdn_verify_snapshots(
    q, k, v, g, beta, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, block_v=32, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Pallas snapshot verify/decode; contract in `pallas_kernels.gdn.gdn_verify_snapshots`."""
    check_rows(cu_seqlens, slots, "slots")
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    num_tokens, num_heads, head_v = v.shape
    block_v = dividing_tile(head_v, block_v, "block_v")
    operands = dict(
        cu_seqlens=cu_seqlens, slots=slots, ring_start=ring_start, committed=committed,
        flush=flush.astype(jnp.int32), q=qn, k=kn, v=v, g=g.astype(jnp.float32), beta=beta.astype(jnp.float32),
        snapshots=snapshots, state=state_pool,
    )  # fmt: skip
    kernel = functools.partial(_gdn_snapshot_kernel, group=num_heads // q.shape[1], block_v=block_v)
    o_shape = jax.ShapeDtypeStruct((num_tokens, num_heads, head_v), jnp.float32)
    o, snapshots, state_pool = pl.pallas_call(
        kernel,
        out_shape=(o_shape, *(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (snapshots, state_pool))),
        grid=(cu_seqlens.shape[0] - 1, num_heads, head_v // block_v),
        input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
        **_launch(num_warps, num_stages, interpret),
        cost_estimate=cost.snapshots(qn, kn, v, g, beta, snapshots, state_pool, slots.shape[0]),
        name=f"gdn_snapshots_{block_v=}",
    )(*operands.values())
    return zero_padding(o, cu_seqlens, v.dtype), state_pool, snapshots


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames="state_pool")
def gdn_decode(
    q, k, v, g, beta, cu_seqlens, state_pool, slots,
    *, scale=None, use_qk_l2norm=True, block_v=32, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Pallas plain decoding; contract in `pallas_kernels.gdn.gdn_decode`."""
    check_rows(cu_seqlens, slots, "slots")
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    zeros = jnp.zeros_like(slots)
    trackers = dict(slots=slots, ring_start=zeros, committed=zeros, flush=zeros)
    # committed = 0, so no ring entry is read: one-entry dummy rings fill the operand list.
    rings = dict(
        ring_k=jnp.zeros((1, q.shape[1], 1, q.shape[2]), jnp.float32),
        ring_u=jnp.zeros((1, v.shape[1], 1, v.shape[2]), jnp.float32),
        ring_g=jnp.zeros((1, v.shape[1], 1), jnp.float32),
    )
    o, _, state_pool = _replay_call(
        qn, kn, v, g, beta, cu_seqlens, state_pool, rings, trackers, write_final=True, block_v=block_v,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret,
    )
    return zero_padding(o, cu_seqlens, v.dtype), state_pool


def _gdn_materialize_kernel(
    src_ref,  # [M] i32
    dst_ref,  # [M] i32
    start_ref,  # [M] i32
    count_ref,  # [M] i32
    ring_k_ref,  # [S, H, E, K] f32
    ring_u_ref,  # [S, HV, E, V] f32
    ring_g_ref,  # [S, HV, E] f32
    state_ref,  # [S, HV, K, V] f32
    state_out_ref,  # [S, HV, K, V] f32, aliases state_ref
    *,
    group: int,
    block_v: int,
):
    i_m, i_h, i_v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols, src, dst = pl.ds(i_v * block_v, block_v), src_ref[i_m], dst_ref[i_m]
    state = _fold_ring(
        ring_k_ref, ring_u_ref, ring_g_ref, src, i_h // group, i_h, cols, start_ref[i_m], count_ref[i_m],
        state_ref[src, i_h, :, cols].astype(jnp.float32),
    )  # fmt: skip

    @pl.when(dst > 0)
    def _():
        state_out_ref[dst, i_h, :, cols] = state.astype(state_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "num_stages", "interpret"),
                   donate_argnames="state_pool")
def gdn_materialize(
    state_pool, ring_k, ring_u, ring_g, src_slots, dst_slots, ring_start, num_entries,
    *, block_v=32, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Pallas materialize; contract in `pallas_kernels.gdn.gdn_materialize` (dst slots must not be src)."""
    num_heads, head_v = state_pool.shape[1], state_pool.shape[3]
    block_v = dividing_tile(head_v, block_v, "block_v")
    operands = dict(
        src=src_slots, dst=dst_slots, ring_start=ring_start, count=num_entries,
        ring_k=ring_k, ring_u=ring_u, ring_g=ring_g, state=state_pool,
    )  # fmt: skip
    kernel = functools.partial(_gdn_materialize_kernel, group=num_heads // ring_k.shape[1], block_v=block_v)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        grid=(src_slots.shape[0], num_heads, head_v // block_v),
        input_output_aliases={list(operands).index("state"): 0},
        **_launch(num_warps, num_stages, interpret),
        cost_estimate=cost.materialize(ring_k, ring_u, ring_g, state_pool, src_slots.shape[0]),
        name=f"gdn_materialize_{block_v=}",
    )(*operands.values())
