"""CostEstimate of the conv1d prefill kernel, from the shapes of its operands (`pl.CostEstimate`).

FLOPs: Kc multiply-adds a token and channel; with the SiLU, one sigmoid (a transcendental) and a multiply.
Bytes: x in, y out, the weights and bias, and each row's window read and final window written.
"""

from jax.experimental import pallas as pl

from pallas_kernels.estimates import cost, nbytes, rows_bytes


def conv1d(x, weight, bias, window_pool, num_rows: int, *, activation: bool) -> pl.CostEstimate:
    """`_conv1d_kernel` over x [T, D], weight [D, Kc], bias [D] and the window pool [S, Kc-1, D]."""
    elements = x.shape[0] * x.shape[1]
    flops = elements * (2 * weight.shape[1] + activation)
    moved = 2 * nbytes(x) + nbytes(weight, bias) + 2 * rows_bytes(window_pool, num_rows)
    return cost(flops, elements * activation, moved)
