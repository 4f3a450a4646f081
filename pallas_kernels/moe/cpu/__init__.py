"""Routed experts as a C++ XLA FFI kernel for CPU (`experts.cc`, docs/kernels.md#routed-experts-on-cpu): each
expert multiplies exactly its routed rows, bf16 with f32 accumulation (AVX-512 BF16 where the CPU has it).

The library is built and registered by `pallas_kernels.cpu_ffi` (`available()`). The kernel takes bf16 activations
and weights of even widths with a SiLU gate or relu²; `runs_kernel` says whether a call qualifies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi

TARGET = "jaxhybrid_routed_experts"
ACTIVATION_CODES = {"silu": 0, "relu2": 1}  # experts.cc's Activation; silu takes the gate, relu2 none


def runs_kernel(x: jax.Array, up: jax.Array, down: jax.Array, gate: jax.Array | None, activation: str) -> bool:
    """Whether the kernel computes these experts: bf16 throughout, even widths, a gate exactly for silu, built."""
    arrays = (x, up, down) if gate is None else (x, up, down, gate)
    return (all(a.dtype == jnp.bfloat16 for a in arrays) and up.shape[1] % 2 == 0 and up.shape[2] % 2 == 0
            and (gate is not None) == (activation == "silu") and activation in ACTIVATION_CODES
            and cpu_ffi.available())


@functools.partial(jax.jit, static_argnames="activation")
def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, up: jax.Array, down: jax.Array,
                   gate: jax.Array | None = None, *, activation: str = "silu") -> jax.Array:
    """`pallas_kernels.moe.reference.routed_experts` on the kernel (where `runs_kernel`)."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, weights.astype(jnp.float32), experts.astype(jnp.int32), up, up if gate is None else gate, down,
                activation=np.int32(ACTIVATION_CODES[activation]))
