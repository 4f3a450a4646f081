"""CostEstimate of the ragged paged attention kernel, from the shapes of its operands (`pl.CostEstimate`).

Shapes fix the bucket, not the rows' lengths, so the estimate takes every row to end the step at the block
table's full span L = MB x BS keys with T / R new tokens (a decode row at the longest context the table
holds; a one-row prefill of L tokens from scratch), and counts the causal (query, key) pairs that gives:
n (L - n) + n (n + 1) / 2 a row for n new tokens. A pair is a score and a P.V term, 4 Dh FLOPs a query
head, and one exp. Bytes: q in, o out (or the f32 split partials), every row's L keys and values once, the
block table.
"""

from jax.experimental import pallas as pl

from pallas_kernels.estimates import cost, nbytes, rows_bytes


def causal_pairs(num_rows: int, new_tokens: int, total: int) -> int:
    """(query, key) pairs of `num_rows` rows of `new_tokens` queries each at the end of `total` keys."""
    return num_rows * (new_tokens * (total - new_tokens) + new_tokens * (new_tokens + 1) // 2)


def attention(q, k_pool, block_table, num_splits: int) -> pl.CostEstimate:
    """`_attention_kernel` over q [T, HQ, Dh], pools [NB, BS, HKV, Dh] and block_table [R, MB]."""
    tokens, heads, head_dim = q.shape
    num_rows, max_blocks = block_table.shape
    total, new_tokens = max_blocks * k_pool.shape[1], -(-tokens // num_rows)
    pairs = causal_pairs(num_rows, min(new_tokens, total), total)
    written = nbytes(q) if num_splits == 1 else num_splits * tokens * heads * (head_dim + 2) * 4
    keys_values = 2 * num_rows * total * rows_bytes(k_pool, 1) // k_pool.shape[1]
    return cost(4 * pairs * heads * head_dim, pairs * heads, nbytes(q, block_table) + written + keys_values)
