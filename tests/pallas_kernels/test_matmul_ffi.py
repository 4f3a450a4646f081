"""The C++ FFI bf16 matmul on CPU (pallas_kernels/matmul/cpu) on packed weights against XLA's dot on the
checkpoint's (`reference.matmul`); the packed form itself; and `Dense` on packed params.

Tolerance: both sides sum the same exact products (a bf16 times a bf16 is exact in f32) in f32, in different
orders, and round once to bf16, so they differ only where the two f32 sums straddle a bf16 rounding boundary:
one bf16 ulp (degree 1), the f32 orders' own difference (K ulps of the sum) far below it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ffi_kernels import kernels  # noqa: F401  (the module's fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.models.layers import Dense
from pallas_kernels.matmul import cpu, reference
from tests.tolerances import assert_bfloat16_close

pytestmark = pytest.mark.usefixtures("kernels")


def _bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1), jnp.bfloat16)


def test_pack_lays_pairs_out_column_by_column():
    rng = np.random.default_rng(0)
    w = np.asarray(_bf16(rng, 3, 6, 64), np.float32)  # a stack of 3
    packed = np.asarray(cpu.pack(jnp.asarray(w, jnp.bfloat16)), np.float32)
    assert packed.shape == (3, 2, 3, 32, 2)
    for r, s, p, c, j in np.ndindex(packed.shape):
        assert packed[r, s, p, c, j] == w[r, 2 * p + j, 32 * s + c]
    np.testing.assert_array_equal(np.asarray(cpu.unpack(jnp.asarray(packed, jnp.bfloat16)), np.float32), w)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 80), pairs=st.integers(1, 100), strips=st.integers(1, 10), lead=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_the_reference(rows, pairs, strips, lead, seed):
    """Row tiles (8 rows) and work items (4 strips) whole and cut short; x with a leading axis or not."""
    rng = np.random.default_rng(seed)
    w = _bf16(rng, 2 * pairs, 32 * strips)
    x = _bf16(rng, *((2, rows) if lead else (rows,)), 2 * pairs)
    actual = cpu.matmul(x, cpu.pack(w))
    assert cpu.TARGET in cpu.matmul.lower(x, cpu.pack(w)).as_text()
    assert actual.dtype == jnp.bfloat16 and actual.shape == (*x.shape[:-1], w.shape[1])
    assert_bfloat16_close(actual.astype(jnp.float32), reference.matmul(x, w).astype(jnp.float32), 1)


def test_f32_rows_run_the_reference():
    rng = np.random.default_rng(1)
    w, x = _bf16(rng, 64, 96), jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    assert cpu.TARGET not in cpu.matmul.lower(x, cpu.pack(w)).as_text()
    np.testing.assert_array_equal(cpu.matmul(x, cpu.pack(w)), reference.matmul(x, w))


def test_packs_bf16_weights_of_whole_strips_at_selected_paths():
    rng = np.random.default_rng(2)
    params = {"a": {"kernel": _bf16(rng, 8, 64)}, "b": {"kernel": _bf16(rng, 8, 48)},  # 48: not whole strips
              "c": {"kernel": _bf16(rng, 8, 64).astype(jnp.float32)}, "d": {"other": _bf16(rng, 8, 64)},
              "e": {"kernel": _bf16(rng, 7, 64)}}  # an odd K
    selected = lambda path: path[-1] == "kernel"
    packed = cpu.packed_params(params, selected)
    assert [name for name in params if cpu.is_packed(packed[name][next(iter(params[name]))])] == ["a"]
    restored = cpu.unpacked_params(packed, selected)
    jax.tree.map(np.testing.assert_array_equal, restored, params)


@pytest.mark.parametrize("use_bias", [False, True])
def test_dense_runs_the_kernel_on_a_packed_kernel(use_bias):
    rng = np.random.default_rng(3)
    layer = Dense(96, use_bias=use_bias, dtype=jnp.bfloat16)
    x = _bf16(rng, 16, 64)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), layer.init(jax.random.key(0), x))
    if use_bias:  # a nonzero bias, so that dropping it fails
        params["params"]["bias"] = _bf16(rng, 96)
    packed = cpu.packed_params(params, lambda path: path[-1] == "kernel")
    step = jax.jit(layer.apply)
    assert cpu.TARGET in step.lower(packed, x).as_text() and cpu.TARGET not in step.lower(params, x).as_text()
    assert_bfloat16_close(np.asarray(step(packed, x), np.float32), np.asarray(step(params, x), np.float32),
                          1 + use_bias, "packed against XLA")  # + the bias add's rounding
