"""The C++ FFI routed-experts kernel on CPU (pallas_kernels/moe/cpu) against the reference: any routing (every
token's first choice on one expert included, so an expert may get more rows than a work item holds), gated SiLU
and relu², widths that are and are not whole strips of 32 columns; and which calls it takes.

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

from pallas_kernels.moe import cpu, reference
from tests.tolerances import assert_bfloat16_close

pytestmark = pytest.mark.usefixtures("kernels")

ROUNDINGS = 7


def _experts(rng, num_experts, dim, inter, gated):
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16)
    return normal(num_experts, dim, inter), normal(num_experts, inter, dim), (
        normal(num_experts, dim, inter) if gated else None)


@settings(max_examples=12, deadline=None)
@given(num_experts=st.integers(1, 9), top_k=st.integers(1, 3), num_tokens=st.integers(1, 48),
       widths=st.sampled_from([(8, 12), (64, 32), (40, 70)]), activation=st.sampled_from(["silu", "relu2"]),
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
    assert cpu.runs_kernel(x, up, down, gate, activation)
    actual = cpu.routed_experts(x, weights, experts, up, down, gate, activation=activation)
    expected = reference.routed_experts(x, weights, experts, up, down, gate, activation=activation)
    assert actual.dtype == jnp.bfloat16
    assert_bfloat16_close(actual.astype(jnp.float32), expected.astype(jnp.float32), ROUNDINGS)


def test_takes_bf16_experts_of_even_widths_only():
    rng = np.random.default_rng(0)
    up, down, gate = _experts(rng, 4, 8, 12, True)
    x = jnp.zeros((3, 8), jnp.bfloat16)
    assert cpu.runs_kernel(x, up, down, gate, "silu")
    assert not cpu.runs_kernel(x.astype(jnp.float32), up, down, gate, "silu")
    assert not cpu.runs_kernel(x, up.astype(jnp.float32), down, gate, "silu")
    assert not cpu.runs_kernel(x, up, down, None, "silu")  # SiLU is the gated form
    assert not cpu.runs_kernel(x, up, down, gate, "relu2")
    odd = _experts(rng, 4, 8, 11, True)
    assert not cpu.runs_kernel(x, *odd[:2], odd[2], "silu")


def test_an_expert_id_outside_the_stack_fails():
    rng = np.random.default_rng(0)
    up, down, gate = _experts(rng, 4, 8, 12, True)
    x, weights = jnp.zeros((2, 8), jnp.bfloat16), jnp.ones((2, 1), jnp.float32)
    with pytest.raises(Exception, match="expert id outside"):
        jax.block_until_ready(cpu.routed_experts(x, weights, np.array([[1], [4]], np.int32), up, down, gate))
