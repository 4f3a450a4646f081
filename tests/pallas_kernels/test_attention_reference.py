"""Reference ragged paged attention vs dense NumPy softmax attention over permuted block tables."""

import functools

import jax
import numpy as np
import pytest
from attention_cases import BS, DH, HKV, MB, NUM_ROWS, NUM_TOKENS, SCALE, TOL, make_case
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import cu_seqlens

from pallas_kernels.attention import ragged_paged_attention, reference


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
    args, dense = make_case(row_specs, seed)
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
@given(row_specs=rows(), seed=st.integers(0, 2**16))
def test_one_tile_per_block(row_specs, seed):
    """Blocks of one tile and spans of two KV blocks: each block loops over the spans its own row reaches."""
    args, dense = make_case(row_specs, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "BLOCK_QUERIES", 1)
        patch.setattr(reference, "KEY_SPAN_BLOCKS", 2)
        o, _, _ = jax.jit(functools.partial(reference.ragged_paged_attention.__wrapped__, scale=SCALE))(**args)
    cu = args["cu_seqlens"]
    for r, (keys, values) in enumerate(dense):
        TOL.check(o[cu[r] : cu[r + 1]], _dense_attention(args["q"][cu[r] : cu[r + 1]], keys, values, len(keys)))
    np.testing.assert_array_equal(o[cu[-1] :], 0)


@settings(max_examples=5, deadline=None)
@given(qlen=st.integers(2, 8), ctx=st.integers(8, MB * BS), data=st.data())
def test_split_row_equals_one_call(qlen, ctx, data):
    split = data.draw(st.integers(1, qlen - 1))
    args, _ = make_case([(qlen, ctx)], data.draw(st.integers(0, 2**16)))
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
