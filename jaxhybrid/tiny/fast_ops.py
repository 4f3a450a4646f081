"""Training-only replacements for the attention and GDN ops, exact for fixed [B, L] batches of fresh rows.

The inference ops serve packed varlen rows over paged pools: attention gathers each token's keys block by
block and GDN scans every chunk of every row in sequence. On CPU their gradients are dominated by
scatter-adds and scan steps (a [8, 512] step of the default model takes ~24 s). When every row is a new
sequence of the same length L (positions 0..L-1, zero initial state, L a multiple of the chunk), the same
functions are a dense causal softmax and a chunked delta rule batched over rows, which train ~5x faster.
`TRAINING_OPS` builds the train-step model with them; evaluation always runs the inference ops, and tests
check that both give the same outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxhybrid.models.ops import ModelOps
from pallas_kernels.gdn.reference import chunk_decays, l2norm

CHUNK = 64  # the inference op's default chunk, so the arithmetic matches it step for step


def causal_attention(q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale,
                     backend=None):
    """`ragged_paged_attention` for R equal rows starting at position 0; the KV pools are returned unwritten."""
    num_rows = block_table.shape[0]
    num_tokens, num_q_heads, head_dim = q.shape
    length, num_kv_heads = num_tokens // num_rows, k.shape[1]
    grouped = q.astype(jnp.float32).reshape(num_rows, length, num_kv_heads, -1, head_dim) * scale
    keys = k.astype(jnp.float32).reshape(num_rows, length, num_kv_heads, head_dim)
    values = v.astype(jnp.float32).reshape(num_rows, length, num_kv_heads, head_dim)
    scores = jnp.einsum("rigqd,rjgd->rgqij", grouped, keys)
    causal = jnp.tril(jnp.ones((length, length), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("rgqij,rjgd->rigqd", probs, values)
    return out.reshape(q.shape).astype(q.dtype), k_pool, v_pool


def _to_chunks(x: jax.Array, num_rows: int) -> jax.Array:
    """[T, HV, ...] -> [R, NC, HV, C, ...] f32."""
    x = x.astype(jnp.float32).reshape(num_rows, -1, CHUNK, *x.shape[1:])
    return jnp.moveaxis(x, 3, 2)


def chunked_delta_rule(q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, *, backend=None):
    """`gdn_prefill` (l2-normalised q/k, scale K**-0.5) for R equal rows from zero states; the pool is
    returned unwritten (training reads only the outputs)."""
    num_rows, num_v_heads = slots.shape[0], v.shape[1]
    repeat = lambda x: jnp.repeat(x, num_v_heads // x.shape[1], axis=1)
    q = repeat(l2norm(q) * q.shape[-1] ** -0.5)
    k = repeat(l2norm(k))
    qc, kc, vc, gc, bc = (_to_chunks(x, num_rows) for x in (q, k, v, g, beta))
    cum, gamma = chunk_decays(gc)  # [R, NC, HV, C], [R, NC, HV, C, C]
    lower = jnp.tril(jnp.ones((CHUNK, CHUNK), bool))
    # WY/UT: U = (I + A)^-1 beta V, W = (I + A)^-1 beta e^G K, A = StrictLower(beta K K^T . Gamma).
    kk = jnp.einsum("rnhik,rnhjk->rnhij", kc, kc)
    a = jnp.where(jnp.tril(lower, -1), bc[..., :, None] * kk * gamma, 0.0) + jnp.eye(CHUNK)
    rhs = jnp.concatenate([bc[..., None] * vc, (bc * jnp.exp(cum))[..., None] * kc], axis=-1)
    solved = jax.scipy.linalg.solve_triangular(a, rhs, lower=True, unit_diagonal=True)
    u, w = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]
    qk = jnp.einsum("rnhik,rnhjk->rnhij", qc, kc) * gamma
    last = cum[..., -1]
    k_to_end = kc * jnp.exp(last[..., None] - cum)[..., None]
    q_decayed = qc * jnp.exp(cum)[..., None]

    def step(state, xs):  # state [R, HV, K, V]
        u_n, w_n, qd_n, qk_n, kd_n, last_n = xs
        v_new = u_n - jnp.einsum("rhck,rhkv->rhcv", w_n, state)
        o = jnp.einsum("rhck,rhkv->rhcv", qd_n, state) + jnp.einsum("rhij,rhjv->rhiv", qk_n, v_new)
        state = jnp.exp(last_n)[..., None, None] * state + jnp.einsum("rhck,rhcv->rhkv", kd_n, v_new)
        return state, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (u, w, q_decayed, qk, k_to_end, last))
    _, o = jax.lax.scan(step, jnp.zeros((num_rows, *state_pool.shape[1:]), jnp.float32), xs)
    o = jnp.moveaxis(o, (0, 3), (1, 2)).reshape(v.shape)  # [NC, R, HV, C, V] -> [R, NC, C, HV, V] -> [T, HV, V]
    return o.astype(v.dtype), state_pool


TRAINING_OPS = ModelOps(attention=causal_attention, gdn_prefill=chunked_delta_rule)
