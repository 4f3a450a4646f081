"""A bf16 matmul, the pure-JAX reference of the CPU kernel: XLA's dot, accumulated in f32 and rounded once."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for x `[..., K]` and w `[K, N]`, in x's dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
