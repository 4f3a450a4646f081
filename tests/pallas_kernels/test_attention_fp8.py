"""An fp8 KV cache (--kv-cache-dtype fp8): quantized writes, dequantized reads in the reference and the Pallas
kernel (interpret mode), and its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from attention_cases import SCALE, make_case
from lowering import TRITON_CALL, lower_for_cuda

from pallas_kernels.attention import pallas, ragged_paged_attention, reference
from tests.tolerances import BFloat16

FP8 = jnp.float8_e4m3fn
ROWS = [(5, 9), (1, 14), (3, 3)]  # a prefill chunk over a cached prefix, a decode row, a fresh verify-sized row


def _on_fp8_grid(args, scales=(1.0, 1.0)):
    """The case's K/V (pools and new tokens) rounded to values e4m3 holds exactly once divided by their scale."""
    out = dict(args)
    for names, scale in ((("k", "k_pool"), scales[0]), (("v", "v_pool"), scales[1])):
        for name in names:
            out[name] = (np.asarray(args[name]) / scale).astype(FP8).astype(np.float32) * scale
    return out


def _fp8_pools(args, scales=(1.0, 1.0)):
    return {**args, "k_pool": jnp.asarray(args["k_pool"] / scales[0], FP8),
            "v_pool": jnp.asarray(args["v_pool"] / scales[1], FP8)}


def test_quantize_saturates_at_e4m3s_largest_value_instead_of_nan():
    x = jnp.array([1000.0, -1000.0, 3.0, 448.0])
    np.testing.assert_array_equal(np.asarray(reference.quantize(x, FP8, 2.0), np.float32), [448, -448, 1.5, 224])
    assert reference.quantize(x, jnp.bfloat16).dtype == jnp.bfloat16


def test_fp8_pool_at_scale_one_is_exact_on_representable_values():
    """K/V that e4m3 holds exactly: the fp8 pool stores them exactly and attention reads the same numbers."""
    args, _ = make_case(ROWS, seed=3)
    args = _on_fp8_grid(args)
    expected, k_ref, v_ref = reference.ragged_paged_attention(**args, scale=SCALE)
    out, k_pool, v_pool = reference.ragged_paged_attention(**_fp8_pools(args), scale=SCALE)
    assert k_pool.dtype == v_pool.dtype == FP8
    np.testing.assert_array_equal(np.asarray(k_pool, np.float32), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_pool, np.float32), np.asarray(v_ref))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_scales_divide_writes_and_multiply_reads():
    """Power-of-two scales are exact: the fp8 pool holds K / k_scale, V / v_scale, and attention is unchanged."""
    scales = (2.0, 0.5)
    args, _ = make_case(ROWS, seed=4)
    args = _on_fp8_grid(args, scales)
    expected, k_ref, v_ref = reference.ragged_paged_attention(**args, scale=SCALE)
    out, k_pool, v_pool = reference.ragged_paged_attention(**_fp8_pools(args, scales), scale=SCALE,
                                                           k_scale=scales[0], v_scale=scales[1])
    np.testing.assert_array_equal(np.asarray(k_pool, np.float32) * scales[0], np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_pool, np.float32) * scales[1], np.asarray(v_ref))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_interpret_kernel_on_fp8_pools_matches_the_reference():
    """bf16 queries over fp8 pools: the kernel casts pool entries to bf16 (exact) for bf16 dots."""
    scales = (2.0, 0.5)
    args, _ = make_case(ROWS, seed=5, num_q_heads=8, num_kv_heads=2)
    args = _fp8_pools(_on_fp8_grid(args, scales), scales)
    args = {k: (jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else a) for k, a in args.items()}
    upcast = {k: (a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a) for k, a in args.items()}
    expected, k_ref, v_ref = reference.ragged_paged_attention(**upcast, scale=SCALE, k_scale=2.0, v_scale=0.5)
    out, k_pool, v_pool = ragged_paged_attention(**args, scale=SCALE, k_scale=2.0, v_scale=0.5, backend="interpret",
                                                 block_m=16, num_splits=2)
    assert out.dtype == jnp.bfloat16 and k_pool.dtype == FP8
    np.testing.assert_array_equal(np.asarray(k_pool, np.float32), np.asarray(k_ref, np.float32))
    num_real = int(args["cu_seqlens"][-1])
    BFloat16(degree=2).check(out[:num_real], expected[:num_real])


def test_lowers_for_cuda_with_fp8_pools():
    """Qwen3-Next's attention shapes, bf16 queries over fp8 pools: the Triton call lowers for sm_90."""
    spec = jax.ShapeDtypeStruct
    pools = [spec((64, 16, 2, 256), FP8)] * 2
    metadata = [spec((8,), jnp.int32), spec((8, 64), jnp.int32), spec((9,), jnp.int32), spec((8,), jnp.int32)]
    args = [spec((8, 16, 256), jnp.bfloat16), *[spec((8, 2, 256), jnp.bfloat16)] * 2, *pools, *metadata]
    attention = functools.partial(pallas.ragged_paged_attention, scale=256**-0.5, k_scale=0.5, v_scale=2.0)
    assert TRITON_CALL in lower_for_cuda(attention, *args)
