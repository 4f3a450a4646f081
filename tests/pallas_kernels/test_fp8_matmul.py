"""FP8 weight matmul: the Pallas kernel in interpret mode against the references, its CostEstimate, and its CUDA
lowering at Qwen3-Next-80B's projection shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lowering import TRITON_CALL, lower_for_cuda

from pallas_kernels.cost import kernel_cost
from pallas_kernels.fp8_matmul import fp8_matmul, pallas, reference
from tests.tolerances import assert_close, bfloat16_atol, float32_atol

FP8 = jnp.float8_e4m3fn
TILE = 16  # block_m and block_n: 40 rows or columns span three tiles, the last one partial


def make_case(num_rows: int, in_features: int, block: int, out_features: int, seed: int, dtype):
    """x [M, in] in `dtype`, an FP8 kernel [blocks, block, out] (rows past `in` zero) and f32 scales [blocks, out]
    that are not powers of two, so scaling rounds."""
    rng = np.random.default_rng(seed)
    blocks = -(-in_features // block)
    weight = rng.standard_normal((blocks * block, out_features)).astype(np.float32)
    weight[in_features:] = 0
    kernel = jnp.asarray(weight.reshape(blocks, block, out_features), FP8)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (blocks, out_features)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((num_rows, in_features)), dtype)
    return x, kernel, scale


def _depth(kernel, block_k: int) -> int:
    """Roundings along one output: a sum over every weight row, and a scaling and an accumulation per K step."""
    blocks, block, _ = kernel.shape
    return blocks * block + 2 * blocks * -(-block // block_k)


def check_against_scaled(out, x, kernel, scale, block_k: int) -> None:
    """The kernel against `matmul_scaled` on the same inputs. Both read the same x and the same FP8 values, cast
    exactly; their products are exact in f32 (8- and 4-bit significands), so only the f32 evaluation orders
    differ, plus, for 16-bit x, the kernel's one rounding of each output to x's dtype (2^-8 relative for bf16)."""
    expected = np.asarray(reference.matmul_scaled(x.astype(jnp.float32), kernel, scale))
    scale_of_values = np.abs(expected).max(initial=0.0)
    atol = float32_atol(_depth(kernel, block_k), scale_of_values)
    if x.dtype != jnp.float32:
        atol += bfloat16_atol(0, scale_of_values)
    assert out.dtype == x.dtype and out.shape == expected.shape
    assert_close(np.asarray(out, np.float32), expected, atol, "kernel vs matmul_scaled")


@st.composite
def layouts(draw):
    """(in, block): 1-3 row blocks of 16 or 32 with a partial last one, or one per-tensor block of all rows."""
    if draw(st.booleans()):
        in_features = draw(st.integers(17, 80))  # mostly not a power of two: masked sub-blocks
        return in_features, in_features
    block, blocks = draw(st.sampled_from([16, 32])), draw(st.integers(1, 3))
    return draw(st.integers((blocks - 1) * block + 1, blocks * block)), block


@settings(max_examples=4, deadline=None)
@given(
    num_rows=st.integers(1, 40),
    layout=layouts(),
    out_features=st.integers(1, 40),
    block_k=st.sampled_from([16, 32]),
    num_splits=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float32, jnp.bfloat16]),
)
@example(num_rows=1, layout=(100, 100), out_features=24, block_k=32, num_splits=2, seed=0, dtype=jnp.bfloat16)
@example(num_rows=33, layout=(40, 16), out_features=33, block_k=16, num_splits=1, seed=1, dtype=np.float32)
def test_interpret_matches_matmul_scaled(num_rows, layout, out_features, block_k, num_splits, seed, dtype):
    in_features, block = layout
    x, kernel, scale = make_case(num_rows, in_features, block, out_features, seed, dtype)
    out = pallas.fp8_matmul(x, kernel, scale, block_m=TILE, block_n=TILE, block_k=block_k, num_splits=num_splits,
                            interpret=True)
    check_against_scaled(out, x, kernel, scale, block_k)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_public_op_flattens_leading_dims_and_matches_the_dequantized_reference(dtype):
    """backend="interpret" on x [2, 3, in] against backend="reference" (`matmul_dequantized`, which rounds the
    dequantized weight to x's dtype): each product differs by at most that rounding of its weight (2^-8 relative
    in bf16, one f32 ulp in f32), each output by both sides' roundings to x's dtype and the f32 sums' orders, all
    bounded by sum |x| |w|."""
    x, kernel, scale = make_case(6, 200, 128, 48, seed=3, dtype=dtype)  # a partial second block of 72 rows
    x = x.reshape(2, 3, 200)
    out = fp8_matmul(x, kernel, scale, backend="interpret")
    expected = fp8_matmul(x, kernel, scale, backend="reference")
    np.testing.assert_array_equal(np.asarray(expected), np.asarray(reference.matmul_dequantized(x, kernel, scale)))
    weight = reference.dequantize(kernel, scale, 200, jnp.float32)
    bound = np.abs(np.asarray(x, np.float32)) @ np.abs(np.asarray(weight))
    scale_of_terms = bound.max()
    atol = float32_atol(_depth(kernel, pallas.default_tiles(dtype)[1]) + 1, scale_of_terms)
    if dtype != np.float32:
        atol += bfloat16_atol(2, scale_of_terms)  # the weight's rounding and each side's output rounding
    assert out.shape == expected.shape == (2, 3, 48) and out.dtype == dtype
    assert_close(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol, "interpret vs reference")


def test_default_splits_only_where_m_is_small():
    # Qwen3-Next's 2048 -> 4096 projection: a decode row fills 32 programs, so K splits; prefill does not
    assert pallas.default_num_splits(1, programs=32, in_rows=2048) == 4
    assert pallas.default_num_splits(256, programs=4 * 32, in_rows=2048) == 1
    assert pallas.default_num_splits(1, programs=32, in_rows=256) == 1  # too few rows to split


def test_cost_counts_the_padded_rows_scaling_and_bytes_once():
    spec = jax.ShapeDtypeStruct
    x, kernel, scale = spec((3, 20), jnp.bfloat16), spec((2, 16, 8), FP8), spec((2, 8), jnp.float32)
    got = kernel_cost(jax.make_jaxpr(functools.partial(pallas.fp8_matmul, num_splits=1, interpret=True))(
        x, kernel, scale))
    assert got.kernels == 1
    assert got.flops == 2 * 3 * 2 * (16 + 1) * 8
    assert got.bytes_accessed == 3 * 20 * 2 + 2 * 16 * 8 + 2 * 8 * 4 + 3 * 8 * 2
    split = kernel_cost(jax.make_jaxpr(functools.partial(pallas.fp8_matmul, num_splits=2, interpret=True))(
        x, kernel, scale))
    assert split.bytes_accessed == got.bytes_accessed - 3 * 8 * 2 + 2 * 3 * 8 * 4  # two f32 partials


@pytest.mark.parametrize(
    ("num_rows", "in_features", "out_features", "block"),
    [
        (1, 2048, 4096, 128),  # hidden 2048 -> a 4096-wide projection, one decode row (K splits)
        (256, 2048, 4096, 128),
        (1, 2048, 512, 128),  # the shared expert's 512-wide projections
        (256, 512, 2048, 128),
        (256, 2880, 500, 2880),  # a per-tensor block of all rows, neither a power of two
    ],
)
def test_lowers_for_cuda(num_rows, in_features, out_features, block):
    blocks, spec = -(-in_features // block), jax.ShapeDtypeStruct
    text = lower_for_cuda(functools.partial(fp8_matmul, backend="pallas"), spec((num_rows, in_features), jnp.bfloat16),
                          spec((blocks, block, out_features), FP8), spec((blocks, out_features), jnp.float32))
    assert TRITON_CALL in text and "fp8_matmul_block_m" in text
