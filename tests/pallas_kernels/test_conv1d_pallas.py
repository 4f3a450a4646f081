"""Conv1d Pallas kernel: interpret mode against the reference, and CUDA lowering at model shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from varlen_inputs import prefill_rows, row_lengths

from pallas_kernels.conv1d import conv1d_prefill, pallas
from tests.tolerances import BFloat16, Float32

DIM, KC, S, T, R = 16, 4, 12, 32, 4
TOL = Float32(depth=KC + 1)  # KC taps and the bias: one short sum per output
ON_GPU = jax.default_backend() == "gpu"


def _make_inputs(lengths, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((S, KC - 1, DIM), np.float32)
    pool[0] = 0
    slot_ids = rng.permutation(np.arange(1, S))
    return dict(
        x=jnp.asarray(rng.standard_normal((T, DIM), np.float32), dtype),
        weight=rng.standard_normal((DIM, KC), np.float32),
        bias=rng.standard_normal(DIM).astype(np.float32),
        window_pool=pool,
        **prefill_rows(rng, lengths, R, slot_ids),
    )


def _assert_close(out, ref, tol):
    for x, x_ref in zip(out, ref, strict=True):
        tol.check(np.asarray(x, np.float32), np.asarray(x_ref, np.float32))


@settings(max_examples=6, deadline=None)
@given(lengths=row_lengths(KC, T, R), seed=st.integers(0, 2**16), bf16=st.booleans())
def test_prefill_interpret_matches_reference(lengths, seed, bf16):
    inputs = _make_inputs(lengths, seed, jnp.bfloat16 if bf16 else jnp.float32)
    exact = _make_inputs(lengths, seed)  # bf16 inputs are checked against the reference on fp32 values
    ref = conv1d_prefill(**dict(exact, window_pool=inputs["window_pool"].copy()), backend="reference")
    _assert_close(conv1d_prefill(**inputs, backend="interpret"), ref, BFloat16(degree=2) if bf16 else TOL)


@pytest.mark.parametrize("dim", [8192, 10240])  # Qwen3-Next GDN q|k|v, Nemotron-H Mamba2 x|B|C
def test_kernels_lower_for_cuda(dim):
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    args = (sd((256, dim), jnp.bfloat16), sd((dim, KC), jnp.bfloat16), sd((dim,), jnp.bfloat16), sd((17,), i32))
    pool, per_row = sd((33, KC - 1 + 4, dim), jnp.bfloat16), sd((16,), i32)
    prefill = functools.partial(pallas.conv1d_prefill, interpret=False)
    assert TRITON_CALL in lower_for_cuda(prefill, *args, pool, per_row, sd((16,), jnp.bool_), per_row, per_row)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_compiled_kernels_match_reference():
    inputs = _make_inputs([0, 1, 3, 17], seed=0)
    ref = conv1d_prefill(**dict(inputs, window_pool=inputs["window_pool"].copy()), backend="reference")
    _assert_close(conv1d_prefill(**inputs, backend="pallas"), ref, TOL)
