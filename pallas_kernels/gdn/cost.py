"""CostEstimates of the GDN kernels, from the shapes of their operands (`pl.CostEstimate`).

FLOPs count the K x V work per value head (the [K, V] state or the [C, C] chunk tiles), as the algorithm
does it: a token step is decay (KV), the read k^T S (2KV), the rank-1 update (2KV) and the read-out q^T S
(2KV), 7 KV; folding a ring entry is decay and rank-1 update, 3 KV. Prefill counts FLA's chunked algorithm
(dense C x C tiles, 2 FLOPs a multiply-add), 2 (3 C K + 2 C V + 3 K V) per token and value head over its
three calls. Transcendentals: each exp and each l2norm rsqrt, once per token and value head (tiles that
recompute one are not counted again). Bytes: each operand and output once, and only the pool slots a call
touches; per bucket, as if every token and row were real.
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.estimates import cost, folded_entries, nbytes, rows_bytes

_F32 = 4


def _entry_bytes(ring_k, ring_u, ring_g) -> int:
    """Bytes of one ring entry of one slot: k^ [H, K], u [HV, V], g [HV]."""
    return sum(rows_bytes(ring, 1) // ring.shape[2] for ring in (ring_k, ring_u, ring_g))


def _state_flops(state_pool) -> int:
    """K x V of every value head: the unit each token step and ring entry costs a multiple of."""
    return state_pool.shape[1] * state_pool.shape[2] * state_pool.shape[3]


def replay(q, k, v, g, beta, state_pool, ring_k, ring_u, ring_g, num_rows: int, *,
           write_final: bool) -> pl.CostEstimate:
    """`_gdn_replay_kernel` (verify; decode with `write_final`): each row folds `folded_entries` ring entries,
    then steps its tokens; outputs o and delta [T, HV, V] f32."""
    tokens, heads = v.shape[:2]
    folded = num_rows * folded_entries(ring_g.shape[2], tokens, num_rows)
    unit = _state_flops(state_pool)
    moved = (nbytes(q, k, v, g, beta) + 2 * tokens * heads * v.shape[2] * _F32
             + folded * _entry_bytes(ring_k, ring_u, ring_g) + (1 + write_final) * rows_bytes(state_pool, num_rows))
    return cost(7 * tokens * unit + 3 * folded * unit, (tokens + folded) * heads, moved)


def snapshots(q, k, v, g, beta, snapshots_pool, state_pool, num_rows: int) -> pl.CostEstimate:
    """`_gdn_snapshot_kernel`: each row reads its live state whole and stores the state after every token."""
    tokens, heads = v.shape[:2]
    state = rows_bytes(state_pool, 1)
    moved = nbytes(q, k, v, g, beta) + tokens * heads * v.shape[2] * _F32 + (num_rows + tokens) * state
    return cost(7 * tokens * _state_flops(state_pool), tokens * heads, moved)


def materialize(ring_k, ring_u, ring_g, state_pool, num_entries: int) -> pl.CostEstimate:
    """`_gdn_materialize_kernel`: each entry folds half its ring (E // 2) into a copy of its src state."""
    folded = num_entries * (ring_g.shape[2] // 2)
    moved = 2 * rows_bytes(state_pool, num_entries) + folded * _entry_bytes(ring_k, ring_u, ring_g)
    return cost(3 * folded * _state_flops(state_pool), folded * state_pool.shape[1], moved)


def intra_chunk(k, v, g, beta, out_dtype, chunk_size: int) -> pl.CostEstimate:
    """Call 1: A = beta K K^T . Gamma, then w = A^-1 (beta e^G k) and u = A^-1 (beta v), 2 C (2 K + V) a token
    and value head; exps: Gamma's C and e^G's one, and k's rsqrt."""
    (tokens, heads, head_v), head_k = v.shape, k.shape[2]
    written = tokens * heads * (head_k + head_v) * jnp.dtype(out_dtype).itemsize
    return cost(tokens * heads * 2 * chunk_size * (2 * head_k + head_v), tokens * heads * (chunk_size + 2),
                nbytes(k, v, g, beta) + written)


def state_pass(k, w, u, g, state_pool, h_dtype, num_rows: int, num_chunks: int) -> pl.CostEstimate:
    """Call 2: v_new = u - w h and the state update k^T v_new, 4 K V a token and value head; stores each
    chunk's start state h [NC, HV, K, V] and v_new."""
    tokens, (heads, head_k, head_v) = u.shape[0], state_pool.shape[1:]
    moved = (nbytes(k, w, u, g) + nbytes(u) + 2 * rows_bytes(state_pool, num_rows)
             + num_chunks * heads * head_k * head_v * jnp.dtype(h_dtype).itemsize)
    return cost(4 * tokens * _state_flops(state_pool), tokens * heads * 2 + num_chunks * heads, moved)


def output(q, k, g, h, v_new, out_dtype, chunk_size: int) -> pl.CostEstimate:
    """Call 3: o = (q e^G) h + (q k^T . Gamma) v_new, 2 C (K + V) + 2 K V a token and value head; exps: Gamma's
    C and e^G's one, and q's and k's rsqrt."""
    (tokens, heads, head_v), head_k = v_new.shape, q.shape[2]
    flops = tokens * heads * (2 * chunk_size * (head_k + head_v) + 2 * head_k * head_v)
    written = tokens * heads * head_v * jnp.dtype(out_dtype).itemsize
    return cost(flops, tokens * heads * (chunk_size + 3), nbytes(q, k, g, h, v_new) + written)
