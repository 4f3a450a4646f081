"""Pure-JAX gated delta rule over packed varlen tokens: token recurrence and chunked WY/UT form.

Maths: docs/kernels.md#gated-delta-rule, the recurrence and the chunked form (HF `torch_chunk_gated_delta_rule`).
State layout is K-major: one [K, V] fp32 matrix per value head.
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
)


def l2norm(x: jax.Array) -> jax.Array:
    # Mirrors fla `l2norm_fwd`: eps is added to the sum of squares, inside the rsqrt.
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def normalise_qk(q, k, scale, use_qk_l2norm):
    """[T, H, K] q, k -> f32 (q normalised and scaled, k normalised); still per qk head."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def decay(state, g):
    """state [HV, K, V] * exp(g [HV])."""
    return pin(pin(jnp.exp(g))[:, None, None] * state)


def advance(state, g, k, u):
    """The decode ops' one state update, decay and rank-1 write: e^g state + k (x) u; g [HV], k [HV, K], u [HV, V].

    One fused pass over the state, pinned whole (see `pallas_kernels.rings.pin`): separate decay and write passes
    would stream the states from memory twice."""
    return pin(pin(jnp.exp(g))[:, None, None] * state + k[:, :, None] * u[:, None, :])


def recurrent_step(state, q, k, v, g, beta):
    """One token for all value heads: decay, read, delta, write, read-out.

    state [HV, K, V]; q, k [HV, K]; v [HV, V]; g, beta [HV]. Returns (state, o [HV, V], delta [HV, V]).
    Both reads use the state before the token: with S' = e^g S + k delta^T, the memory is e^g S^T k and the
    read-out S'^T q = e^g S^T q + (k . q) delta. So a row's last state is only computed when it is kept.
    """
    decay_g = pin(jnp.exp(g))[:, None]
    reads = jnp.sum(state[:, None] * jnp.stack([k, q], axis=1)[..., None], axis=2)
    delta = pin(beta[:, None] * (v - pin(decay_g * reads[:, 0])))
    k_dot_q = jnp.sum(k * q, axis=-1, keepdims=True)
    return advance(state, g, k, delta), pin(decay_g * reads[:, 1]) + pin(k_dot_q * delta), delta


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"))
def gdn_recurrent(q, k, v, g, beta, cu_seqlens, initial_state, *, scale=None, use_qk_l2norm=True):
    """Gated delta rule, one token at a time (the oracle; `fused_recurrent_gated_delta_rule` semantics).

    Args:
      q, k: [T, H, K] packed tokens; tokens at index >= cu_seqlens[-1] are padding.
      v: [T, HV, V], HV a multiple of H (value head h uses qk head h // (HV // H)).
      g: [T, HV] f32 log-decay (<= 0).  beta: [T, HV] f32 write strength.
      cu_seqlens: [R+1] i32 row boundaries (rows may be empty).
      initial_state: [R, HV, K, V] f32 per-row start state.
      scale: query scale, default K ** -0.5.  use_qk_l2norm: l2-normalise q and k first.

    Returns:
      o: [T, HV, V] in v.dtype (padding tokens zero), final_state: [R, HV, K, V] f32.
    """
    check_rows(cu_seqlens, initial_state, "initial_state")
    num_rows, num_heads = initial_state.shape[:2]
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    tok = token_rows(cu_seqlens, q.shape[0])
    initial_state = initial_state.astype(jnp.float32)

    def step(carry, xs):
        state, final = carry
        row, first, valid, q_t, k_t, v_t, g_t, beta_t = xs
        state = jnp.where(first, initial_state[jnp.minimum(row, num_rows - 1)], state)
        new_state, o_t, _ = recurrent_step(state, q_t, k_t, v_t, g_t, beta_t)
        # Every token overwrites its row's final state, so the last one wins; padding (row R) drops.
        final = final.at[row].set(new_state, mode="drop")
        return (jnp.where(valid, new_state, state), final), jnp.where(valid, o_t, 0.0)

    qn, kn = repeat_heads(qn, num_heads, 1), repeat_heads(kn, num_heads, 1)
    xs = (tok.rows, tok.positions == 0, tok.valid, qn, kn, v.astype(jnp.float32), g, beta)
    (_, final), o = jax.lax.scan(step, (initial_state[0], initial_state), xs)
    return o.astype(v.dtype), final


def chunk_decays(g):
    """g [NC, HV, C] -> (G inclusive cumsum, Gamma [NC, HV, C, C] = exp(G_i - G_j) on i >= j else 0)."""
    cum = jnp.cumsum(g, axis=-1)
    size = g.shape[-1]
    lower = jnp.tril(jnp.ones((size, size), bool))
    # Mask before exp: G_i - G_j > 0 above the diagonal and may overflow.
    gamma = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    return cum, gamma


def unit_lower_inverse(a):
    """(I + a)^-1 for strictly lower triangular a [..., C, C], row by row (HF forward substitution).

    Row i of the inverse is e_i - a_i X, where X's rows j < i are already final; a_ij = 0 for j >= i. Row i is
    sliced out and written back (the Pallas kernel's `wy._invert_diagonal` masks instead: no gathers in a
    Triton kernel; masking here gives the same bits, several times slower on XLA:CPU).
    (Squaring-based products of (I + a^(2^j)) cancel catastrophically when keys are similar.)
    """
    eye = jnp.eye(a.shape[-1], dtype=jnp.float32)

    def substitute(i, x):
        row = eye[i] - jnp.sum(jax.lax.dynamic_index_in_dim(a, i, -2, keepdims=False)[..., :, None] * x, axis=-2)
        return jax.lax.dynamic_update_index_in_dim(x, row, i, -2)

    return jax.lax.fori_loop(1, a.shape[-1], substitute, jnp.broadcast_to(eye, a.shape))


def _wy_transform(k, v, beta, cum, gamma):
    """U = (I + A)^-1 (beta V), W = (I + A)^-1 (beta e^G K); A = StrictLower(beta K K^T . Gamma)."""
    size = k.shape[-2]
    strict = jnp.tril(jnp.ones((size, size), bool), -1)
    kk = jnp.einsum("nhik,nhjk->nhij", k, k, precision=HIGHEST)
    inverse = unit_lower_inverse(jnp.where(strict, beta[..., :, None] * kk * gamma, 0.0))
    u = jnp.einsum("nhij,nhjv->nhiv", inverse, beta[..., None] * v, precision=HIGHEST)
    w = jnp.einsum("nhij,nhjk->nhik", inverse, (beta * jnp.exp(cum))[..., None] * k, precision=HIGHEST)
    return u, w


def _state_at(state, k, v_new, cum, count):
    """State after the first `count` (>= 1) tokens of a chunk: e^{G_p} S + sum_{j<count} e^{G_p-G_j} k_j u_j.

    state [HV, K, V]; k [HV, C, K]; v_new [HV, C, V]; cum [HV, C]; p = count - 1.
    """
    positions = jnp.arange(cum.shape[-1])
    cum_p = jnp.sum(jnp.where(positions == count - 1, cum, 0.0), axis=-1)  # [HV]
    weights = jnp.where(positions < count, jnp.exp(cum_p[:, None] - cum), 0.0)
    return decay(state, cum_p) + jnp.einsum("hck,hcv->hkv", k * weights[..., None], v_new, precision=HIGHEST)


def _chunked(qn, kn, v, g, beta, cu_seqlens, pool, slots, has_initial, chunk_size, checkpoint_lens):
    """Chunked core over f32 [T, HV, ...] inputs on the rows' slots (`carry_chunks`); returns (o [T, HV, V] f32,
    pool, checkpoint or None)."""
    table = chunk_table(cu_seqlens, qn.shape[0], chunk_size, multiple_of=CHUNK_BLOCK)

    def prepare(block):
        """All that does not need the state, for a block of chunks at once: the loop is left with three dots a chunk."""
        qc, kc, vc, gc, bc = (jnp.moveaxis(gather_chunks(x.astype(jnp.float32), block, chunk_size), 1, 2)
                              for x in (qn, kn, v, g, beta))  # [B, HV, C, ...]
        cum, gamma = chunk_decays(gc)
        u, w = _wy_transform(kc, vc, bc, cum, gamma)
        reads = jnp.concatenate([w, qc * jnp.exp(cum)[..., None]], axis=-2)  # [B, HV, 2C, K]: W S, then Q e^G S
        qk = jnp.einsum("nhik,nhjk->nhij", qc, kc, precision=HIGHEST) * gamma
        total = cum[..., -1]  # padded positions have g = 0: the chunk's total decay
        writes = jnp.swapaxes(kc * jnp.exp(total[..., None] - cum)[..., None], -1, -2)  # [B, HV, K, C]
        return reads, u, qk, total, writes, kc, cum

    def chunk(prepared, state, count):
        reads, u, qk, total, writes, k, cum = prepared
        read = jnp.einsum("hck,hkv->hcv", reads, state, precision=HIGHEST)
        v_new = u - read[:, :chunk_size]
        o = read[:, chunk_size:] + jnp.einsum("hij,hjv->hiv", qk, v_new, precision=HIGHEST)
        after = decay(state, total) + jnp.einsum("hkc,hcv->hkv", writes, v_new, precision=HIGHEST)
        return o, after, None if count is None else _state_at(state, k, v_new, cum, count)

    counts = None if checkpoint_lens is None else checkpoint_counts(table, checkpoint_lens, slots.shape[0])
    out = jax.ShapeDtypeStruct((v.shape[1], chunk_size, v.shape[2]), jnp.float32)
    o, pool, checkpoint = carry_chunks(prepare, chunk, table, pool, slots, has_initial, out, counts)
    return scatter_chunks(jnp.moveaxis(o, 1, 2), table), pool, checkpoint


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size"))
def gdn_chunked(q, k, v, g, beta, cu_seqlens, initial_state, *, scale=None, use_qk_l2norm=True, chunk_size=64):
    """Gated delta rule in chunked WY/UT form; same arguments and results as `gdn_recurrent`.

    Each row is chunked from its own first token (chunks never straddle rows), so a row's result does
    not depend on what else is packed with it.
    """
    check_rows(cu_seqlens, initial_state, "initial_state")
    num_heads = initial_state.shape[1]
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    qn, kn = repeat_heads(qn, num_heads, 1), repeat_heads(kn, num_heads, 1)
    o, final = carry_rows(lambda *pages: _chunked(qn, kn, v, g, beta, cu_seqlens, *pages, chunk_size, None)[:2],
                          initial_state.astype(jnp.float32))
    return o.astype(v.dtype), final


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "chunk_size"), donate_argnames="state_pool")
def gdn_prefill(
    q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, scale=None, use_qk_l2norm=True, chunk_size=64,
):  # fmt: skip
    """Chunked prefill on the state pool; see `pallas_kernels.gdn.gdn_prefill`."""
    check_rows(cu_seqlens, slots, "slots")
    num_heads = state_pool.shape[1]
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    qn, kn = repeat_heads(qn, num_heads, 1), repeat_heads(kn, num_heads, 1)
    o, state_pool, ckpt = _chunked(qn, kn, v, g, beta, cu_seqlens, state_pool, slots, has_initial, chunk_size,
                                   checkpoint_lens)
    state_pool = store_checkpoints(state_pool, cu_seqlens, slots, checkpoint_lens, checkpoint_slots, ckpt)
    return o.astype(v.dtype), state_pool


def _decode_row(state, q, k, v, g, beta, length, keep_states=False):
    """Recurrent steps over the first `length` of a row's [Tq, ...] tokens (Tq: the step's most tokens
    per row; heads already expanded).

    Returns (o [Tq, HV, V], delta [Tq, HV, V], final state, with `keep_states` the state after each
    token [Tq, HV, K, V] else None); entries past `length` are don't-care.
    """

    def step(s, xs):
        t, *token = xs
        new, o, delta = recurrent_step(s, *token)
        new = jnp.where(t < length, new, s)
        return new, (o, delta, new if keep_states else None)

    final, (o, delta, states) = jax.lax.scan(step, state, (jnp.arange(q.shape[0]), q, k, v, g, beta))
    return o, delta, final, states


def _fold_ring(state, ring_k, ring_u, ring_g, ring_start, count, max_count):
    """Advance state by ring entries (ring_start + j) % E, j < count <= max_count, with the recurrence's own ops.

    state [HV, K, V]; ring_k [H, E, K]; ring_u [HV, E, V]; ring_g [HV, E].
    """

    def entry(s, k, u, g):
        return advance(s, g, repeat_heads(k, s.shape[0], 0), u)

    return fold_ring(entry, state, (ring_k, ring_u, ring_g), ring_start, count, max_count)


def _fold_rows(ring_width: int, max_committed: int | None):
    """`_fold_ring` over rows, to at most `max_committed` entries (None: the ring's width)."""
    return jax.vmap(functools.partial(_fold_ring, max_count=max_committed or ring_width))


def _dense_inputs(q, k, v, g, beta, cu_seqlens, width, num_heads, scale, use_qk_l2norm):
    """Packed tokens -> per-row [R, Tq, ...] f32; returns (q, k expanded, k per qk head, v, g, beta)."""
    qn, kn = normalise_qk(q, k, scale, use_qk_l2norm)
    qd, kd = (rows_to_dense(x, cu_seqlens, width) for x in (qn, kn))
    rest = (rows_to_dense(x.astype(jnp.float32), cu_seqlens, width) for x in (v, g, beta))
    return (repeat_heads(qd, num_heads, 2), repeat_heads(kd, num_heads, 2), kd, *rest)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm"), donate_argnames="state_pool")
def gdn_decode(q, k, v, g, beta, cu_seqlens, state_pool, slots, *, scale=None, use_qk_l2norm=True):
    """Plain decoding on the pool (rows of 0 or 1 token): state read, advanced and written every call."""
    check_rows(cu_seqlens, slots, "slots")
    qd, kd, _, vd, gd, bd = _dense_inputs(q, k, v, g, beta, cu_seqlens, 1, state_pool.shape[1], scale, use_qk_l2norm)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]

    def rows(pool, slots, *tokens):
        o, _, state, _ = jax.vmap(_decode_row)(pool[slots].astype(jnp.float32), *tokens)
        return scatter_slots(pool, slots, state), o

    # The same pinned ops as a ReplaySSM fold (`decay`, `write`), in the same blocks of rows, so W = 1 replay is
    # bit-identical.
    state_pool, o = in_row_blocks(rows, state_pool, (slots, qd, kd, vd, gd, bd, lengths), state_pool[0].nbytes)
    return dense_to_rows(o, cu_seqlens, q.shape[0]).astype(v.dtype), state_pool


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm", "max_query_len", "max_committed"),
    donate_argnames=("state_pool", "ring_k", "ring_u", "ring_g"),
)
def gdn_verify(
    q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, max_query_len=None, max_committed=None,
):  # fmt: skip
    """ReplaySSM verify/decode; see `pallas_kernels.gdn.gdn_verify` for the contract."""
    check_rows(cu_seqlens, slots, "slots")
    width, num_heads = max_query_len or ring_g.shape[2], state_pool.shape[1]
    qd, kd, k_heads, vd, gd, bd = _dense_inputs(q, k, v, g, beta, cu_seqlens, width, num_heads, scale, use_qk_l2norm)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    fold = _fold_rows(ring_g.shape[2], max_committed)

    def rows(pool, slots, ring_start, committed, flush, *tokens):
        checkpoint = fold(pool[slots].astype(jnp.float32), ring_k[slots], ring_u[slots], ring_g[slots], ring_start,
                          committed)
        o, delta, _, _ = jax.vmap(_decode_row)(checkpoint, *tokens)
        # Only a flush writes the state: S0 <- S0 advanced by the committed entries.
        return scatter_slots(pool, jnp.where(flush, slots, 0), checkpoint), (o, delta)

    per_row = (slots, ring_start, committed, flush, qd, kd, vd, gd, bd, lengths)
    state_pool, (o, delta) = in_row_blocks(rows, state_pool, per_row, state_pool[0].nbytes)
    rings = append_dense_rows((ring_k, ring_u, ring_g), (k_heads, delta, gd), slots, ring_start, committed, lengths)
    return dense_to_rows(o, cu_seqlens, q.shape[0]).astype(v.dtype), state_pool, *rings


@functools.partial(
    jax.jit, static_argnames=("scale", "use_qk_l2norm", "max_query_len"), donate_argnames=("state_pool", "snapshots")
)
def gdn_verify_snapshots(
    q, k, v, g, beta, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, max_query_len=None,
):  # fmt: skip
    """Verify/decode keeping the state after every position; see `pallas_kernels.gdn.gdn_verify_snapshots`."""
    check_rows(cu_seqlens, slots, "slots")
    width, num_heads = max_query_len or snapshots.shape[2], state_pool.shape[1]
    qd, kd, _, vd, gd, bd = _dense_inputs(q, k, v, g, beta, cu_seqlens, width, num_heads, scale, use_qk_l2norm)
    checkpoint = snapshot_at(state_pool, snapshots, slots, ring_start, committed)
    o, _, _, states = jax.vmap(functools.partial(_decode_row, keep_states=True))(
        checkpoint, qd, kd, vd, gd, bd, cu_seqlens[1:] - cu_seqlens[:-1]
    )
    state_pool, snapshots = store_snapshots(state_pool, snapshots, checkpoint, states, cu_seqlens, slots, ring_start,
                                            committed, flush, q.shape[0])
    return dense_to_rows(o, cu_seqlens, q.shape[0]).astype(v.dtype), state_pool, snapshots


@functools.partial(jax.jit, static_argnames="max_committed", donate_argnames="state_pool")
def gdn_materialize(state_pool, ring_k, ring_u, ring_g, src_slots, dst_slots, ring_start, num_entries, *,
                    max_committed=None):
    """state_pool[dst] = state_pool[src] advanced by its first `num_entries` ring entries; see __init__."""
    state = state_pool[src_slots].astype(jnp.float32)
    state = _fold_rows(ring_g.shape[2], max_committed)(
        state, ring_k[src_slots], ring_u[src_slots], ring_g[src_slots], ring_start, num_entries
    )
    return scatter_slots(state_pool, dst_slots, state)
