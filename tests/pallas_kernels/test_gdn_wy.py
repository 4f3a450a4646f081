"""The GDN prefill kernel's blocked WY maths (`pallas_kernels.gdn.wy`) on plain arrays against dense maths."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn.reference import unit_lower_inverse
from pallas_kernels.gdn.wy import BLOCK, block_cumsum, scaled_kkt, unit_lower_inverse_blocks
from pallas_kernels.tiles import Dots
from tests.tolerances import Float32

K = 16
CHUNKS = [16, 32, 64]
F32_DOTS = Dots(jnp.float32, interpret=True)  # on plain arrays: XLA:CPU's IEEE fp32


def _chunk(size, seed, near_identical_keys=False):
    """Normalised keys [C, K], beta and g [C] in the regime of the kernel tests; near-identical keys with
    beta = 1 and no decay make (I + A) nearly the all-ones lower triangle (the reference's hard case)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((size, K)).astype(np.float32)
    if near_identical_keys:
        k = k[:1] + 0.01 * k
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    if near_identical_keys:
        return k, np.ones(size, np.float32), np.zeros(size, np.float32)
    return k, rng.uniform(0, 1, size).astype(np.float32), -rng.exponential(0.5, size).astype(np.float32)


def _dense_a(k, beta, g):
    """A = StrictLower(diag(beta) K K^T . Gamma) in float64 (docs/kernels.md#gated-delta-rule, step 1)."""
    cum = np.cumsum(g.astype(np.float64))
    gamma = np.exp(np.tril(cum[:, None] - cum[None, :]))
    return np.tril(beta[:, None] * (k.astype(np.float64) @ k.T) * gamma, -1)


def _blocks(x):
    return [jnp.asarray(x[i : i + BLOCK]) for i in range(0, x.shape[0], BLOCK)]


def _lower_blocks(a):
    return [[jnp.asarray(a[i : i + BLOCK, j : j + BLOCK]) for j in range(0, i + 1, BLOCK)]
            for i in range(0, a.shape[0], BLOCK)]


def _dense(lower_blocks):
    n = len(lower_blocks)
    zero = np.zeros((BLOCK, BLOCK))
    return np.block([[np.asarray(row[j]) if j < len(row) else zero for j in range(n)] for row in lower_blocks])


@pytest.mark.parametrize("size", CHUNKS)
def test_scaled_kkt_blocks_equal_dense_a(size):
    k, beta, g = _chunk(size, seed=size)
    cum = block_cumsum(_blocks(g))
    Float32(depth=size).check(np.concatenate(cum), np.cumsum(g.astype(np.float64)))
    a = _dense(scaled_kkt(_blocks(k), _blocks(beta), cum, F32_DOTS))
    # Each entry: a K-term dot, the cumsum of up to C decays inside exp, two products.
    Float32(depth=K + size + 2).check(a, _dense_a(k, beta, g))


@pytest.mark.parametrize("near_identical_keys", [False, True])
@pytest.mark.parametrize("size", CHUNKS)
def test_blocked_inverse_equals_linalg_and_substitution(size, near_identical_keys):
    a = _dense_a(*_chunk(size, seed=size + 1, near_identical_keys=near_identical_keys)).astype(np.float32)
    inverse = _dense(unit_lower_inverse_blocks(_lower_blocks(a), F32_DOTS))
    exact = np.linalg.inv(np.eye(size) + a.astype(np.float64))
    # Row r of the inverse sums r products of earlier rows, each computed the same way: a chain of C rows of
    # C terms. The 16 x 16 merges regroup the same sums.
    tol = Float32(depth=2 * size)
    tol.check(inverse, exact)
    tol.check(inverse, unit_lower_inverse(jnp.asarray(a)))
    assert np.array_equal(inverse, np.tril(inverse))
