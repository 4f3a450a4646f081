"""Matmuls with FP8 (e4m3) weights and float32 block scales, dequantized inside the jitted step.

A weight [in, out] is held as `kernel` [blocks, block, out] float8_e4m3fn (the input axis cut into row blocks
of `block`, the last one zero-padded) and `scale` [blocks, out] float32; a leading expert axis is allowed
(`dequantize`). Block-wise checkpoints (Qwen, 128 x 128) give one scale per block, which the loader repeats
over the block's columns, so that any column permutation of a weight (fused projections, the tensor-parallel
layout) applies to its scale unchanged; a per-tensor checkpoint (ModelOpt) is one block of all rows.

The product runs as XLA's dot on the weight dequantized in float32 and rounded to the activation dtype
(`reference.matmul_dequantized`): it equals the dot of a checkpoint dequantized on the host, and XLA fuses the
dequantization into the dot's operand. `reference.matmul_scaled` is the block-scaled form of the same
product, the reference for a fused kernel.
"""

from __future__ import annotations

import jax

from pallas_kernels.fp8_matmul.reference import dequantize, matmul_dequantized, matmul_scaled

__all__ = ["dequantize", "fp8_matmul", "matmul_scaled"]


def fp8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., in] @ (kernel [blocks, block, out] f8 scaled by scale [blocks, out]) -> [..., out] in x's dtype."""
    return matmul_dequantized(x, kernel, scale)
