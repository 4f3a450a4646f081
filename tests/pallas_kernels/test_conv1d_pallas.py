"""Conv1d Pallas kernel: interpret mode against the reference, and CUDA lowering at model shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conv1d_cases import KC, R, S, T, make_inputs
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda
from varlen_inputs import row_lengths

from pallas_kernels.conv1d import conv1d_prefill, pallas
from tests.tolerances import Float32, assert_close, bfloat16_atol, float32_atol

BLOCK_T = 8  # rows of up to 32 tokens span several tiles
MAX_LEAD = 4  # padding tokens before the first row (the second phase of a grouped prefill)
TOL = Float32(depth=KC + 1)  # KC taps and the bias: one short sum per output
ON_GPU = jax.default_backend() == "gpu"


def _poison_stale_slots(inputs):
    """NaN in every slot whose contents no result may read: fresh rows' slots and slots no row runs in."""
    slots, pool = inputs["slots"], inputs["window_pool"]
    live = slots[inputs["has_initial"] & (slots > 0)]
    pool[np.setdiff1d(np.arange(1, S), live)] = np.nan


def _upcast(inputs):
    """The same values in f32: the reference sees exactly what the kernel reads."""
    return {k: v.astype(np.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in inputs.items()}


def _check_outputs(out, ref, dtype):
    (y, pool), (y_ref, pool_ref) = out, ref
    assert y.dtype == dtype and pool.dtype == dtype
    # windows are copies of inputs: exact, stale NaN left in place where no row writes
    np.testing.assert_array_equal(np.asarray(pool, np.float32), pool_ref)
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref)
    if dtype == np.float32:
        return TOL.check(y, y_ref)
    # Both sides see the same 16-bit values, so no input factor is rounded differently (degree 0); what
    # remains is the kernel's 16-bit output rounding (fp16 rounds finer than bf16, 2^-11 < 2^-8) on top
    # of two fp32 evaluation orders of KC taps and the bias.
    scale = np.abs(y_ref).max()
    assert_close(y, y_ref, bfloat16_atol(0, scale) + float32_atol(KC + 1, scale))


@settings(max_examples=8, deadline=None)
@given(
    lengths=row_lengths(BLOCK_T + KC - 1, T - MAX_LEAD, R),  # tile edges: rows of 0, 1, 10, 11, 12, 25
    lead=st.integers(0, MAX_LEAD),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float32, jnp.bfloat16, np.float16]),
)
@example(lengths=[2, 1, 25, 0], lead=0, seed=0, dtype=jnp.bfloat16)  # rows shorter than KC-1 and than a tile
def test_prefill_interpret_matches_reference(lengths, lead, seed, dtype):
    inputs = make_inputs(lengths, seed, dtype)
    inputs["cu_seqlens"] = inputs["cu_seqlens"] + lead
    _poison_stale_slots(inputs)
    ref = conv1d_prefill(**_upcast(inputs), backend="reference")
    out = pallas.conv1d_prefill(**inputs, block_t=BLOCK_T, interpret=True)
    _check_outputs(out, ref, dtype)


@pytest.mark.parametrize(
    ("dim", "dtype"),
    [(8192, jnp.bfloat16), (8192, jnp.float32), (10240, jnp.bfloat16)],  # Qwen3-Next GDN q|k|v, Nemotron-H x|B|C
)
def test_prefill_lowers_for_cuda(dim, dtype):
    sd, i32, num_tokens, num_rows = jax.ShapeDtypeStruct, jnp.int32, 4096, 64
    args = (sd((num_tokens, dim), dtype), sd((dim, KC), jnp.float32), sd((dim,), jnp.float32), sd((num_rows + 1,), i32))
    pool, per_row = sd((num_rows + 1, KC - 1, dim), dtype), sd((num_rows,), i32)
    prefill = functools.partial(pallas.conv1d_prefill, interpret=False)
    assert TRITON_CALL in lower_for_cuda(prefill, *args, pool, per_row, sd((num_rows,), jnp.bool_), per_row, per_row)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_compiled_kernels_match_reference(dtype):
    inputs = make_inputs([2, 1, 25, 3], seed=0, dtype=dtype)
    _poison_stale_slots(inputs)
    ref = conv1d_prefill(**_upcast(inputs), backend="reference")
    _check_outputs(pallas.conv1d_prefill(**inputs, block_t=BLOCK_T), ref, dtype)
