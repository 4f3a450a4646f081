"""Routed experts, the pure-JAX reference of the CPU kernel: every (token, expert) assignment through its expert's
weights, gathered per assignment (small shapes only: tests).

Rounding, as the engine's XLA path (`jaxhybrid.models.experts`): each projection accumulates in f32 and is rounded
to the activation dtype, the activation runs in that dtype, and each assignment's output is weighted in f32 and a
token's k outputs summed in f32 before the final rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {"silu": jax.nn.silu, "relu2": lambda h: jnp.square(jax.nn.relu(h))}


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, up: jax.Array, down: jax.Array,
                   gate: jax.Array | None = None, *, activation: str = "silu") -> jax.Array:
    """`sum_j weights[t, j] expert_{experts[t, j]}(x[t])` for x `[T, d]`, weights and experts `[T, k]`, up and gate
    `[E, d, I]`, down `[E, I, d]`: `down(act(gate(x)) * up(x))` with a gate, else `down(act(up(x)))`."""
    num_tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    rows = x[jnp.arange(num_tokens * top_k) // top_k]

    def dot(spec: str, a: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum(spec, a, w[flat], preferred_element_type=jnp.float32).astype(x.dtype)

    act = ACTIVATIONS[activation]
    hidden = dot("md,mdi->mi", rows, up)
    hidden = act(hidden) if gate is None else act(dot("md,mdi->mi", rows, gate)) * hidden
    out = dot("mi,mid->md", hidden, down).astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
    return out.reshape(num_tokens, top_k, -1).sum(axis=1).astype(x.dtype)
