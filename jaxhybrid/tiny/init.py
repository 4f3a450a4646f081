"""Initial params as HuggingFace's Qwen3-Next `_init_weights` draws them (Flax's defaults train slower here)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxhybrid.models.config import ModelConfig
from jaxhybrid.models.model import init_params


def hf_init_params(cfg: ModelConfig, seed: int, initializer_range: float) -> Any:
    """Linear and embedding weights ~ N(0, initializer_range), GDN `A_log = log(U(0, 16))`, the rest as Flax.

    With lecun-normal kernels every sublayer adds O(1) outputs to a residual stream whose embedding is
    N(0, 0.02): the token signal starts buried. HF's single small scale keeps the two comparable.
    """
    params = init_params(cfg, seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(flat))
    leaves = []
    for (path, leaf), key in zip(flat, keys, strict=True):
        name = path[-1].key
        if name in ("kernel", "embedding"):
            leaf = initializer_range * jax.random.normal(key, leaf.shape, leaf.dtype)
        elif name == "A_log":
            leaf = jnp.log(jax.random.uniform(key, leaf.shape, leaf.dtype, minval=1e-4, maxval=16.0))
        leaves.append(leaf)
    return tree.unflatten(leaves)
