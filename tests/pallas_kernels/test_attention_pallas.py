"""Pallas ragged paged attention: interpret mode against the reference, tiling choices, CUDA lowering, the GPU run."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import BS, MB, NUM_ROWS, NUM_TOKENS, SCALE, TOL, make_case
from hypothesis import given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda

from pallas_kernels.attention import pallas, ragged_paged_attention, reference
from pallas_kernels.varlen import max_num_chunks
from tests.tolerances import BFloat16

ON_GPU = jax.default_backend() == "gpu"
HQ = 8  # query heads; the KV head count sets the GQA group
# Only the p·V dot rounds an operand the f32 reference on the same bf16 values does not (the probabilities,
# one factor), and the output is stored in bf16: degree 1. Its error is relative to max|v|, not to the
# softmax average compared, which is about 2x smaller for N(0, 1) values over <= 32 keys: degree 2.
BF16_TOL = BFloat16(degree=2)
QUERY_LENS = {"prefill": (5, 12), "decode": (1, 1), "verify": (2, 4), "empty": (0, 0)}


@st.composite
def row_mix(draw):
    """(query_len, context_len) rows mixing prefill chunks, decode and verify rows, all inside the bucket.

    Contexts reach the whole block table (MB blocks), so a row spans every split or leaves some idle.
    """
    out = []
    for _ in range(draw(st.integers(1, NUM_ROWS))):
        low, high = QUERY_LENS[draw(st.sampled_from(sorted(QUERY_LENS)))]
        qlen = draw(st.integers(low, high))
        out.append((qlen, draw(st.integers(max(qlen, 1), MB * BS))))
    while sum(q for q, _ in out) > NUM_TOKENS:
        out.pop()
    return out


def _compare(args, dtype, tolerance, interpret, **tiling):
    """Kernel on `dtype` inputs vs the f32 reference on the same values upcast; pools written identically."""
    args = {k: (jnp.asarray(a, dtype) if a.dtype == np.float32 else a) for k, a in args.items()}
    upcast = {k: (a.astype(jnp.float32) if a.dtype == dtype else a) for k, a in args.items()}
    expected, k_ref, v_ref = reference.ragged_paged_attention(**upcast, scale=SCALE)
    backend = "interpret" if interpret else "pallas"
    out, k_pool, v_pool = ragged_paged_attention(**args, scale=SCALE, backend=backend, **tiling)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(k_pool, np.float32), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_pool, np.float32), np.asarray(v_ref))
    num_real = int(args["cu_seqlens"][-1])
    tolerance.check(out[:num_real], expected[:num_real])
    assert not np.asarray(out[num_real:], np.float32).any()  # padding tokens are zero


# Groups 1, 2 and 8 (Qwen3-Next), each split mode; 3 splits of <= 8 blocks leave short rows' splits idle.
@pytest.mark.parametrize(("num_kv_heads", "num_splits"), [(8, 3), (4, 1), (1, 1), (1, 3)])
@settings(max_examples=4, deadline=None)
@given(row_specs=row_mix(), seed=st.integers(0, 2**16))
def test_interpret_matches_reference(num_kv_heads, num_splits, row_specs, seed):
    args, _ = make_case(row_specs, seed, HQ, num_kv_heads)
    _compare(args, jnp.float32, TOL, interpret=True, block_m=16, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@settings(max_examples=3, deadline=None)
@given(row_specs=row_mix(), seed=st.integers(0, 2**16))
def test_interpret_half_precision_matches_f32_reference(dtype, row_specs, seed):
    """fp16 rounds finer than bf16 (2^-11), so the bf16 bound covers it."""
    args, _ = make_case(row_specs, seed, HQ, 1)
    _compare(args, dtype, BF16_TOL, interpret=True, block_m=16, num_splits=3)


def test_idle_splits_of_short_rows_add_nothing():
    """8 splits over rows of 1 to 3 blocks: most splits run no block and write max -inf; no NaN, same result."""
    args, _ = make_case([(1, 1), (2, 5), (4, 12), (3, 3)], seed=7, num_q_heads=HQ, num_kv_heads=4)
    _compare(args, jnp.float32, TOL, interpret=True, block_m=16, num_splits=8)


@pytest.mark.parametrize(
    ("group", "block_m", "tokens", "group_pad"),
    [(8, 16, 2, 8), (1, 16, 16, 1), (2, 64, 32, 2), (3, 16, 4, 4), (32, 16, 1, 32)],
)
def test_tile_packs_whole_gqa_groups(group, block_m, tokens, group_pad):
    """A decode row fills `group` of the tile's dot rows (8 of 16 for Qwen3-Next), not 1 of 16."""
    assert pallas.tile_shape(group, block_m) == (tokens, group_pad)


def test_splits_only_where_the_grid_is_small_and_contexts_long():
    decode_tiles = max_num_chunks(64, 64, 2)  # 64 decode rows, group 8 at block_m 16
    assert pallas.default_num_splits(decode_tiles, 2, 8192) > 1
    assert pallas.default_num_splits(max_num_chunks(2048, 8, 8), 2, 32768) == 1  # a prefill bucket
    assert pallas.default_num_splits(decode_tiles, 2, 256) == 1  # short contexts
    assert pallas.default_block_m(64, 64, jnp.bfloat16) < pallas.default_block_m(2048, 8, jnp.bfloat16)


def test_f32_prefill_takes_the_small_tile_that_does_not_spill():
    """f32 dots are FMA loops: M 64 at head dim 256 spilled on sm_90 (benchmarks/aot_kernels.py), M 16 did not."""
    assert pallas.default_block_m(2048, 8, jnp.float32) == pallas.MIN_BLOCK_M


def _model_shapes(phase, dtype):
    """Qwen3-Next full attention: 16 query heads, 2 KV heads, head dim 256, 16-token blocks."""
    tokens, rows, max_blocks = {"prefill": (256, 8, 16), "decode_8k": (8, 8, 8192 // 16)}[phase]
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype)
    pools = [spec(64, 16, 2, 256)] * 2
    metadata = [spec(tokens), spec(rows, max_blocks), spec(rows + 1), spec(rows)]
    return [spec(tokens, 16, 256), spec(tokens, 2, 256), spec(tokens, 2, 256), *pools] + [
        jax.ShapeDtypeStruct(m.shape, jnp.int32) for m in metadata
    ]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(("phase", "split"), [("prefill", False), ("decode_8k", True)])
def test_lowers_for_cuda_at_model_shapes(phase, split, dtype):
    """The Triton call appears; decode at 8k context takes the split-KV path by default, prefill does not."""
    attention = functools.partial(pallas.ragged_paged_attention, scale=256**-0.5)
    text = lower_for_cuda(attention, *_model_shapes(phase, dtype))
    assert TRITON_CALL in text
    num_splits = int(re.search(r"num_splits_(\d+)", text).group(1))
    assert (num_splits > 1) == split


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 3])
@settings(max_examples=8, deadline=None)
@given(row_specs=row_mix(), seed=st.integers(0, 2**16))
def test_compiled_kernel_matches_reference_on_gpu(num_splits, row_specs, seed):
    args, _ = make_case(row_specs, seed, HQ, 1)
    _compare(args, jnp.float32, TOL, interpret=False, block_m=16, num_splits=num_splits)
    _compare(args, jnp.bfloat16, BF16_TOL, interpret=False, block_m=16, num_splits=num_splits)
