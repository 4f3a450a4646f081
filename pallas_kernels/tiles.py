"""What a Triton kernel's dots and tiles must be: dot precision by operand dtype, power-of-two tiles that divide
the axis, dot sides of at least 16, metadata operands as int32."""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# fp32 references must not silently drop to TF32/bf16 passes on GPU.
HIGHEST = jax.lax.Precision.HIGHEST


TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot_precision(dtype, interpret: bool, f32_on_gpu=TF32X3) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset:
    """In-kernel dot precision for operands of `dtype`, always accumulated in f32.

    bf16/fp16 operands run at DEFAULT, on tensor cores (HIGHEST would upcast them to fp32 passes). f32 operands
    run as `f32_on_gpu` on Triton: by default 3xTF32, three tensor-core passes over operands split into high
    and low TF32 halves, close to fp32's accuracy, where IEEE fp32 dots (HIGHEST) are FMA loops whose operands
    fill the registers and spill at GDN's and SSD's prefill tiles (`benchmarks/aot_kernels.py`). Interpret mode
    runs XLA:CPU, which has no TF32: IEEE fp32, as the references.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return jax.lax.Precision.DEFAULT
    return HIGHEST if interpret else f32_on_gpu


class Dots(NamedTuple):
    """What a kernel's dots need to know: their operands' dtype, whether the kernel is interpreted, and how f32
    operands run on Triton (`dot_precision`)."""

    dtype: Any
    interpret: bool
    f32_on_gpu: Any = TF32X3

    def __call__(self, a, b, contract=((1,), (0,))):
        """a @ b (contracting `contract`) on operands cast to this dtype, accumulated in f32."""
        return jax.lax.dot_general(a.astype(self.dtype), b.astype(self.dtype), (contract, ((), ())),
                                   precision=dot_precision(self.dtype, self.interpret, self.f32_on_gpu),
                                   preferred_element_type=jnp.float32)

    @property
    def f32(self) -> "Dots":
        """The same kernel's dots on f32 intermediates."""
        return self._replace(dtype=jnp.float32)


MIN_DOT_SIDE = 16  # Triton's smallest tl.dot side


def dividing_tile(size: int, tile: int, name: str) -> int:
    """The largest power-of-two tile <= `tile` dividing `size` (V = 96, tile 64 -> 32): Triton tiles are powers of
    two, and a grid of size // tile tiles that did not divide would leave the tail unwritten."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"{name}={tile} must be a power of two")
    return math.gcd(size, tile)


def check_dot_sides(interpret: bool, **sides: int) -> None:
    """Triton rejects a dot with a side below 16 at compile time; interpret mode takes any, as tests do."""
    small = {name: side for name, side in sides.items() if side < MIN_DOT_SIDE}
    if small and not interpret:
        raise ValueError(f"Triton dots need every side >= {MIN_DOT_SIDE}: {small}")


def int32(*arrays: jax.Array) -> list[jax.Array]:
    """Kernel metadata operands: read as int32 scalars (bool flags become 0/1)."""
    return [v.astype(jnp.int32) for v in arrays]
