"""Routed experts (jaxhybrid/models/experts.py): equal to every expert for every token with zero weights,
for any routing (all tokens on one expert included), layout, tile, capacity (overflowing or not) and
chunking; a compiled cost that grows with the tokens' top-k, not with the number of experts; and the layout
each shape gets."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.models.experts import (
    ExpertWeights,
    dense_experts,
    expert_capacity,
    max_tiles,
    plan_experts,
    routed_experts,
)
from jaxhybrid.models.fp8_weights import is_matmul_weight
from jaxhybrid.models.hf_config import load_config
from jaxhybrid.models.hybrid import DecoderLayer
from jaxhybrid.models.ops import ModelOps
from pallas_kernels.matmul import cpu as matmul_cpu
from pallas_kernels.moe import cpu as experts_cpu
from tests.tolerances import assert_bfloat16_close, assert_float32_close

DIM, INTER = 8, 12


def _expert_weights(num_experts: int, gated: bool, dim: int = DIM, inter: int = INTER, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[1])
    gate = normal(keys[2], (num_experts, dim, inter)) if gated else None
    return ExpertWeights(normal(keys[0], (num_experts, dim, inter)), normal(keys[1], (num_experts, inter, dim)), gate)


@st.composite
def routings(draw):
    num_experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, min(3, num_experts)))
    num_tokens = draw(st.integers(1, 12))
    one_expert = draw(st.booleans())  # the worst padding: every token's first choice is expert 0
    rows = []
    for _ in range(num_tokens):
        choice = draw(st.permutations(range(num_experts)))[:top_k]
        rows.append(sorted(choice) if one_expert else choice)
    return num_experts, np.array(rows, np.int32), draw(st.integers(0, 2**16))


@settings(max_examples=30, deadline=None)
@given(routing=routings(), gated=st.booleans(), tile=st.sampled_from([None, 1, 2, 4]),
       capacity=st.sampled_from([None, 0, 1, 2, 12]), small_chunks=st.booleans())
def test_routed_experts_equal_every_expert_with_zero_weights(routing, gated, tile, capacity, small_chunks):
    """Capacities below the busiest expert's load take the tiled fallback; 12 holds every routing here."""
    num_experts, experts, seed = routing
    params = _expert_weights(num_experts, gated, seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (experts.shape[0], DIM), jnp.float32)
    weights = jax.random.uniform(jax.random.key(seed + 2), experts.shape, jnp.float32)
    activation = jax.nn.silu if gated else lambda h: jnp.square(jax.nn.relu(h))
    tiling = plan_experts(*experts.shape, params, "cpu", tile, capacity)
    assert tiling.num_tiles >= max_tiles(experts.size, num_experts, tiling.tile)
    if small_chunks:  # a chunk of one tile: the loop over chunks
        tiling = tiling._replace(chunk=1)
    routed = routed_experts(x, weights, jnp.asarray(experts), params, activation, tiling)
    dense = dense_experts(x, weights, jnp.asarray(experts), params, activation)
    # depth: the up/gate dot (DIM terms), the down dot (INTER terms), the sum over top-k, and the activation
    assert_float32_close(routed, dense, DIM + INTER + experts.shape[1] + 4, "routed experts")


def _compiled_flops(num_experts: int, top_k: int, num_tokens: int = 4, dim: int = 64, inter: int = 256,
                    capacity: int | None = None) -> float:
    params = _expert_weights(num_experts, gated=True, dim=dim, inter=inter)
    shapes = jax.ShapeDtypeStruct((num_tokens, dim), jnp.float32), jax.ShapeDtypeStruct((num_tokens, top_k),
                                                                                        jnp.float32)
    tiling = plan_experts(num_tokens, top_k, params, "cpu", capacity=capacity)
    routed = lambda x, w, e, p: routed_experts(x, w, e, p, jax.nn.silu, tiling)
    compiled = jax.jit(routed).lower(*shapes, jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
                                     params).compile()
    return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize("top_k", [1, 2])
def test_compiled_cost_grows_with_top_k_not_with_the_number_of_experts(top_k):
    """4 tokens: at most 8 assignments, so every expert count here gets one-row tiles (nothing padded)."""
    few, many = _compiled_flops(8, top_k), _compiled_flops(64, top_k)
    assert abs(many - few) / few < 0.10, (few, many)
    assert abs(_compiled_flops(64, 2 * top_k) / many - 2) < 0.2  # twice the routed experts: twice the flops
    routed = 4 * top_k * 2 * 3 * 64 * 256  # assignments × the three matmuls' flops (dense: 64 / top_k times it)
    assert routed <= many < 1.2 * routed


def test_tiles_grow_when_many_tokens_share_few_experts():
    """A prefill's many assignments over few experts, tiled: tiles of many rows, each expert's weights read
    once per tile, never a tile per assignment."""
    params = _expert_weights(8, gated=True, dim=64, inter=256)
    tiling = plan_experts(4096, 2, params, "cpu", capacity=0)
    assert tiling.tile > 1 and tiling.num_tiles * tiling.tile <= 8192 + 8 * tiling.tile


@pytest.mark.parametrize("num_experts", [8, 64])
def test_busy_experts_take_the_capacity_layout_and_idle_ones_tiles(num_experts):
    """When every expert has work (a prefill) its weights are read in place, once: the capacity layout, with
    room for a balanced router's load and little more. When most experts are idle (decoding a few tokens) only
    the routed ones are read: tiles. `capacity >= T` holds every routing; below it an overflow falls back to
    tiles, so the compiled cost is the larger of the two."""
    params = _expert_weights(num_experts, gated=True, dim=64, inter=256)
    prefill = plan_experts(1024, 2, params, "cpu")
    mean = 1024 * 2 / num_experts
    assert prefill.capacity == expert_capacity(1024, 2, num_experts)
    assert mean < prefill.capacity <= mean + 4 * np.sqrt(mean) + 1
    assert plan_experts(1, 2, params, "cpu").capacity == 0
    assert plan_experts(1024, 2, params, "cpu", capacity=0).capacity == 0
    assert expert_capacity(3, 2, 8) == 3  # never more than T: no token picks an expert twice
    with_fallback = _compiled_flops(num_experts, 2, num_tokens=64, capacity=expert_capacity(64, 2, num_experts))
    tiles_only = _compiled_flops(num_experts, 2, num_tokens=64, capacity=0)
    capacity_rows = num_experts * expert_capacity(64, 2, num_experts)
    assert with_fallback == pytest.approx(max(tiles_only, capacity_rows * 2 * 3 * 64 * 256), rel=0.05)


def _bf16_experts(num_experts: int = 8, dim: int = 64, inter: int = 256) -> ExpertWeights:
    return jax.tree.map(lambda w: w.astype(jnp.bfloat16), _expert_weights(num_experts, True, dim, inter))


def _expert_dot_results(lowered_text: str) -> set[str]:
    """The element types of the batched (expert) matmuls' results in a lowered program."""
    return set(re.findall(r"dot_general.*-> tensor<\d+x\d+x\d+x(\w+)>", lowered_text))


def _dot_results(num_tokens: int, platform: str) -> set[str]:
    params, top_k = _bf16_experts(), 2
    routed = lambda x, w, e: routed_experts(x, w, e, params, jax.nn.silu, platform=platform)
    return _expert_dot_results(jax.jit(routed).lower(
        jax.ShapeDtypeStruct((num_tokens, 64), jnp.bfloat16), jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
        jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)).as_text())


def test_cpu_expert_matmuls_of_few_rows_take_f32_results_and_gpu_ones_bf16():
    """XLA:CPU runs a 16-bit batched matmul of few rows per expert faster when asked for an f32 result, which the
    layer rounds to bf16 (`MACHINE`); a GPU's matmuls, and a CPU's of many rows, return bf16 themselves."""
    assert _dot_results(16, "cpu") == {"f32"}  # capacity 12 and its tiled fallback
    assert _dot_results(16, "gpu") == {"bf16"}
    # capacity 1,152 rows per expert: bf16; its tiled fallback's tiles of 256: f32
    assert _dot_results(4096, "cpu") == {"bf16", "f32"}
    assert _dot_results(4096, "gpu") == {"bf16"}


def test_f32_results_rounded_to_bf16_agree_with_bf16_results():
    """The two result types differ only in where the f32 accumulation is rounded to bf16: each matmul's output
    is the same bf16 rounding of sums that differ by float32 roundoff, so outputs agree to a few bf16 roundings
    (up/gate, the activation's product and the down projection)."""
    params = _bf16_experts()
    key = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(key[0], (16, 64), jnp.bfloat16)
    experts = jax.random.randint(key[1], (16, 2), 0, 8)
    experts = jnp.stack([experts[:, 0], (experts[:, 0] + 1 + experts[:, 1] % 7) % 8], axis=1)  # two distinct
    weights = jax.random.uniform(key[2], (16, 2), jnp.float32)
    cpu, gpu = (routed_experts(x, weights, experts, params, jax.nn.silu, platform=p) for p in ("cpu", "gpu"))
    assert_bfloat16_close(cpu.astype(jnp.float32), gpu.astype(jnp.float32), 4, "f32 against bf16 results")


def test_a_model_compiled_for_gpu_lays_out_its_experts_for_gpu():
    """The deviceless GPU compile (`benchmarks/aot_step.py`) traces on a CPU host: a MoE layer follows the
    kernels' platform (`ModelOps.platform`), not the host's."""
    cfg = load_config(Path(__file__).parents[2] / "configs" / "models" / "tiny_qwen3_next.yaml")
    x = jnp.zeros((16, cfg.hidden_size), jnp.bfloat16)
    for backend, results in ((None, {"f32"}), ("interpret", {"f32"}), ("pallas", {"bf16"})):
        layer = DecoderLayer(cfg, ("moe",), ModelOps(backend=backend))
        params = layer.init(jax.random.key(0), x, None, None)
        lowered = jax.jit(lambda p, x: layer.apply(p, x, None, None)[0]).lower(params, x)  # noqa: B023
        assert _expert_dot_results(lowered.as_text()) == results, backend


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_packed_experts_run_the_cpu_kernels(dtype):
    """A bf16 MoE layer packed as the runner packs it for the CPU FFI kernels (`packed_params`) runs its routed
    experts and its shared expert's projections on the C++ kernels (their custom calls in the step) and agrees with
    XLA's path on the checkpoint's layout; f32 params are left as they are, and keep XLA's path bit for bit.

    Bound: the routed experts' 7 bf16 roundings (tests/pallas_kernels/test_moe_ffi.py), or the shared expert's
    projection, SiLU, product, down projection and gate product (8), then the sum of the two and the residual."""
    cfg = load_config(Path(__file__).parents[2] / "configs" / "models" / "tiny_qwen3_next.yaml")
    x = jax.random.normal(jax.random.key(1), (16, cfg.hidden_size), jnp.float32).astype(dtype)
    layer = DecoderLayer(cfg, ("moe",))
    params = jax.tree.map(lambda p: p.astype(dtype), layer.init(jax.random.key(0), x, None, None))
    step = jax.jit(lambda p, x: layer.apply(p, x, None, None)[0])
    packed = matmul_cpu.packed_params(params, is_matmul_weight)
    text = step.lower(packed, x).as_text()
    assert (experts_cpu.TARGET in text, matmul_cpu.TARGET in text) == (dtype == jnp.bfloat16,) * 2
    ours, theirs = np.asarray(step(packed, x), np.float32), np.asarray(step(params, x), np.float32)
    if dtype == jnp.float32:
        np.testing.assert_array_equal(ours, theirs)
    else:
        assert_bfloat16_close(ours, theirs, 8 + 2, "kernels against XLA")
