"""Matmuls with FP8 (e4m3) weights and float32 block scales, dequantized inside the jitted step.

A weight [in, out] is held as `kernel` [blocks, block, out] float8_e4m3fn (the input axis cut into row blocks
of `block`, the last one zero-padded) and `scale` [blocks, out] float32; a leading expert axis is allowed
(`dequantize`). Block-wise checkpoints (Qwen, 128 x 128) give one scale per block, which the loader repeats
over the block's columns, so that any column permutation of a weight (fused projections, the tensor-parallel
layout) applies to its scale unchanged; a per-tensor checkpoint (ModelOpt) is one block of all rows.

The reference runs as XLA's dot on the weight dequantized in float32 and rounded to the activation dtype
(`reference.matmul_dequantized`): it equals the dot of a checkpoint dequantized on the host, and XLA fuses the
dequantization into the dot's operand. The Pallas kernel (`pallas.fp8_matmul`) reads the FP8 weight and its
scales as they are and computes the block-scaled form, `reference.matmul_scaled`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.backend import resolve_backend
from pallas_kernels.fp8_matmul import pallas
from pallas_kernels.fp8_matmul.reference import dequantize, matmul_dequantized, matmul_scaled

__all__ = ["dequantize", "fp8_matmul", "matmul_scaled"]


def fp8_matmul(x: jax.Array, kernel: jax.Array, scale: jax.Array, *, backend: str | None = None) -> jax.Array:
    """x [..., in] @ (kernel [blocks, block, out] f8 scaled by scale [blocks, out]) -> [..., out] in x's dtype.

    backend: "reference" (the dequantized weight's dot in XLA), "pallas" or "interpret" (the kernel, on the
      rows of x flattened to [M, in]); None: pallas on GPU, reference elsewhere.
    """
    backend = resolve_backend(backend)
    if backend == "reference":
        return matmul_dequantized(x, kernel, scale)
    *lead, in_features = x.shape
    out_features = kernel.shape[-1]
    num_rows = math.prod(lead)
    if num_rows == 0:
        return jnp.zeros((*lead, out_features), x.dtype)
    # decode-sized and prefill-sized M get different tiles by default, so they are separate classes
    shape_class = tuning.shape_class(x.dtype, M=pallas.default_block_m(num_rows), K=in_features, N=out_features,
                                     B=kernel.shape[1])
    launch = tuning.for_launcher("fp8_matmul", pallas.fp8_matmul, shape_class, "block_m", "block_n", "block_k",
                                 "num_splits")
    y = pallas.fp8_matmul(x.reshape(num_rows, in_features), kernel, scale, interpret=backend == "interpret", **launch)
    return y.reshape(*lead, out_features)
