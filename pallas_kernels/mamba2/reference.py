"""Pure-JAX Mamba2 SSD over packed varlen tokens: token recurrence, chunked SSD form, ReplaySSM.

Maths: docs/kernels.md#mamba2-ssd (the recurrence, and the chunked form of HF `Mamba2Mixer.torch_forward`) and
docs/kernels.md#replayssm (the ring). State layout: one [P, N] fp32 matrix per head.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.pools import CHUNK_BLOCK, carry_chunks, carry_rows, in_row_blocks, scatter_slots, store_checkpoints
from pallas_kernels.rings import append_dense_rows, fold_ring, pin, snapshot_at, store_snapshots
from pallas_kernels.tiles import HIGHEST
from pallas_kernels.varlen import (
    check_rows,
    checkpoint_counts,
    chunk_table,
    dense_to_rows,
    gather_chunks,
    repeat_heads,
    rows_to_dense,
    scatter_chunks,
    token_rows,
    zero_padding,
)


def advance(state, x, dt, a, b):
    """h <- exp(dt a) h + (dt x) (x) b. state [NH, P, N]; x [NH, P]; dt, a [NH]; b [NH, N]. One fused pass over
    the state, pinned whole (see `pallas_kernels.rings.pin`)."""
    return pin(pin(jnp.exp(dt * a))[:, None, None] * state + pin(dt[:, None] * x)[:, :, None] * b[:, None, :])


def recurrent_step(state, x, dt, a, b, c, d):
    """One token for all heads; b, c [NH, N] (groups expanded). Returns (state, y [NH, P]).

    The read-out uses the state before the token: h' c = e^{dt a} h c + (dt x)(b . c). So a row's last state is
    only computed when it is kept.
    """
    read = jnp.sum(state * c[:, None, :], axis=-1)
    b_dot_c = jnp.sum(b * c, axis=-1, keepdims=True)
    y = pin(pin(jnp.exp(dt * a))[:, None] * read) + pin(dt[:, None] * x * b_dot_c)
    return advance(state, x, dt, a, b), y + pin(d[:, None] * x)


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


@jax.jit
def ssd_recurrent(x, dt, A, B, C, D, cu_seqlens, initial_state):
    """Mamba2 selective scan, one token at a time: h_t = e^{dt A} h + dt x_t (x) B_t, y_t = h_t C_t + D x_t.

    Args:
      x: [T, NH, P] packed tokens; tokens at index >= cu_seqlens[-1] are padding.
      dt: [T, NH] f32, already softplus(dt + dt_bias) and clamped.
      A: [NH] f32 negative (-exp(A_log)).  D: [NH] f32 skip weight.
      B, C: [T, G, N]; head h reads group h // (NH // G).
      cu_seqlens: [R+1] i32 row boundaries (rows may be empty).
      initial_state: [R, NH, P, N] f32 per-row start state.

    Returns:
      y: [T, NH, P] in x.dtype (padding tokens zero), final_state: [R, NH, P, N] f32.
    """
    check_rows(cu_seqlens, initial_state, "initial_state")
    num_rows, num_heads = initial_state.shape[:2]
    tok = token_rows(cu_seqlens, x.shape[0])
    xf, dtf, bf, cf = _f32(x, dt, repeat_heads(B, num_heads, 1), repeat_heads(C, num_heads, 1))
    a, d, initial_state = _f32(A, D, initial_state)

    def step(carry, xs):
        state, final = carry
        row, first, valid, x_t, dt_t, b_t, c_t = xs
        state = jnp.where(first, initial_state[jnp.minimum(row, num_rows - 1)], state)
        new_state, y_t = recurrent_step(state, x_t, dt_t, a, b_t, c_t, d)
        # Every token overwrites its row's final state, so the last one wins; padding (row R) drops.
        final = final.at[row].set(new_state, mode="drop")
        return (jnp.where(valid, new_state, state), final), jnp.where(valid, y_t, 0.0)

    xs = (tok.rows, tok.positions == 0, tok.valid, xf, dtf, bf, cf)
    (_, final), y = jax.lax.scan(step, (initial_state[0], initial_state), xs)
    return y.astype(x.dtype), final


def _state_at(state, xdt, b, cum, count):
    """State after the first `count` (>= 1) tokens of a chunk (the chunk's end state, truncated at count).

    state [NH, P, N]; xdt [NH, C, P] (= x dt); b [NH, C, N]; cum [NH, C] (cumsum of dt A).
    """
    positions = jnp.arange(cum.shape[-1])
    cum_p = jnp.sum(jnp.where(positions == count - 1, cum, 0.0), axis=-1)  # [NH]
    weights = jnp.where(positions < count, jnp.exp(cum_p[:, None] - cum), 0.0)
    local = jnp.einsum("hcp,hcs->hps", xdt * weights[..., None], b, precision=HIGHEST)
    return jnp.exp(cum_p)[:, None, None] * state + local


def _y_diag(xdt, b, c, cum):
    """Intra-chunk output Y_diag[l] = sum_{s<=l} (C_l . B_s) exp(cum_l - cum_s) X_s, [NC, NH, C, P]."""
    size = cum.shape[-1]
    lower = jnp.tril(jnp.ones((size, size), bool))
    # exp(segsum): mask before exp, the upper triangle is positive and may overflow.
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    cb = jnp.einsum("zhis,zhjs->zhij", c, b, precision=HIGHEST)
    return jnp.einsum("zhij,zhjp->zhip", cb * decay, xdt, precision=HIGHEST)


def _chunked(x, dt, a, b, c, cu_seqlens, pool, slots, has_initial, chunk_size, checkpoint_lens):
    """Chunked core over f32 inputs (b, c groups expanded) on the rows' slots (`carry_chunks`); returns (y without
    D x, pool, checkpoint or None)."""
    table = chunk_table(cu_seqlens, x.shape[0], chunk_size, multiple_of=CHUNK_BLOCK)

    def prepare(block):
        """All that does not need the state, for a block of chunks at once: the loop is left with two dots a chunk."""
        xc, dtc, bc, cc = (jnp.moveaxis(gather_chunks(v, block, chunk_size), 1, 2) for v in (x, dt, b, c))
        xdt = xc * dtc[..., None]
        cum = jnp.cumsum(dtc * a[:, None], axis=-1)
        total = cum[..., -1]  # padded positions have dt = 0: the chunk's total decay
        writes = jnp.swapaxes(xdt * jnp.exp(total[..., None] - cum)[..., None], -1, -2)  # [B, NH, P, C]
        return _y_diag(xdt, bc, cc, cum), cc * jnp.exp(cum)[..., None], total, writes, xdt, bc, cum

    def chunk(prepared, state, count):
        y_diag, c_decayed, total, writes, xdt, b, cum = prepared
        y_off = jnp.einsum("hps,hcs->hcp", state, c_decayed, precision=HIGHEST)
        after = jnp.exp(total)[:, None, None] * state + jnp.einsum("hpc,hcs->hps", writes, b, precision=HIGHEST)
        return y_diag + y_off, after, None if count is None else _state_at(state, xdt, b, cum, count)

    counts = None if checkpoint_lens is None else checkpoint_counts(table, checkpoint_lens, slots.shape[0])
    out = jax.ShapeDtypeStruct((x.shape[1], chunk_size, x.shape[2]), jnp.float32)
    y, pool, checkpoint = carry_chunks(prepare, chunk, table, pool, slots, has_initial, out, counts)
    return scatter_chunks(jnp.moveaxis(y, 1, 2), table), pool, checkpoint


def _expand_groups(B, C, num_heads):
    return _f32(repeat_heads(B, num_heads, 1), repeat_heads(C, num_heads, 1))


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def ssd_chunked(x, dt, A, B, C, D, cu_seqlens, initial_state, *, chunk_size=128):
    """Mamba2 in chunked SSD form; same arguments and results as `ssd_recurrent`.

    Each row is chunked from its own first token (chunks never straddle rows).
    """
    check_rows(cu_seqlens, initial_state, "initial_state")
    b, c = _expand_groups(B, C, initial_state.shape[1])
    xf, dtf, a, d, initial_state = _f32(x, dt, A, D, initial_state)
    y, final = carry_rows(lambda *pages: _chunked(xf, dtf, a, b, c, cu_seqlens, *pages, chunk_size, None)[:2],
                          initial_state)
    return zero_padding(y + d[:, None] * xf, cu_seqlens, x.dtype), final


@functools.partial(jax.jit, static_argnames=("chunk_size",), donate_argnames="state_pool")
def ssd_prefill(
    x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None,
    checkpoint_slots=None, *, chunk_size=128,
):  # fmt: skip
    """Chunked prefill on the state pool; see `pallas_kernels.mamba2.ssd_prefill`."""
    check_rows(cu_seqlens, slots, "slots")
    b, c = _expand_groups(B, C, state_pool.shape[1])
    xf, dtf, a, d = _f32(x, dt, A, D)
    y, state_pool, ckpt = _chunked(xf, dtf, a, b, c, cu_seqlens, state_pool, slots, has_initial, chunk_size,
                                   checkpoint_lens)
    state_pool = store_checkpoints(state_pool, cu_seqlens, slots, checkpoint_lens, checkpoint_slots, ckpt)
    return zero_padding(y + d[:, None] * xf, cu_seqlens, x.dtype), state_pool


def _decode_row(state, x, dt, a, b, c, d, length, keep_states=False):
    """Recurrent steps over the first `length` of a row's [Tq, ...] tokens (Tq: the step's most tokens
    per row); returns (y [Tq, NH, P], final, with `keep_states` the state after each token
    [Tq, NH, P, N] else None)."""

    def step(s, xs):
        t, x_t, dt_t, b_t, c_t = xs
        new, y = recurrent_step(s, x_t, dt_t, a, b_t, c_t, d)
        new = jnp.where(t < length, new, s)
        return new, (y, new if keep_states else None)

    final, (y, states) = jax.lax.scan(step, state, (jnp.arange(x.shape[0]), x, dt, b, c))
    return y, final, states


def _fold_ring(state, ring_x, ring_dt, ring_b, a, ring_start, count, max_count):
    """Advance state by ring entries (ring_start + j) % E, j < count <= max_count, with the recurrence's own ops.

    state [NH, P, N]; ring_x [NH, E, P]; ring_dt [NH, E]; ring_b [G, E, N].
    """

    def fold(s, x, dt, b):
        return advance(s, x, dt, a, repeat_heads(b, s.shape[0], 0))

    return fold_ring(fold, state, (ring_x, ring_dt, ring_b), ring_start, count, max_count)


def _fold_rows(ring_width: int, max_committed: int | None):
    """`_fold_ring` over rows sharing A, to at most `max_committed` entries (None: the ring's width)."""
    return jax.vmap(functools.partial(_fold_ring, max_count=max_committed or ring_width), (0, 0, 0, 0, None, 0, 0))


def _dense_inputs(x, dt, B, C, cu_seqlens, width, num_heads):
    """Packed tokens -> per-row [R, Tq, ...] f32: (x, dt, B expanded, C expanded, B per group)."""
    xd, dtd, bd, cd = (rows_to_dense(v.astype(jnp.float32), cu_seqlens, width) for v in (x, dt, B, C))
    return xd, dtd, repeat_heads(bd, num_heads, 2), repeat_heads(cd, num_heads, 2), bd


@functools.partial(jax.jit, donate_argnames="state_pool")
def ssd_decode(x, dt, A, B, C, D, cu_seqlens, state_pool, slots):
    """Plain decoding on the pool (rows of 0 or 1 token): state read, advanced and written every call."""
    check_rows(cu_seqlens, slots, "slots")
    xd, dtd, bd, cd, _ = _dense_inputs(x, dt, B, C, cu_seqlens, 1, state_pool.shape[1])
    a, d = _f32(A, D)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    decode = jax.vmap(_decode_row, (0, 0, 0, None, 0, 0, None, 0))

    def rows(pool, slots, x, dt, b, c, length):
        y, state, _ = decode(pool[slots].astype(jnp.float32), x, dt, a, b, c, d, length)
        return scatter_slots(pool, slots, state), y

    # The same pinned ops as a ReplaySSM fold (`advance`), in the same blocks of rows, so W = 1 replay is
    # bit-identical.
    state_pool, y = in_row_blocks(rows, state_pool, (slots, xd, dtd, bd, cd, lengths), state_pool[0].nbytes)
    return dense_to_rows(y, cu_seqlens, x.shape[0]).astype(x.dtype), state_pool


@functools.partial(jax.jit, static_argnames=("max_query_len", "max_committed"),
                   donate_argnames=("state_pool", "ring_x", "ring_dt", "ring_B"))
def ssd_verify(x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush,
               *, max_query_len=None, max_committed=None):
    """ReplaySSM verify/decode; see `pallas_kernels.mamba2.ssd_verify` for the contract."""
    check_rows(cu_seqlens, slots, "slots")
    width, num_heads = max_query_len or ring_dt.shape[2], state_pool.shape[1]
    xd, dtd, bd, cd, b_groups = _dense_inputs(x, dt, B, C, cu_seqlens, width, num_heads)
    a, d = _f32(A, D)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    fold = _fold_rows(ring_dt.shape[2], max_committed)
    decode = jax.vmap(_decode_row, (0, 0, 0, None, 0, 0, None, 0))

    def rows(pool, slots, ring_start, committed, flush, x, dt, b, c, length):
        checkpoint = fold(pool[slots].astype(jnp.float32), ring_x[slots], ring_dt[slots], ring_B[slots], a, ring_start,
                          committed)
        y, _, _ = decode(checkpoint, x, dt, a, b, c, d, length)
        # Only a flush writes the state: S0 <- S0 advanced by the committed entries.
        return scatter_slots(pool, jnp.where(flush, slots, 0), checkpoint), y

    per_row = (slots, ring_start, committed, flush, xd, dtd, bd, cd, lengths)
    state_pool, y = in_row_blocks(rows, state_pool, per_row, state_pool[0].nbytes)
    rings = append_dense_rows((ring_x, ring_dt, ring_B), (xd, dtd, b_groups), slots, ring_start, committed, lengths)
    return dense_to_rows(y, cu_seqlens, x.shape[0]).astype(x.dtype), state_pool, *rings


@functools.partial(jax.jit, static_argnames="max_query_len", donate_argnames=("state_pool", "snapshots"))
def ssd_verify_snapshots(x, dt, A, B, C, D, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
                         *, max_query_len=None):
    """Verify/decode keeping the state after every position; see `pallas_kernels.mamba2.ssd_verify_snapshots`."""
    check_rows(cu_seqlens, slots, "slots")
    width, num_heads = max_query_len or snapshots.shape[2], state_pool.shape[1]
    xd, dtd, bd, cd, _ = _dense_inputs(x, dt, B, C, cu_seqlens, width, num_heads)
    a, d = _f32(A, D)
    checkpoint = snapshot_at(state_pool, snapshots, slots, ring_start, committed)
    decode = jax.vmap(functools.partial(_decode_row, keep_states=True), (0, 0, 0, None, 0, 0, None, 0))
    y, _, states = decode(checkpoint, xd, dtd, a, bd, cd, d, cu_seqlens[1:] - cu_seqlens[:-1])
    state_pool, snapshots = store_snapshots(state_pool, snapshots, checkpoint, states, cu_seqlens, slots, ring_start,
                                            committed, flush, x.shape[0])
    return dense_to_rows(y, cu_seqlens, x.shape[0]).astype(x.dtype), state_pool, snapshots


@functools.partial(jax.jit, static_argnames="max_committed", donate_argnames="state_pool")
def ssd_materialize(state_pool, ring_x, ring_dt, ring_B, A, src_slots, dst_slots, ring_start, num_entries, *,
                    max_committed=None):
    """state_pool[dst] = state_pool[src] advanced by its first `num_entries` ring entries; see __init__."""
    fold = _fold_rows(ring_dt.shape[2], max_committed)
    state = state_pool[src_slots].astype(jnp.float32)
    rings = (ring_x[src_slots], ring_dt[src_slots], ring_B[src_slots])
    state = fold(state, *rings, A.astype(jnp.float32), ring_start, num_entries)
    return scatter_slots(state_pool, dst_slots, state)
