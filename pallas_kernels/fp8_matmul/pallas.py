"""Pallas (Triton backend) matmul of activations x [M, in] with a block-scaled FP8 weight (layout: `reference`).

Grid: (M tile, out tile, K split). A program walks the weight's rows in steps of `block_k` rows: a step loads
x's [block_m, block_k] columns and the weight's [block_k, block_n] FP8 tile, casts the tile to x's dtype
(exact: e4m3 values fit f32, bf16 and fp16), dots them with f32 accumulation, multiplies the partial sums by
the row block's scales [block_n] and adds them to an f32 accumulator; the tile is stored in x's dtype.

Sub-blocks: a row block of `block` rows is walked in ceil(block / block_k) steps that all take its scale row,
block_k being a power of two (Triton tiles), at most the next power of two >= block and at least 16 (Triton's
smallest dot side). Where block_k does not divide the block (a per-tensor checkpoint's single block of all
`in` rows, `in` not a multiple of block_k), the last step of each block masks the rows past the block's end:
no copy of the weight is made. x columns past `in`, M rows past x's and out columns past the weight's are
masked the same way, so the launcher pads nothing.

K splits (split-K): with num_splits S > 1, split s walks the s-th of S equal runs of the steps and writes
its f32 partial sums; XLA adds the S partials and rounds once. A decode-sized M fills only out / block_n
programs, too few to read the weight at the GPU's bandwidth; splits multiply them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fp8_matmul import cost
from pallas_kernels.tiles import MIN_DOT_SIDE, Dots, check_dot_sides

TARGET_PROGRAMS = 512  # about four programs per SM of an H100/H200 (132 SMs)
MAX_SPLITS = 16
MIN_SPLIT_ROWS = 512  # weight rows a split walks at least: shorter runs spend more on their partials than they save


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_block_m(num_rows: int) -> int:
    """Dot rows per program: the next power of two >= M between 16 (Triton's smallest dot side) and 64."""
    return min(max(_next_pow2(num_rows), MIN_DOT_SIDE), 64)


def default_tiles(dtype) -> tuple[int, int]:
    """(block_n, block_k): 128 x 64 for 16-bit x (at most 200 registers a thread); 64 x 32 for f32, whose 3xTF32
    dots split each operand into two TF32 halves: 64 x 64 spilled a masked per-tensor block at M 1, 128 x 128
    every shape (ptxas for sm_90, `benchmarks/aot_kernels.py`)."""
    return (64, 32) if jnp.dtype(dtype) == jnp.float32 else (128, 64)


def clamp_tile(tile: int, size: int, name: str) -> int:
    """`tile` (a power of two) shrunk to the next power of two >= size, but not below 16: a tile no wider than
    the axis it cuts, and a legal dot side."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"{name}={tile} must be a power of two")
    return min(tile, max(_next_pow2(size), MIN_DOT_SIDE))


def default_num_splits(num_rows: int, programs: int, in_rows: int) -> int:
    """K splits that bring the grid towards TARGET_PROGRAMS, each walking at least MIN_SPLIT_ROWS weight rows, and
    whose f32 partials (written, then read by the merge: 8 S M bytes an output column) stay under a quarter of
    the weight's bytes (in_rows an output column): splits pay off only where M is small."""
    by_programs = TARGET_PROGRAMS // programs
    by_traffic = in_rows // (32 * num_rows)
    return max(1, min(by_programs, by_traffic, in_rows // MIN_SPLIT_ROWS, MAX_SPLITS))


def _all(*masks):
    """The conjunction of the masks that are not None (None: every element is in bounds, no mask)."""
    present = [m for m in masks if m is not None]
    return functools.reduce(jnp.logical_and, present) if present else None


def _fp8_matmul_kernel(
    x_ref,  # [M, in]
    kernel_ref,  # [blocks, block, out] float8_e4m3fn
    scale_ref,  # [blocks, out] f32
    out_ref,  # [M, out] in x's dtype; with splits, f32 partials [S, M, out]
    *, block_m: int, block_n: int, block_k: int, steps_per_block: int, steps_per_split: int, dots: Dots,
):  # fmt: skip
    i_m, i_n, i_split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_rows, in_features = x_ref.shape
    blocks, block, out_features = kernel_ref.shape
    m_rows = pl.ds(i_m * block_m, block_m)
    n_cols = pl.ds(i_n * block_n, block_n)
    # static: which edges need a mask at these shapes
    row_ok = (i_m * block_m + jnp.arange(block_m) < num_rows)[:, None] if num_rows % block_m else None
    col_ok = i_n * block_n + jnp.arange(block_n) < out_features if out_features % block_n else None
    rows_past_block = block % block_k != 0
    cols_past_in = rows_past_block or in_features != blocks * block

    def step(j, acc):
        b, k = j // steps_per_block, j % steps_per_block
        offsets = k * block_k + jnp.arange(block_k)  # weight rows within block b
        in_block = offsets < block if rows_past_block else None
        in_x = _all(in_block, b * block + offsets < in_features) if cols_past_in else None
        x_mask = _all(row_ok, None if in_x is None else in_x[None, :])
        x = plt.load(x_ref.at[m_rows, pl.ds(b * block + k * block_k, block_k)], mask=x_mask,
                     other=None if x_mask is None else 0.0)
        w_mask = _all(None if in_block is None else in_block[:, None], None if col_ok is None else col_ok[None, :])
        w = plt.load(kernel_ref.at[b, pl.ds(k * block_k, block_k), n_cols], mask=w_mask,
                     other=None if w_mask is None else 0.0)
        s = plt.load(scale_ref.at[b, n_cols], mask=col_ok, other=None if col_ok is None else 0.0)
        return acc + dots(x, w) * s[None, :]

    total = blocks * steps_per_block
    first = i_split * steps_per_split
    acc = jax.lax.fori_loop(first, jnp.minimum(first + steps_per_split, total), step,
                            jnp.zeros((block_m, block_n), jnp.float32))
    split = (i_split,) if len(out_ref.shape) == 3 else ()
    # One .at with every index: interpret mode mis-shapes a masked store through a chained .at.
    plt.store(out_ref.at[(*split, m_rows, n_cols)], acc.astype(out_ref.dtype),
              mask=_all(row_ok, None if col_ok is None else col_ok[None, :]))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def fp8_matmul(
    x: jax.Array, kernel: jax.Array, scale: jax.Array, *, block_m: int | None = None, block_n: int | None = None,
    block_k: int | None = None, num_splits: int | None = None, num_warps: int = 4, num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """x [M, in] @ (kernel [blocks, block, out] float8_e4m3fn scaled by scale [blocks, out]) -> [M, out] in x's dtype.

    block_m, block_n, block_k: dot rows, output columns and weight rows per step (powers of two, shrunk to the
      axis they cut: `clamp_tile`); None: `default_block_m`, `default_tiles`.
    num_splits: K splits (1: none); None: `default_num_splits`.
    num_warps, num_stages: Triton launch parameters.
    """
    (num_rows, in_features), (blocks, block, out_features) = x.shape, kernel.shape
    if scale.shape != (blocks, out_features):
        raise ValueError(f"scale {scale.shape} does not match kernel {kernel.shape}: want {(blocks, out_features)}")
    if not (blocks - 1) * block < in_features <= blocks * block:
        raise ValueError(f"x has {in_features} inputs; kernel {kernel.shape} holds {(blocks - 1) * block + 1} "
                         f"to {blocks * block}")
    block_m = clamp_tile(default_block_m(num_rows) if block_m is None else block_m, num_rows, "block_m")
    tiles = default_tiles(x.dtype)
    block_n = clamp_tile(tiles[0] if block_n is None else block_n, out_features, "block_n")
    block_k = clamp_tile(tiles[1] if block_k is None else block_k, block, "block_k")
    check_dot_sides(interpret, block_m=block_m, block_n=block_n, block_k=block_k)
    grid_m, grid_n = pl.cdiv(num_rows, block_m), pl.cdiv(out_features, block_n)
    steps_per_block = pl.cdiv(block, block_k)
    total = blocks * steps_per_block
    if num_splits is None:
        num_splits = default_num_splits(num_rows, grid_m * grid_n, blocks * block)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    steps_per_split = pl.cdiv(total, min(num_splits, total))
    num_splits = pl.cdiv(total, steps_per_split)  # every split walks at least one step
    out_shape = (num_rows, out_features) if num_splits == 1 else (num_splits, num_rows, out_features)
    out_dtype = x.dtype if num_splits == 1 else jnp.float32
    kernel_fn = functools.partial(
        _fp8_matmul_kernel, block_m=block_m, block_n=block_n, block_k=block_k, steps_per_block=steps_per_block,
        steps_per_split=steps_per_split, dots=Dots(x.dtype, interpret),
    )  # fmt: skip
    out = pl.pallas_call(
        kernel_fn,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(grid_m, grid_n, num_splits),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=cost.fp8_matmul(x, kernel, scale, num_splits),
        name=f"fp8_matmul_{block_m=}_{block_n=}_{block_k=}_{num_splits=}",
    )(x, kernel, scale)
    return out if num_splits == 1 else out.sum(axis=0).astype(x.dtype)

