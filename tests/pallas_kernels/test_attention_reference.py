"""Reference ragged paged attention vs dense NumPy softmax attention over permuted block tables."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import cu_seqlens

from pallas_kernels.attention import ragged_paged_attention
from tests.tolerances import Float32

HQ, HKV, DH, BS, NB, MB = 4, 2, 16, 4, 40, 8
NUM_TOKENS, NUM_ROWS = 24, 4
SCALE = DH**-0.5
TOL = Float32(depth=2 * DH + MB * BS)  # q.k over DH, softmax and p.v over the whole context


@st.composite
def rows(draw):
    """(query_len, context_len) per row; context_len >= query_len, all inside the bucket."""
    out = []
    for _ in range(draw(st.integers(1, NUM_ROWS))):
        qlen = draw(st.integers(0, 8))
        out.append((qlen, draw(st.integers(qlen, MB * BS))))
    while sum(q for q, _ in out) > NUM_TOKENS:
        out.pop()
    return out


def _make_case(row_specs, seed, num_q_heads=HQ, num_kv_heads=HKV):
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


def _dense_attention(q, keys, values, ctx):
    out = np.zeros_like(q)
    group = q.shape[1] // keys.shape[1]
    for i in range(len(q)):
        pos = ctx - len(q) + i
        for h in range(q.shape[1]):
            s = keys[: pos + 1, h // group] @ q[i, h] * SCALE
            p = np.exp(s - s.max())
            out[i, h] = p @ values[: pos + 1, h // group] / p.sum()
    return out


@settings(max_examples=10, deadline=None)
@given(row_specs=rows(), seed=st.integers(0, 2**16))
def test_matches_dense_attention(row_specs, seed):
    args, dense = _make_case(row_specs, seed)
    o, k_pool, v_pool = ragged_paged_attention(**args, scale=SCALE)
    cu = args["cu_seqlens"]
    for r, (keys, values) in enumerate(dense):
        q = args["q"][cu[r] : cu[r + 1]]
        TOL.check(o[cu[r] : cu[r + 1]], _dense_attention(q, keys, values, len(keys)))
    real = args["slot_mapping"][: cu[-1]]
    np.testing.assert_array_equal(np.asarray(k_pool).reshape(-1, HKV, DH)[real], args["k"][: cu[-1]])
    np.testing.assert_array_equal(np.asarray(v_pool).reshape(-1, HKV, DH)[real], args["v"][: cu[-1]])
    assert np.isfinite(o).all()


@settings(max_examples=5, deadline=None)
@given(qlen=st.integers(2, 8), ctx=st.integers(8, MB * BS), data=st.data())
def test_split_row_equals_one_call(qlen, ctx, data):
    split = data.draw(st.integers(1, qlen - 1))
    args, _ = _make_case([(qlen, ctx)], data.draw(st.integers(0, 2**16)))
    o, _, _ = ragged_paged_attention(**args, scale=SCALE)
    first = _slice_call(args, 0, split, ctx - qlen)
    o1, k_pool, v_pool = ragged_paged_attention(**first, scale=SCALE)
    second = _slice_call(dict(args, k_pool=k_pool, v_pool=v_pool), split, qlen, ctx - qlen + split)
    o2, _, _ = ragged_paged_attention(**second, scale=SCALE)
    TOL.check(np.concatenate([o1[:split], o2[: qlen - split]]), o[:qlen])


def _slice_call(args, start, stop, context_len):
    """Single-row call over the row's new tokens [start, stop), with `context_len` cached before it."""
    call = dict(args, cu_seqlens=cu_seqlens([stop - start], NUM_ROWS))
    call["context_lens"] = np.array([context_len] + [0] * (NUM_ROWS - 1), np.int32)
    for name in ("q", "k", "v", "slot_mapping"):
        x = np.zeros_like(args[name])
        x[: stop - start] = args[name][start:stop]
        call[name] = x
    return call
