"""Routed experts (jaxhybrid/models/experts.py): equal to every expert for every token with zero weights,
for any routing (all tokens on one expert included), layout, tile, capacity (overflowing or not) and
chunking; a compiled cost that grows with the tokens' top-k, not with the number of experts; and the layout
each shape gets."""

from __future__ import annotations

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
from tests.tolerances import assert_float32_close

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
