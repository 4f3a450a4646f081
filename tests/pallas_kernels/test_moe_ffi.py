"""The C++ FFI routed-experts kernel on CPU (pallas_kernels/moe/cpu) on packed experts against the reference on the
checkpoint's: any routing (every token's first choice on one expert included, so an expert may get more rows than
a work item holds), gated SiLU and relu², widths of one strip and of several; and the calls it leaves to the
reference.

Tolerance: both sides round every projection, the activation's element-wise ops and the output to bf16 at the same
points, so they differ only where f32 values that differ in their last bits (the accumulation order of the dots,
the kernel's own e^x) straddle a bf16 rounding boundary: one bf16 ulp per rounding on the longest chain, the
projection (1), SiLU's exp, add, divide and multiply (4), the gate product (1) and the down projection (1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ffi_kernels import kernels  # noqa: F401  (the module's fixture)
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.matmul.cpu import pack
from pallas_kernels.moe import cpu, reference
from tests.tolerances import assert_bfloat16_close

pytestmark = pytest.mark.usefixtures("kernels")

ROUNDINGS = 7


def _experts(rng, num_experts, dim, inter, gated):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16)
    return normal(num_experts, dim, inter), normal(num_experts, inter, dim), (
        normal(num_experts, dim, inter) if gated else None)


def _packed(*experts):
    return [None if w is None else pack(w) for w in experts]


@settings(max_examples=12, deadline=None)
@given(num_experts=st.integers(1, 9), top_k=st.integers(1, 3), num_tokens=st.integers(1, 48),
       widths=st.sampled_from([(32, 64), (64, 32), (96, 160)]), activation=st.sampled_from(["silu", "relu2"]),
       one_expert=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_the_reference(num_experts, top_k, num_tokens, widths, activation, one_expert, seed):
    rng = np.random.default_rng(seed)
    top_k = min(top_k, num_experts)
    up, down, gate = _experts(rng, num_experts, *widths, activation == "silu")
    x = jnp.asarray(rng.standard_normal((num_tokens, widths[0])), jnp.bfloat16)
    experts = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)]).astype(np.int32)
    if one_expert:
        experts = np.sort(experts, axis=1)  # expert 0, where routed, is every such token's first choice
    weights = jnp.asarray(rng.uniform(size=(num_tokens, top_k)), jnp.float32)
    actual = cpu.routed_experts(x, weights, experts, *_packed(up, down, gate), activation=activation)
    expected = reference.routed_experts(x, weights, experts, up, down, gate, activation=activation)
    assert actual.dtype == jnp.bfloat16
    assert_bfloat16_close(actual.astype(jnp.float32), expected.astype(jnp.float32), ROUNDINGS)


def test_f32_rows_run_the_reference():
    """The kernel takes bf16 rows: f32 ones get the reference on the unpacked experts, bit for bit."""
    rng = np.random.default_rng(0)
    up, down, gate = _experts(rng, 4, 32, 64, True)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    weights, experts = jnp.full((3, 2), 0.5, jnp.float32), np.array([[0, 1], [2, 3], [3, 0]], np.int32)
    call = cpu.routed_experts.lower(x, weights, experts, *_packed(up, down, gate)).as_text()
    assert cpu.TARGET not in call
    np.testing.assert_array_equal(cpu.routed_experts(x, weights, experts, *_packed(up, down, gate)),
                                  reference.routed_experts(x, weights, experts, up, down, gate))


def test_an_expert_id_outside_the_stack_fails():
    rng = np.random.default_rng(0)
    up, down, gate = _packed(*_experts(rng, 4, 32, 64, True))
    x, weights = jnp.zeros((2, 32), jnp.bfloat16), jnp.ones((2, 1), jnp.float32)
    with pytest.raises(Exception, match="expert id outside"):
        jax.block_until_ready(cpu.routed_experts(x, weights, np.array([[1], [4]], np.int32), up, down, gate))
