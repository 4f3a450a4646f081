"""CostEstimate of the FP8 weight matmul kernel, from the shapes of its operands (`pl.CostEstimate`).

FLOPs: a multiply-add per (row of x, weight row, output column), the weight's zero padding rows included,
and the scaling: a multiply-add per (row of x, K step, output column), counted as one per row block. Bytes:
x, the FP8 weight and its scales read once (further M tiles re-read the weight's tiles from L2), and the
output written: in x's dtype, or S f32 partials with S K splits.
"""

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.estimates import cost, nbytes


def fp8_matmul(x, kernel, scale, num_splits: int) -> pl.CostEstimate:
    """`_fp8_matmul_kernel` over x [M, in], kernel [blocks, block, out] and scale [blocks, out]."""
    num_rows = x.shape[0]
    blocks, block, out_features = kernel.shape
    flops = 2 * num_rows * blocks * (block + 1) * out_features
    written = num_rows * out_features * (jnp.dtype(x.dtype).itemsize if num_splits == 1 else 4 * num_splits)
    return cost(flops, 0, nbytes(x, kernel, scale) + written)
