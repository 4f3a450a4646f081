"""bf16 matmuls as a C++ XLA FFI kernel for CPU (`matmul.cc`, docs/kernels.md#bf16-matmuls-on-cpu), on weights
packed ahead of time: `[..., K, N]` becomes `[..., N / 32, K / 2, 32, 2]`, strips of 32 columns whose (k, k + 1)
row pairs lie column by column, the order AVX-512 BF16's `vdpbf16ps` multiplies them in. A packed weight streams
from memory in order, once, which is a decode step's projection's whole cost.

Where the CPU kernels run, the engine's runner packs the projections' weights and the MoE layers' expert stacks
(`packed_params`); a `Dense` with a packed kernel runs `matmul`, a MoE layer with packed experts
`pallas_kernels.moe.cpu.routed_experts`. The library is built and registered by `pallas_kernels.cpu_ffi`
(`available()`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi
from pallas_kernels.matmul import reference

TARGET = "jaxhybrid_bf16_matmul"
STRIP = 32  # columns per strip of the packed form (matmul.cc, bf16_gemm.h)


def packs(w: jax.Array) -> bool:
    """Whether `w` ([..., K, N]) packs: bf16, K even, N a multiple of the strip (smaller matmuls keep XLA's dot)."""
    return (w.dtype == jnp.bfloat16 and w.ndim >= 2 and w.shape[-2] % 2 == 0 and w.shape[-1] % STRIP == 0
            and w.shape[-1] > 0)


def is_packed(w: jax.Array) -> bool:
    return w.ndim >= 4 and w.shape[-2:] == (STRIP, 2)


@jax.jit
def pack(w: jax.Array) -> jax.Array:
    """`[..., K, N]` -> `[..., N / 32, K / 2, 32, 2]`: element `[s, p, c, j]` is `w[2p + j, 32s + c]`."""
    *lead, k, n = w.shape
    split = w.reshape(*lead, k // 2, 2, n // STRIP, STRIP)
    d = len(lead)
    return split.transpose(*range(d), d + 2, d, d + 3, d + 1)


@jax.jit
def unpack(w: jax.Array) -> jax.Array:
    """`pack`'s inverse."""
    *lead, s, p, c, j = w.shape
    d = len(lead)
    return w.transpose(*range(d), d + 1, d + 3, d, d + 2).reshape(*lead, 2 * p, s * c)


def _map_selected(params: Any, selected: Callable[[tuple[str, ...]], bool], fn: Callable, applies: Callable) -> Any:
    def leaf(path: tuple, w: Any) -> Any:
        keys = tuple(str(getattr(key, "key", key)) for key in path)
        return fn(w) if selected(keys) and applies(w) else w
    return jax.tree_util.tree_map_with_path(leaf, params)


def packed_params(params: Any, selected: Callable[[tuple[str, ...]], bool]) -> Any:
    """The params with each leaf at a `selected` path (its dict keys) that `packs` packed; a layer stack's
    leaf packs as a stack."""
    return _map_selected(params, selected, pack, packs)


def unpacked_params(params: Any, selected: Callable[[tuple[str, ...]], bool]) -> Any:
    """`packed_params`' inverse."""
    return _map_selected(params, selected, unpack, is_packed)


@jax.jit
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`reference.matmul(x, unpack(w))` for x `[..., K]` and a packed w: on the kernel where it is built and x is
    bf16, else XLA's dot on the unpacked weight."""
    if x.dtype != jnp.bfloat16 or not cpu_ffi.available():
        return reference.matmul(x, unpack(w))
    rows = x.reshape(-1, x.shape[-1])
    columns = w.shape[-4] * STRIP
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], columns), x.dtype))(rows, w)
    return out.reshape(*x.shape[:-1], columns)
