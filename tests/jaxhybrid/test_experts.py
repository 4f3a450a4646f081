"""Routed experts (jaxhybrid/models/experts.py): equal to every expert for every token with zero weights,
for any routing (all tokens on one expert included), tile and chunking; and a compiled cost that grows with
the tokens' top-k, not with the number of experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.models.experts import ExpertWeights, Tiling, dense_experts, max_tiles, plan_tiles, routed_experts
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


@settings(max_examples=20, deadline=None)
@given(routing=routings(), gated=st.booleans(), tile=st.sampled_from([None, 1, 2, 4]), small_chunks=st.booleans())
def test_routed_experts_equal_every_expert_with_zero_weights(routing, gated, tile, small_chunks):
    num_experts, experts, seed = routing
    params = _expert_weights(num_experts, gated, seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (experts.shape[0], DIM), jnp.float32)
    weights = jax.random.uniform(jax.random.key(seed + 2), experts.shape, jnp.float32)
    activation = jax.nn.silu if gated else lambda h: jnp.square(jax.nn.relu(h))
    tiling = plan_tiles(experts.size, params, "cpu", tile)
    assert tiling.num_tiles >= max_tiles(experts.size, num_experts, tiling.tile)
    if small_chunks:  # a chunk of one tile: the loop over chunks
        tiling = Tiling(tiling.tile, tiling.num_tiles, 1)
    routed = routed_experts(x, weights, jnp.asarray(experts), params, activation, tiling)
    dense = dense_experts(x, weights, jnp.asarray(experts), params, activation)
    # depth: the up/gate dot (DIM terms), the down dot (INTER terms), the sum over top-k, and the activation
    assert_float32_close(routed, dense, DIM + INTER + experts.shape[1] + 4, "routed experts")


def _compiled_flops(num_experts: int, top_k: int, num_tokens: int = 4, dim: int = 64, inter: int = 256) -> float:
    params = _expert_weights(num_experts, gated=True, dim=dim, inter=inter)
    shapes = jax.ShapeDtypeStruct((num_tokens, dim), jnp.float32), jax.ShapeDtypeStruct((num_tokens, top_k),
                                                                                        jnp.float32)
    routed = lambda x, w, e, p: routed_experts(x, w, e, p, jax.nn.silu)
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
    """A prefill's many assignments over few experts: tiles of many rows, each expert's weights read once
    per tile, never a tile per assignment."""
    params = _expert_weights(8, gated=True, dim=64, inter=256)
    tiling = plan_tiles(4096 * 2, params, "cpu")
    assert tiling.tile > 1 and tiling.num_tiles * tiling.tile <= 8192 + 8 * tiling.tile
