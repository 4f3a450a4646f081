"""Block-scaled FP8 weights in XLA: dequantize per block then one dot, or one dot per block scaled after.

Layout: `kernel` [..., blocks, block, out] float8_e4m3fn holds a weight [in, out] (rows past `in`, the
padding of a partial last block, are zero) and `scale` [..., blocks, out] float32 the scale of each
(row block, column): weight[i, o] = kernel[i // block, i % block, o] * scale[i // block, o].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dequantize(kernel: jax.Array, scale: jax.Array, in_features: int, dtype: jnp.dtype) -> jax.Array:
    """The weight [..., in_features, out] in `dtype`: each FP8 value times its block's scale in float32, then
    rounded once to `dtype` (as a checkpoint dequantized on the host and stored in `dtype` holds it)."""
    *lead, blocks, block, out = kernel.shape
    weight = kernel.astype(jnp.float32) * scale[..., :, None, :]
    return weight.reshape(*lead, blocks * block, out)[..., :in_features, :].astype(dtype)


def matmul_dequantized(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., in] @ the dequantized weight -> [..., out] in x's dtype."""
    return jnp.dot(x, dequantize(kernel, scale, x.shape[-1], x.dtype))


def matmul_scaled(x: jax.Array, kernel: jax.Array, scale: jax.Array) -> jax.Array:
    """The same product as one dot per row block on the FP8 values (exact in float32 and bf16), each
    block's float32 partial sums scaled per column, then summed: the weight is never formed."""
    blocks, block, out = kernel.shape
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block - x.shape[-1])])
    parts = jnp.einsum("...nb,nbo->...no", padded.reshape(*x.shape[:-1], blocks, block), kernel.astype(x.dtype),
                       preferred_element_type=jnp.float32)
    return jnp.sum(parts * scale, axis=-2).astype(x.dtype)
