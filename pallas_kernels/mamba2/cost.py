"""CostEstimates of the Mamba2 SSD kernels, from the shapes of their operands (`pl.CostEstimate`).

FLOPs per head, as the algorithm does them on the [P, N] state: a token step is the decay (PN), dt x (P),
the rank-1 update (2PN), the read-out h C (2PN) and the D x skip (2P): 5 PN + 3 P; folding a ring entry is
3 PN + P. Prefill counts mamba_ssm's chunked scan over chunks of BT tokens (2 FLOPs a multiply-add): C B^T,
2 BT N a token and group; per token and head, the intra-chunk (CB . decay) x, 2 BT P, the read of the
chunk's start state and the state update, 4 P N. Transcendentals: each exp, once per token and head (the
chunk's [BT, BT] decay: BT a token). Bytes: each operand and output once, and only the pool slots a call
touches; per bucket, as if every token and row were real.
"""

from jax.experimental import pallas as pl

from pallas_kernels.estimates import cost, folded_entries, nbytes, rows_bytes

_F32 = 4


def _token_flops(state_pool) -> int:
    heads, head_dim, state_size = state_pool.shape[1:]
    return heads * (5 * head_dim * state_size + 3 * head_dim)


def _fold_flops(state_pool) -> int:
    heads, head_dim, state_size = state_pool.shape[1:]
    return heads * (3 * head_dim * state_size + head_dim)


def _entry_bytes(ring_x, ring_dt, ring_B) -> int:
    """Bytes of one ring entry of one slot: x [NH, P], dt [NH], B [G, N]."""
    return sum(rows_bytes(ring, 1) // ring.shape[2] for ring in (ring_x, ring_dt, ring_B))


def replay(x, dt, B, C, state_pool, ring_x, ring_dt, ring_B, num_rows: int, *, write_final: bool) -> pl.CostEstimate:
    """`_ssd_replay_kernel` (verify; decode with `write_final`): each row folds `folded_entries` ring entries,
    then steps its tokens; y [T, NH, P] in x's dtype."""
    tokens, heads = x.shape[:2]
    folded = num_rows * folded_entries(ring_dt.shape[2], tokens, num_rows)
    moved = (nbytes(x, dt, B, C) + nbytes(x) + folded * _entry_bytes(ring_x, ring_dt, ring_B)
             + (1 + write_final) * rows_bytes(state_pool, num_rows))
    flops = tokens * _token_flops(state_pool) + folded * _fold_flops(state_pool)
    return cost(flops, (tokens + folded) * heads, moved)


def snapshots(x, dt, B, C, snapshots_pool, state_pool, num_rows: int) -> pl.CostEstimate:
    """`_ssd_snapshot_kernel`: each row reads its live state whole and stores the state after every token."""
    tokens, heads = x.shape[:2]
    moved = nbytes(x, dt, B, C) + nbytes(x) + (num_rows + tokens) * rows_bytes(state_pool, 1)
    return cost(tokens * _token_flops(state_pool), tokens * heads, moved)


def materialize(ring_x, ring_dt, ring_B, state_pool, num_entries: int) -> pl.CostEstimate:
    """`_ssd_materialize_kernel`: each entry folds half its ring (E // 2) into a copy of its src state."""
    folded = num_entries * (ring_dt.shape[2] // 2)
    moved = 2 * rows_bytes(state_pool, num_entries) + folded * _entry_bytes(ring_x, ring_dt, ring_B)
    return cost(folded * _fold_flops(state_pool), folded * state_pool.shape[1], moved)


def chunk_cb(B, C, block_t: int) -> pl.CostEstimate:
    """`_chunk_cb_kernel`: C B^T [BT, BT] f32 of every chunk and group, T / BT chunks of the bucket."""
    tokens, groups, state_size = B.shape
    return cost(2 * tokens * groups * block_t * state_size, 0, nbytes(B, C) + tokens * groups * block_t * _F32)


def prefill(x, dt, B, C, state_pool, num_rows: int, block_t: int) -> pl.CostEstimate:
    """`_ssd_prefill_kernel`: per chunk and head, y = (CB . decay . dt) x + e^cum C h and the state after the
    chunk, 2 BT P + 4 P N a token and head; reads C B^T; exps: the decay's BT and two more a token."""
    tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    moved = (nbytes(x, dt, B, C) + nbytes(x) + tokens * groups * block_t * _F32
             + 2 * rows_bytes(state_pool, num_rows))
    flops = tokens * heads * (2 * block_t * head_dim + 4 * head_dim * state_size)
    return cost(flops, tokens * heads * (block_t + 2), moved)
