"""Ragged paged attention cases: rows with cached prefixes in a permuted paged pool (reference and Pallas tests)."""

import numpy as np
from varlen_inputs import cu_seqlens

from tests.tolerances import Float32

HQ, HKV, DH, BS, NB, MB = 4, 2, 16, 4, 40, 8
NUM_TOKENS, NUM_ROWS = 24, 4
SCALE = DH**-0.5
TOL = Float32(depth=2 * DH + MB * BS)  # q.k over DH, softmax and p.v over the whole context


def make_case(row_specs, seed, num_q_heads=HQ, num_kv_heads=HKV):
    """Random full per-row K/V; the cached prefix goes into the pool, the last qlen tokens are new."""
    rng = np.random.default_rng(seed)
    k_pool = rng.standard_normal((NB, BS, num_kv_heads, DH), np.float32)
    v_pool = rng.standard_normal((NB, BS, num_kv_heads, DH), np.float32)
    free = list(rng.permutation(np.arange(1, NB)))  # block 0 is the null block
    tables = np.zeros((NUM_ROWS, MB), np.int32)
    dense, q, k, v, slots = [], [], [], [], []
    for r, (qlen, ctx) in enumerate(row_specs):
        keys, values = rng.standard_normal((2, ctx, num_kv_heads, DH), np.float32)
        tables[r, : -(-ctx // BS)] = [free.pop() for _ in range(-(-ctx // BS))]
        pos = np.arange(ctx)
        flat = tables[r, pos // BS] * BS + pos % BS
        k_pool.reshape(-1, num_kv_heads, DH)[flat[: ctx - qlen]] = keys[: ctx - qlen]
        v_pool.reshape(-1, num_kv_heads, DH)[flat[: ctx - qlen]] = values[: ctx - qlen]
        q.append(rng.standard_normal((qlen, num_q_heads, DH), np.float32))
        k.append(keys[ctx - qlen :])
        v.append(values[ctx - qlen :])
        slots.append(flat[ctx - qlen :])
        dense.append((keys, values))
    pad = NUM_TOKENS - sum(len(x) for x in q)
    packed = [np.concatenate(x + [np.zeros((pad,) + x[0].shape[1:], x[0].dtype)]) for x in (q, k, v, slots)]
    context = np.array([c - q_ for q_, c in row_specs] + [0] * (NUM_ROWS - len(row_specs)), np.int32)  # before
    args = dict(
        q=packed[0],
        k=packed[1],
        v=packed[2],
        k_pool=k_pool,
        v_pool=v_pool,
        slot_mapping=packed[3].astype(np.int32),
        block_table=tables,
        cu_seqlens=cu_seqlens([q_ for q_, _ in row_specs], NUM_ROWS),
        context_lens=context,
    )
    return args, dense
