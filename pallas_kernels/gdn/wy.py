"""The intra-chunk WY/UT maths of GDN prefill (docs/kernels.md#gated-delta-rule, steps 1-3) on 16-row blocks.

A chunk of C tokens is handled as n = C / 16 row blocks, each an in-register [16, ...] tile: the Triton
backend cannot index rows of a tile, and 16 is the smallest dot it accepts. A lower triangular [C, C]
matrix is the ragged list m[i][j], j <= i, of its 16 x 16 blocks. (I + A)^-1 is FLA's `solve_tril`: the
diagonal blocks by forward substitution, all n in one 15-step loop, then the blocks below by dots, so the
serial depth is 15 steps rather than C - 1. Plain jnp on values: it runs inside a kernel and, in tests, on
ordinary arrays.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.tiles import Dots

BLOCK = 16
_f32 = jnp.float32


def dot_nt(a, b, dots: Dots):
    """a b^T without materializing b^T."""
    return dots(a, b, ((1,), (1,)))


def dot_tn(a, b, dots: Dots):
    """a^T b without materializing a^T."""
    return dots(a, b, ((0,), (0,)))


def block_cumsum(g_blocks):
    """Inclusive cumsum G of the chunk's log-decays, block by block: [16] blocks in, [16] blocks out."""
    cums, total = [], 0.0
    for g in g_blocks:
        cums.append(total + jnp.cumsum(g))
        total = total + jnp.sum(g)
    return cums


def _tile_iota():
    rows = jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
    return rows, jax.lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)


def scaled_kkt(k_blocks, beta_blocks, cum_blocks, dots: Dots):
    """Blocks of A = StrictLower(diag(beta) (K K^T) . Gamma), Gamma_ij = exp(G_i - G_j) (step 1), f32.

    k_blocks: [16, K] (normalised keys, dotted by `dots`: in the activation dtype, as FLA casts w, h, v_new and
    A^-1 to the input dtype before each `tl.dot`); beta_blocks, cum_blocks: [16] f32.
    """
    rows, cols = _tile_iota()
    a = []
    for i, (k_i, beta_i, cum_i) in enumerate(zip(k_blocks, beta_blocks, cum_blocks, strict=True)):
        row = []
        for j in range(i + 1):
            exponent = cum_i[:, None] - cum_blocks[j][None, :]
            if j == i:  # mask before exp: G_i - G_j > 0 above the diagonal and may overflow
                exponent = jnp.where(rows >= cols, exponent, -jnp.inf)
            block = beta_i[:, None] * dot_nt(k_i, k_blocks[j], dots) * jnp.exp(exponent)
            row.append(jnp.where(rows > cols, block, 0.0) if j == i else block)
        a.append(row)
    return a


def _invert_diagonal(blocks):
    """(I + a)^-1 of strictly lower [16, 16] blocks by forward substitution, all blocks in one loop.

    Row r of the inverse is e_r - a_r X, X's rows above r being final (the reference's
    `unit_lower_inverse`, on a tuple of tiles so the blocks' 15 serial steps overlap).
    """
    rows, cols = _tile_iota()
    eye = (rows == cols).astype(_f32)

    def substitute(r, inverses):
        out = []
        for a, x in zip(blocks, inverses, strict=True):
            a_r = jnp.sum(jnp.where(rows == r, a, 0.0), axis=0)  # row r of a: [16]
            out.append(jnp.where(rows == r, eye - jnp.sum(a_r[:, None] * x, axis=0)[None, :], x))
        return tuple(out)

    return list(jax.lax.fori_loop(1, BLOCK, substitute, (eye,) * len(blocks)))


def unit_lower_inverse_blocks(a, dots: Dots):
    """Blocks of (I + A)^-1 for the strictly lower A given as blocks a[i][j], j <= i (f32, dotted by `dots.f32`).

    Block row i of (I + A) X = I below the diagonal reads (I + A_ii) X_ij + sum_{j <= m < i} A_im X_mj = 0,
    so X_ij = -X_ii sum_m A_im X_mj from the blocks of earlier rows (FLA `merge_16x16_to_64x64_inverse`).
    """
    diagonal = _invert_diagonal([row[-1] for row in a])
    inverse = []
    for i, row in enumerate(a):
        below = [
            -dots.f32(diagonal[i], sum(dots.f32(row[m], inverse[m][j]) for m in range(j, i))) for j in range(i)
        ]
        inverse.append(below + [diagonal[i]])
    return inverse


def lower_times(m, x_blocks, dots: Dots):
    """Blocks of M X for lower triangular blocks m[i][j] and [16, N] blocks of X, dotted by `dots`."""
    return [sum(dots(m_ij, x_blocks[j]) for j, m_ij in enumerate(row)) for row in m]
