"""Pallas ragged paged attention: interpret mode against the reference, CUDA lowering, and the GPU run."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from test_attention_reference import SCALE, TOL, _make_case, rows

from pallas_kernels.attention import pallas, ragged_paged_attention, reference
from tests.tolerances import BFloat16

ON_GPU = jax.default_backend() == "gpu"


def _compare(args, dtype, tolerance, interpret):
    args = {k: (jnp.asarray(a, dtype) if a.dtype == np.float32 else a) for k, a in args.items()}
    expected, k_ref, v_ref = reference.ragged_paged_attention(**args, scale=SCALE)
    out, k_pool, v_pool = ragged_paged_attention(**args, scale=SCALE, backend="interpret" if interpret else "pallas")
    np.testing.assert_array_equal(np.asarray(k_pool), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_pool), np.asarray(v_ref))
    tolerance.check(out, expected)


@settings(max_examples=8, deadline=None)
@given(row_specs=rows(), seed=st.integers(0, 2**16), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_interpret_matches_reference(row_specs, seed, dtype):
    args, _ = _make_case(row_specs, seed)
    _compare(args, dtype, TOL if dtype == jnp.float32 else BFloat16(degree=3), interpret=True)


@pytest.mark.parametrize("block_size", [16, 32])
def test_lowers_for_cuda_at_model_shapes(block_size):
    """Qwen3-Next full attention: 16 query heads, 2 KV heads, head dim 256, bf16 pools."""
    tokens, rows_, blocks, max_blocks = 256, 8, 64, 16
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    args = [
        spec(tokens, 16, 256),
        spec(tokens, 2, 256),
        spec(tokens, 2, 256),
        spec(blocks, block_size, 2, 256),
        spec(blocks, block_size, 2, 256),
        spec(tokens, dtype=jnp.int32),
        spec(rows_, max_blocks, dtype=jnp.int32),
        spec(rows_ + 1, dtype=jnp.int32),
        spec(rows_, dtype=jnp.int32),
    ]
    text = lower_for_cuda(functools.partial(pallas.ragged_paged_attention, scale=256**-0.5), *args)
    assert TRITON_CALL in text


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@settings(max_examples=8, deadline=None)
@given(row_specs=rows(), seed=st.integers(0, 2**16))
def test_compiled_kernel_matches_reference_on_gpu(row_specs, seed):
    args, _ = _make_case(row_specs, seed)
    _compare(args, jnp.float32, 1e-4, interpret=False)
