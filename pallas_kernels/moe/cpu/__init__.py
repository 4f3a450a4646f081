"""Routed experts as a C++ XLA FFI kernel for CPU (`experts.cc`, docs/kernels.md#routed-experts-on-cpu): each
expert multiplies exactly its routed rows, bf16 with f32 accumulation (AVX-512 BF16 where the CPU has it), on
experts packed ahead of time as the projections are (`pallas_kernels.matmul.cpu.pack`: `[E, in, out]` ->
`[E, out / 32, in / 2, 32, 2]`).

The library is built and registered by `pallas_kernels.cpu_ffi` (`available()`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi
from pallas_kernels.matmul.cpu import unpack
from pallas_kernels.moe import reference

TARGET = "jaxhybrid_routed_experts"
ACTIVATION_CODES = {"silu": 0, "relu2": 1}  # experts.cc's Activation; silu takes the gate, relu2 none


@functools.partial(jax.jit, static_argnames="activation")
def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, up: jax.Array, down: jax.Array,
                   gate: jax.Array | None = None, *, activation: str = "silu") -> jax.Array:
    """`pallas_kernels.moe.reference.routed_experts` on packed experts: on the kernel where it is built and x is
    bf16 (a gate exactly for silu), else the reference on the unpacked experts."""
    if x.dtype != jnp.bfloat16 or (gate is not None) != (activation == "silu") or not cpu_ffi.available():
        return reference.routed_experts(x, weights, experts, unpack(up), unpack(down),
                                        None if gate is None else unpack(gate), activation=activation)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, weights.astype(jnp.float32), experts.astype(jnp.int32), up, up if gate is None else gate, down,
                activation=np.int32(ACTIVATION_CODES[activation]))
