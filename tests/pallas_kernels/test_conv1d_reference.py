"""Reference causal conv1d: matches a direct NumPy convolution, packing == per-row calls, split rows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import check_packed_equals_per_row_calls, check_split_row_carries_state, cu_seqlens, row_lengths

from pallas_kernels.conv1d import causal_conv1d
from tests.tolerances import BFloat16, Float32

DIM, KC = 8, 4
TOL = Float32(depth=KC + 1)  # KC taps and the bias: one short sum per output
_RNG = np.random.default_rng(0)
WEIGHT = _RNG.standard_normal((DIM, KC)).astype(np.float32)
BIAS = _RNG.standard_normal(DIM).astype(np.float32)


def _make_inputs(num_tokens, num_rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_tokens, DIM), np.float32)
    return x, rng.standard_normal((num_rows, KC - 1, DIM), np.float32)


def _conv(x, cu, window):
    return causal_conv1d(x, WEIGHT, BIAS, cu, window)


def _numpy_conv(x, cu, window):
    ys, finals = [], []
    for r in range(len(cu) - 1):
        xx = np.concatenate([window[r], x[cu[r] : cu[r + 1]]]).astype(np.float64)
        n = cu[r + 1] - cu[r]
        y = np.array([(WEIGHT.T * xx[j : j + KC]).sum(0) + BIAS for j in range(n)]).reshape(n, DIM)
        ys.append(y / (1 + np.exp(-y)))
        finals.append(xx[-(KC - 1) :])
    return np.concatenate(ys), np.stack(finals)


@settings(max_examples=10, deadline=None)
@given(lengths=row_lengths(KC, 32, 6), seed=st.integers(0, 2**16))
def test_matches_numpy(lengths, seed):
    x, window = _make_inputs(32, 6, seed)
    cu = cu_seqlens(lengths, 6)
    y, final = _conv(x, cu, window)
    y_ref, final_ref = _numpy_conv(x, cu, window)
    TOL.check(y[: cu[-1]], y_ref)
    TOL.check(final, final_ref)
    assert np.isfinite(y).all()


@settings(max_examples=5, deadline=None)
@given(lengths=row_lengths(KC, 32, 6), seed=st.integers(0, 2**16))
def test_packed_equals_per_row_calls(lengths, seed):
    x, window = _make_inputs(32, 6, seed)
    check_packed_equals_per_row_calls([_conv], [x], window, cu_seqlens(lengths, 6), 32, TOL)


@settings(max_examples=5, deadline=None)
@given(length=st.integers(2, 32), data=st.data())
def test_split_row_carries_window(length, data):
    split = data.draw(st.integers(1, length - 1))
    x, window = _make_inputs(32, 1, length)
    check_split_row_carries_state([_conv], [x], window, length, split, 32, TOL)


def test_no_activation_no_bias_bf16():
    x, window = _make_inputs(8, 1, seed=5)
    cu = np.array([0, 5], np.int32)
    y, _ = causal_conv1d(x.astype("bfloat16"), WEIGHT, None, cu, window, activation=False)
    xx = np.concatenate([window[0], x.astype("bfloat16").astype(np.float32)[:5]])
    y_ref = np.stack([(WEIGHT.T * xx[j : j + KC]).sum(0) for j in range(5)])
    assert y.dtype == np.dtype("bfloat16")
    BFloat16(degree=2).check(y[:5], y_ref)  # x and the taps rounded
