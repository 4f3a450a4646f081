"""Reference Mamba2 SSD: chunked == recurrent, packing == per-row calls, split rows carry state."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import (
    check_a_row_across_chunk_blocks,
    check_chunked_matches_recurrent,
    check_packed_equals_per_row_calls,
    check_split_row_carries_state,
    cu_seqlens,
    row_lengths,
)

from pallas_kernels.mamba2 import ssd_chunked, ssd_recurrent
from tests.tolerances import Float32

NH, P, G, N = 4, 8, 2, 16
TOL = Float32(depth=96 + N + 64)  # a row of up to 96 tokens, N state terms, a chunk's sums
_RNG = np.random.default_rng(0)
A = -np.exp(_RNG.uniform(-1, 1, NH)).astype(np.float32)
D = _RNG.standard_normal(NH).astype(np.float32)


def _make_inputs(num_tokens, num_rows, seed):
    rng = np.random.default_rng(seed)
    tokens = dict(
        x=rng.standard_normal((num_tokens, NH, P), np.float32),
        dt=rng.uniform(0.001, 1.0, (num_tokens, NH)).astype(np.float32),
        B=rng.standard_normal((num_tokens, G, N), np.float32),
        C=rng.standard_normal((num_tokens, G, N), np.float32),
    )
    return tokens, rng.standard_normal((num_rows, NH, P, N), np.float32)


def _recurrent(x, dt, B, C, cu, state):
    return ssd_recurrent(x, dt, A, B, C, D, cu, state)


def _chunked(x, dt, B, C, cu, state, chunk_size=16):
    return ssd_chunked(x, dt, A, B, C, D, cu, state, chunk_size=chunk_size)


@settings(max_examples=8, deadline=None)
@given(lengths=row_lengths(16, 96, 5), seed=st.integers(0, 2**16))
def test_chunked_matches_recurrent(lengths, seed):
    tokens, state = _make_inputs(96, 5, seed)
    check_chunked_matches_recurrent(_recurrent, _chunked, list(tokens.values()), state, cu_seqlens(lengths, 5), TOL)


def test_chunk128_edge_lengths():
    lengths = [0, 1, 127, 128, 129, 259]
    tokens, state = _make_inputs(768, 7, seed=1)
    cu = cu_seqlens(lengths, 7)
    y_ref, final_ref = _recurrent(*tokens.values(), cu, state)
    y, final = _chunked(*tokens.values(), cu, state, chunk_size=128)
    TOL.check(y, y_ref)
    TOL.check(final, final_ref)
    np.testing.assert_array_equal(np.asarray(final)[[0, 6]], state[[0, 6]])  # empty rows keep their state


def test_a_row_across_blocks_of_chunks_in_a_mostly_empty_bucket():
    check_a_row_across_chunk_blocks(_recurrent, _chunked, _make_inputs, N)


@settings(max_examples=5, deadline=None)
@given(lengths=row_lengths(16, 96, 5), seed=st.integers(0, 2**16))
def test_packed_equals_per_row_calls(lengths, seed):
    tokens, state = _make_inputs(96, 5, seed)
    fns = (_recurrent, _chunked)
    check_packed_equals_per_row_calls(fns, list(tokens.values()), state, cu_seqlens(lengths, 5), 96, TOL)


@settings(max_examples=5, deadline=None)
@given(length=st.integers(2, 96), data=st.data())
def test_split_row_carries_state(length, data):
    split = data.draw(st.integers(1, length - 1))
    tokens, state = _make_inputs(96, 1, length)
    fns = (_recurrent, _chunked)
    check_split_row_carries_state(fns, list(tokens.values()), state, length, split, 96, TOL)


def test_groups_match_numpy_loop():
    tokens, state = _make_inputs(8, 1, seed=3)
    y, final = _recurrent(*tokens.values(), np.array([0, 8], np.int32), state)
    h = state[0].astype(np.float64)
    for t in range(8):
        for head in range(NH):
            b, c = tokens["B"][t, head // (NH // G)], tokens["C"][t, head // (NH // G)]
            dt, x = tokens["dt"][t, head], tokens["x"][t, head]
            h[head] = np.exp(dt * A[head]) * h[head] + dt * np.outer(x, b)
            TOL.check(y[t, head], h[head] @ c + D[head] * x)
    TOL.check(final[0], h)
