"""Pallas (Triton backend) Mamba2 SSD kernels: decode, ReplaySSM verify, materialize (prefill: pallas_prefill).

Grid: (row, head, P tile). Each program owns one [block_p, N] fp32 tile of one head's state and keeps it
in registers while it walks its row's tokens, so no two programs share a state tile. Metadata
(cu_seqlens, slots, trackers) is int32 read as scalars; ring entries are read one scalar-indexed row at
a time. The state pool is updated in place through `input_output_aliases`; ring appends are a scatter in
XLA after the kernel (no in-kernel scatter, docs/kernels.md#triton-backend-rules; B entries are shared by a
group's heads).
The token steps have no dots: x, B, C of any float dtype are upcast as loaded and y is stored in x.dtype.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.mamba2 import cost
from pallas_kernels.rings import append_tokens
from pallas_kernels.tiles import dividing_tile, int32
from pallas_kernels.varlen import check_rows, zero_padding

_f32 = jnp.float32


# ---------------------------------------------------------------- token recurrence


def _advance(state, x, dt, a, b):
    """One recurrence step h <- e^{dt a} h + (dt x) (x) b on a tile. state [BP, N]; x [BP]; b [N]."""
    return jnp.exp(dt * a) * state + (dt * x)[:, None] * b[None, :]


def _fold_ring(state, ring_x_ref, ring_dt_ref, ring_B_ref, *, slot, head, group, p0, block_p, a, start, count):
    """Advance a state tile by ring entries (start + j) % E, j < count (the ReplaySSM replay)."""
    width = ring_dt_ref.shape[2]

    def body(j, s):
        i = (start + j) % width
        x = ring_x_ref[slot, head, i, pl.ds(p0, block_p)].astype(_f32)
        b = ring_B_ref[slot, group, i, :].astype(_f32)
        return _advance(s, x, ring_dt_ref[slot, head, i].astype(_f32), a, b)

    return jax.lax.fori_loop(0, count, body, state)


def _decode_tokens(
    state, start, length, x_ref, dt_ref, B_ref, C_ref, y_ref, *, head, group, p0, block_p, a, d, store=None
):  # fmt: skip
    """Recurrent steps over tokens [start, start + length) writing y_t = h_t C_t + D x_t; returns the state.
    `store(t, state)`, when given, sees the state after the row's token t."""

    def token(t, s):
        x = x_ref[start + t, head, pl.ds(p0, block_p)].astype(_f32)
        b, c = B_ref[start + t, group, :].astype(_f32), C_ref[start + t, group, :].astype(_f32)
        s = _advance(s, x, dt_ref[start + t, head].astype(_f32), a, b)
        y = jnp.sum(s * c[None, :], axis=1) + d * x
        y_ref[start + t, head, pl.ds(p0, block_p)] = y.astype(y_ref.dtype)
        if store is not None:
            store(t, s)
        return s

    return jax.lax.fori_loop(0, length, token, state)


def program_tile(heads_per_group, block_p, parts=1):
    """(head, group, first P index) of this program; grid axis 2 holds `parts` programs per P tile."""
    head = pl.program_id(1)
    return head, head // heads_per_group, pl.program_id(2) // parts * block_p


def _ssd_replay_kernel(
    cu_seqlens_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    ring_start_ref,  # [R] i32
    committed_ref,  # [R] i32
    flush_ref,  # [R] i32, 0/1
    A_ref,  # [NH] f32
    D_ref,  # [NH] f32
    x_ref,  # [T, NH, P]
    dt_ref,  # [T, NH] f32
    B_ref,  # [T, G, N]
    C_ref,  # [T, G, N]
    ring_x_ref,  # [S, NH, E, P]
    ring_dt_ref,  # [S, NH, E]
    ring_B_ref,  # [S, G, E, N]
    state_ref,  # [S, NH, P, N] f32, aliased to state_out_ref
    y_ref,  # [T, NH, P]
    state_out_ref,  # [S, NH, P, N] f32
    *, heads_per_group, block_p, write_final,
):  # fmt: skip
    """ReplaySSM verify; plain decode is this program with no committed entries and `write_final`.

    One token step for both makes ReplaySSM with W = 1 bit-identical to plain decoding.
    """
    i_row = pl.program_id(0)
    head, group, p0 = program_tile(heads_per_group, block_p)
    slot, start = slots_ref[i_row], cu_seqlens_ref[i_row]
    length = cu_seqlens_ref[i_row + 1] - start
    tile = (slot, head, pl.ds(p0, block_p), slice(None))
    write_back = (flush_ref[i_row] != 0) & (slot > 0)

    @pl.when((length > 0) | write_back)
    def _():
        a = A_ref[head]
        checkpoint = _fold_ring(
            state_ref[tile].astype(_f32), ring_x_ref, ring_dt_ref, ring_B_ref, slot=slot, head=head, group=group,
            p0=p0, block_p=block_p, a=a, start=ring_start_ref[i_row], count=committed_ref[i_row],
        )  # fmt: skip

        # The only state write of ReplaySSM: a flush folds the committed entries into S0.
        @pl.when(write_back)
        def _():
            state_out_ref[tile] = checkpoint.astype(state_out_ref.dtype)

        state = _decode_tokens(
            checkpoint, start, length, x_ref, dt_ref, B_ref, C_ref, y_ref,
            head=head, group=group, p0=p0, block_p=block_p, a=a, d=D_ref[head],
        )  # fmt: skip
        if write_final:

            @pl.when(slot > 0)
            def _():
                state_out_ref[tile] = state.astype(state_out_ref.dtype)


def _ssd_snapshot_kernel(
    cu_seqlens_ref, slots_ref, ring_start_ref, committed_ref, flush_ref, A_ref, D_ref, x_ref, dt_ref, B_ref, C_ref,
    snapshots_ref, state_ref, y_ref, snapshots_out_ref, state_out_ref, *, heads_per_group, block_p,
):  # fmt: skip
    """The snapshot baseline: the live state is read whole, and the state after every token is stored.

    Operands as `_ssd_replay_kernel`'s, with snapshots [S, NH, E, P, N] f32 (aliased to snapshots_out_ref) in
    place of the rings.
    """
    i_row = pl.program_id(0)
    head, group, p0 = program_tile(heads_per_group, block_p)
    slot, start, committed = slots_ref[i_row], cu_seqlens_ref[i_row], committed_ref[i_row]
    length, width = cu_seqlens_ref[i_row + 1] - start, snapshots_ref.shape[2]
    new = ring_start_ref[i_row] + committed  # ring index of the row's first new entry
    rows = pl.ds(p0, block_p)
    write_back = (flush_ref[i_row] != 0) & (slot > 0)

    @pl.when((length > 0) | write_back)
    def _():
        live = snapshots_ref[slot, head, (new + width - 1) % width, rows, :]
        checkpoint = jnp.where(committed > 0, live, state_ref[slot, head, rows, :]).astype(_f32)

        @pl.when(write_back)
        def _():
            state_out_ref[slot, head, rows, :] = checkpoint.astype(state_out_ref.dtype)

        def store(t, state):
            @pl.when(slot > 0)
            def _():
                snapshots_out_ref[slot, head, (new + t) % width, rows, :] = state.astype(snapshots_out_ref.dtype)

        _decode_tokens(
            checkpoint, start, length, x_ref, dt_ref, B_ref, C_ref, y_ref,
            head=head, group=group, p0=p0, block_p=block_p, a=A_ref[head], d=D_ref[head], store=store,
        )  # fmt: skip


def _ssd_materialize_kernel(
    src_slots_ref,  # [M] i32
    dst_slots_ref,  # [M] i32, 0 = skip
    ring_start_ref,  # [M] i32
    num_entries_ref,  # [M] i32
    A_ref,  # [NH] f32
    ring_x_ref,  # [S, NH, E, P]
    ring_dt_ref,  # [S, NH, E]
    ring_B_ref,  # [S, G, E, N]
    state_ref,  # [S, NH, P, N] f32, aliased to state_out_ref
    state_out_ref,  # [S, NH, P, N] f32
    *, heads_per_group, block_p,
):  # fmt: skip
    i_entry = pl.program_id(0)
    head, group, p0 = program_tile(heads_per_group, block_p)
    src, dst = src_slots_ref[i_entry], dst_slots_ref[i_entry]

    @pl.when(dst > 0)
    def _():
        state = _fold_ring(
            state_ref[src, head, pl.ds(p0, block_p), :].astype(_f32), ring_x_ref, ring_dt_ref, ring_B_ref,
            slot=src, head=head, group=group, p0=p0, block_p=block_p, a=A_ref[head],
            start=ring_start_ref[i_entry], count=num_entries_ref[i_entry],
        )  # fmt: skip
        state_out_ref[dst, head, pl.ds(p0, block_p), :] = state.astype(state_out_ref.dtype)


# ---------------------------------------------------------------- launchers

_STATIC = ("block_p", "num_warps", "num_stages", "interpret")


def check_tiles(state_pool, block_p):
    """The largest power-of-two tile <= block_p dividing P (P = 80 -> 16); N must be a power of two."""
    head_dim, state_size = state_pool.shape[2:]
    if state_size & (state_size - 1):
        raise ValueError(f"N={state_size} must be a power of two (Triton tiles)")
    return dividing_tile(head_dim, block_p, "block_p")


def pool_call(kernel, operands, out_shapes, *, num_rows, block_p, interpret, name, cost_estimate, num_warps=4,
              num_stages=1, parts=1):
    """pallas_call over (row, head, P tile x `parts`); the last operand, the state pool, is the last output, in
    place."""
    num_heads, head_dim = operands[-1].shape[1:3]
    return pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in out_shapes),
        grid=(num_rows, num_heads, head_dim // block_p * parts),
        input_output_aliases={len(operands) - 1: len(out_shapes) - 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost_estimate,
        name=name,
    )(*operands)


def _replay_call(x, dt, A, B, C, D, cu_seqlens, state_pool, rings, trackers, *, block_p, write_final, interpret,
                 **launch):
    """Launch `_ssd_replay_kernel`; returns (y with padding zeroed, state_pool).

    rings: (ring_x, ring_dt, ring_B); trackers: (slots, ring_start, committed, flush).
    """
    check_rows(cu_seqlens, trackers[0], "slots")
    block_p = check_tiles(state_pool, block_p)
    operands = [*int32(cu_seqlens, *trackers), A.astype(_f32), D.astype(_f32), x, dt, B, C, *rings, state_pool]
    kernel = functools.partial(
        _ssd_replay_kernel, heads_per_group=x.shape[1] // B.shape[1], block_p=block_p, write_final=write_final
    )
    num_rows = trackers[0].shape[0]
    estimate = cost.replay(x, dt, B, C, state_pool, *rings, num_rows, write_final=write_final)
    y, state_pool = pool_call(
        kernel, operands, (x, state_pool), num_rows=num_rows, block_p=block_p, interpret=interpret,
        name=f"ssd_{'decode' if write_final else 'verify'}_{block_p=}", cost_estimate=estimate, **launch,
    )  # fmt: skip
    return zero_padding(y, cu_seqlens, x.dtype), state_pool


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames="state_pool")
def ssd_decode(x, dt, A, B, C, D, cu_seqlens, state_pool, slots, *, block_p=16, num_warps=4, num_stages=1,
               interpret=False):
    """Same contract as `reference.ssd_decode`; one program per (row, head, block_p rows of P)."""
    num_heads, head_dim, state_size = state_pool.shape[1:]
    zeros = jnp.zeros_like(slots)
    # committed = 0, so no ring entry is read: one-entry dummy rings fill the operand list.
    rings = (
        jnp.zeros((1, num_heads, 1, head_dim), _f32),
        jnp.zeros((1, num_heads, 1), _f32),
        jnp.zeros((1, B.shape[1], 1, state_size), _f32),
    )
    trackers = (slots, zeros, zeros, zeros)
    return _replay_call(
        x, dt, A, B, C, D, cu_seqlens, state_pool, rings, trackers, block_p=block_p, write_final=True,
        interpret=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@functools.partial(
    jax.jit, static_argnames=_STATIC, donate_argnames=("state_pool", "ring_x", "ring_dt", "ring_B")
)
def ssd_verify(
    x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush,
    *, block_p=16, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Same contract as `reference.ssd_verify`; one program per (row, head, block_p rows of P)."""
    y, state_pool = _replay_call(
        x, dt, A, B, C, D, cu_seqlens, state_pool, (ring_x, ring_dt, ring_B), (slots, ring_start, committed, flush),
        block_p=block_p, write_final=False, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    rings = (
        append_tokens(ring, new, cu_seqlens, slots, ring_start, committed)
        for ring, new in ((ring_x, x), (ring_dt, dt), (ring_B, B))
    )
    return (y, state_pool, *rings)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state_pool", "snapshots"))
def ssd_verify_snapshots(
    x, dt, A, B, C, D, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
    *, block_p=16, num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Same contract as `reference.ssd_verify_snapshots`; one program per (row, head, block_p rows of P)."""
    check_rows(cu_seqlens, slots, "slots")
    block_p = check_tiles(state_pool, block_p)
    trackers = int32(cu_seqlens, slots, ring_start, committed, flush)
    operands = [*trackers, A.astype(_f32), D.astype(_f32), x, dt, B, C, snapshots, state_pool]
    kernel = functools.partial(_ssd_snapshot_kernel, heads_per_group=x.shape[1] // B.shape[1], block_p=block_p)
    y, snapshots, state_pool = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in (x, snapshots, state_pool)),
        grid=(slots.shape[0], state_pool.shape[1], state_pool.shape[2] // block_p),
        input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost.snapshots(x, dt, B, C, snapshots, state_pool, slots.shape[0]),
        name=f"ssd_snapshots_{block_p=}",
    )(*operands)
    return zero_padding(y, cu_seqlens, x.dtype), state_pool, snapshots


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames="state_pool")
def ssd_materialize(
    state_pool, ring_x, ring_dt, ring_B, A, src_slots, dst_slots, ring_start, num_entries, *, block_p=16,
    num_warps=4, num_stages=1, interpret=False,
):  # fmt: skip
    """Same contract as `reference.ssd_materialize`, computed in place.

    No dst slot may be another entry's src (the engine materializes into fresh cache slots): programs
    of different entries run concurrently on the one pool.
    """
    block_p = check_tiles(state_pool, block_p)
    metadata = int32(src_slots, dst_slots, ring_start, num_entries)
    operands = [*metadata, A.astype(_f32), ring_x, ring_dt, ring_B, state_pool]
    kernel = functools.partial(
        _ssd_materialize_kernel, heads_per_group=state_pool.shape[1] // ring_B.shape[1], block_p=block_p
    )
    (state_pool,) = pool_call(
        kernel, operands, (state_pool,), num_rows=src_slots.shape[0], block_p=block_p, interpret=interpret,
        name=f"ssd_materialize_{block_p=}", num_warps=num_warps, num_stages=num_stages,
        cost_estimate=cost.materialize(ring_x, ring_dt, ring_B, state_pool, src_slots.shape[0]),
    )  # fmt: skip
    return state_pool
