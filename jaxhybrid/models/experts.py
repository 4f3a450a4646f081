"""Routed experts: each token runs through its top-k experts only.

The `T × k` (token, expert) assignments are grouped by expert in one of two static layouts:

- **capacity**: `capacity` rows per expert, `[E, capacity, d]`, multiplied with the stacked weights as they
  are (one batched matmul, no weight copies). It holds a routing only when no expert gets more than
  `capacity` assignments; a routing that overflows runs the tiled layout instead (a `lax.cond`, so the
  result is exact for any routing). The capacity is the mean load plus four of its Poisson deviations, so
  a balanced router overflows rarely; at `capacity == T` no routing can overflow and there is no fallback.
- **tiles**: tiles of `tile` rows, each holding rows of one expert (an expert's last tile is padded with
  zero rows); a tile's expert weights are gathered and multiplied with its rows. At most
  `(T k + min(E, T k) (tile - 1)) / tile` tiles are used, so the cost grows with `T k`, and with `E` only
  through the padding of at most one tile per routed expert.

`plan_experts` picks the layout and the tile per shape from a roofline with measured constants
(`MACHINE`): the smallest tiles when decoding a few tokens among many experts (each assignment reads its
expert's weights once; one row, two for 16-bit weights on CPU), capacity when every expert is busy anyway
(its weights are read once, in place).
Tiles are processed in chunks whose gathered weights stay within `GATHER_BUDGET_BYTES`; a shape that fits
in one chunk has no loop, so XLA's `cost_analysis` of it is complete. `dense_experts` is the reference:
every expert for every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul import dequantize

GATHER_BUDGET_BYTES = 256 * 2**20  # gathered expert weights per chunk of tiles
MAX_TILE = 1024
OVERFLOW_DEVIATIONS = 4  # capacity = mean load + this many sqrt(mean load)


class Machine(NamedTuple):
    """A platform's roofline for expert matmuls."""

    balance: float  # flops per byte of expert weights at which a matmul stops being bound by reading them
    bf16_min_rows: int  # the fewest rows worth multiplying with a 16-bit expert
    f32_result_rows: int  # up to this many rows per expert a 16-bit matmul runs faster with an f32 result, rounded


# H100/H200: ~989 TFLOP/s of dense bf16 against ~3.4-4.8 TB/s. XLA:CPU, 2 cores, bf16, 512 x 256 experts
# (docs/benchmarks.md#where-a-cpu-decode-step-goes): an expert's weights cost about 32 rows of its matmul,
# gathered or in place; a one-row bf16 matmul becomes a convert of the whole weight to f32, so tiles hold 2+ rows.
# A bf16 batched matmul with a bf16 result is slow on XLA:CPU at few rows per expert; asking for f32 and rounding
# gives the same bits sooner, up to about 256 rows per expert.
MACHINE = {"gpu": Machine(balance=200.0, bf16_min_rows=1, f32_result_rows=0),
           "cpu": Machine(balance=32.0, bf16_min_rows=2, f32_result_rows=256)}


class ExpertWeights(NamedTuple):
    """Stacked expert weights: up `[E, d, I]`, down `[E, I, d]`, gate `[E, d, I]` for a gated (SwiGLU) MLP.

    An FP8 checkpoint's are float8 `[E, blocks, block, out]` with float32 scales `[E, blocks, out]`
    (`pallas_kernels.fp8_matmul`), dequantized only for the experts a step multiplies with."""

    up: jax.Array
    down: jax.Array
    gate: jax.Array | None = None
    up_scale: jax.Array | None = None
    down_scale: jax.Array | None = None
    gate_scale: jax.Array | None = None

    @property
    def sizes(self) -> tuple[int, int, int]:
        """(experts E, model width d, intermediate width I)."""
        return self.up.shape[0], self.down.shape[-1], self.up.shape[-1]

    def dequantized(self, dtype: jnp.dtype) -> ExpertWeights:
        """The weights in `dtype`, FP8 ones dequantized by their scales."""
        _, dim, inter = self.sizes
        full = lambda w, scale, rows: w.astype(dtype) if scale is None else dequantize(w, scale, rows, dtype)
        gate = None if self.gate is None else full(self.gate, self.gate_scale, dim)
        return ExpertWeights(full(self.up, self.up_scale, dim), full(self.down, self.down_scale, inter), gate)


class Tiling(NamedTuple):
    tile: int          # rows per tile
    num_tiles: int     # tiles laid out (a multiple of `chunk`), at least the most a routing can use
    chunk: int         # tiles per step of the loop over tiles
    capacity: int = 0  # rows per expert of the capacity layout, tried first; 0: tiles only
    f32_result_rows: int = 0  # `Machine.f32_result_rows`


def max_tiles(num_assignments: int, num_experts: int, tile: int) -> int:
    """The most tiles a routing can use: each routed expert pads at most `tile - 1` rows."""
    return (num_assignments + min(num_experts, num_assignments) * (tile - 1)) // tile


def expert_capacity(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per expert that a balanced routing rarely overflows, never more than `num_tokens` (no token picks
    an expert twice, so `num_tokens` rows hold every routing)."""
    mean = num_tokens * top_k / num_experts
    return min(num_tokens, math.ceil(mean + OVERFLOW_DEVIATIONS * math.sqrt(mean)))


def plan_experts(num_tokens: int, top_k: int, weights: ExpertWeights, platform: str, tile: int | None = None,
                 capacity: int | None = None) -> Tiling:
    """The layouts for `num_tokens` tokens of `top_k` experts on `platform` ("cpu", "gpu"), costed in rows of a
    matmul: every tile, and every expert of the capacity layout, costs its rows plus reading its expert's
    weights. `tile` and `capacity` (0: tiles only) override the choices."""
    num_experts, dim, inter = weights.sizes
    machine = MACHINE.get(platform, MACHINE["cpu"])
    matrices = 2 if weights.gate is None else 3
    weight_bytes = matrices * dim * inter * weights.up.dtype.itemsize
    weight_rows = weight_bytes * machine.balance / (2 * matrices * dim * inter)  # a row: 2 flops a weight
    min_rows = machine.bf16_min_rows if weights.up.dtype.itemsize < 4 else 1
    assignments = num_tokens * top_k

    def tiled_cost(tile: int) -> float:
        return max_tiles(assignments, num_experts, tile) * (tile + weight_rows)

    candidates = [1 << i for i in range(MAX_TILE.bit_length()) if min_rows <= 1 << i <= max(assignments, min_rows)]
    tile = tile or min(candidates, key=lambda t: (tiled_cost(t), t))
    if capacity is None:
        fits = max(expert_capacity(num_tokens, top_k, num_experts), min_rows)
        capacity = fits if num_experts * (fits + weight_rows) < tiled_cost(tile) else 0
    tiles = max(max_tiles(assignments, num_experts, tile), 1)
    chunk = max(1, min(tiles, GATHER_BUDGET_BYTES // weight_bytes))
    return Tiling(tile, -(-tiles // chunk) * chunk, chunk, capacity, machine.f32_result_rows)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, params: ExpertWeights,
                   activation: Callable[[jax.Array], jax.Array], tiling: Tiling | None = None,
                   platform: str | None = None) -> jax.Array:
    """`sum_j weights[t, j] expert_{experts[t, j]}(x[t])` for x `[T, d]`, weights and experts `[T, k]`.

    A gated expert is `down(activation(gate(x)) * up(x))`, a plain one `down(activation(up(x)))`. `tiling`
    defaults to `plan_experts` for this shape on `platform` (None: the default backend's)."""
    num_tokens, top_k = experts.shape
    tiling = tiling or plan_experts(num_tokens, top_k, params, platform or jax.default_backend())
    flat = experts.reshape(-1)
    tokens = jnp.arange(num_tokens * top_k) // top_k
    rows = x[tokens]  # one per assignment
    sizes, within = _group_positions(flat, params.sizes[0])
    mlp = lambda grouped, stacked: _expert_mlp(grouped, stacked, activation, x.dtype, tiling.f32_result_rows)
    tiled = lambda: _tiled(rows, flat, sizes, within, params, mlp, tiling)
    by_capacity = lambda: _by_capacity(rows, flat, within, params, mlp, tiling.capacity)
    if tiling.capacity == 0:
        per_assignment = tiled()
    elif tiling.capacity >= num_tokens:  # holds every routing
        per_assignment = by_capacity()
    else:
        per_assignment = jax.lax.cond(jnp.max(sizes) <= tiling.capacity, by_capacity, tiled)
    weighted = per_assignment.astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[tokens].add(weighted).astype(x.dtype)


def _expert_mlp(rows: jax.Array, stacked: ExpertWeights, activation: Callable, dtype,
                f32_result_rows: int) -> jax.Array:
    """rows `[G, m, d]` through experts `stacked` `[G, ...]` -> `[G, m, d]`."""
    result = jnp.float32 if rows.shape[1] <= f32_result_rows else dtype
    # a no-op in the serving dtype; tiles cast (or dequantize) their k gathered experts, not E
    stacked = stacked.dequantized(dtype)

    def dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum(spec, x, w, preferred_element_type=result).astype(dtype)

    hidden = dot("gmd,gdi->gmi", rows, stacked.up)
    if stacked.gate is not None:
        hidden = activation(dot("gmd,gdi->gmi", rows, stacked.gate)) * hidden
    else:
        hidden = activation(hidden)
    return dot("gmi,gid->gmd", hidden, stacked.down)


def _group_positions(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Assignments per expert `[E]`, and each assignment's position among its expert's (in assignment order)."""
    sizes = jnp.bincount(experts, length=num_experts)
    order = jnp.argsort(experts, stable=True)
    rank = jnp.zeros_like(experts).at[order].set(jnp.arange(experts.shape[0]))  # position in the sorted order
    return sizes, rank - (jnp.cumsum(sizes) - sizes)[experts]


def _by_capacity(rows: jax.Array, experts: jax.Array, within: jax.Array, params: ExpertWeights, mlp: Callable,
                 capacity: int) -> jax.Array:
    """Each assignment's expert output through the `[E, capacity, d]` layout (no expert over capacity)."""
    num_experts, dim, _ = params.sizes
    index = experts * capacity + within
    grouped = jnp.zeros((num_experts * capacity, dim), rows.dtype).at[index].set(rows)
    return mlp(grouped.reshape(num_experts, capacity, dim), params).reshape(-1, dim)[index]


def _tiled(rows: jax.Array, experts: jax.Array, sizes: jax.Array, within: jax.Array, params: ExpertWeights,
           mlp: Callable, tiling: Tiling) -> jax.Array:
    """Each assignment's expert output through one-expert tiles, their weights gathered chunk by chunk."""
    tile, dim = tiling.tile, rows.shape[1]
    tile_ends = jnp.cumsum(-(-sizes // tile))
    index = (tile_ends - -(-sizes // tile))[experts] * tile + within
    # tiles past the last used one repeat an expert; their rows are zero
    tile_experts = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(tiling.num_tiles), side="right"),
                               params.sizes[0] - 1).reshape(-1, tiling.chunk)
    grouped = jnp.zeros((tiling.num_tiles * tile, dim), rows.dtype).at[index].set(rows)
    grouped = grouped.reshape(-1, tiling.chunk, tile, dim)
    run_chunk = lambda args: mlp(args[0], jax.tree.map(lambda w: w[args[1]], params))
    if grouped.shape[0] == 1:  # one chunk: no loop, so XLA's cost analysis sees every flop
        out = run_chunk((grouped[0], tile_experts[0]))[None]
    else:
        out = jax.lax.map(run_chunk, (grouped, tile_experts))
    return out.reshape(-1, dim)[index]


def dense_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, params: ExpertWeights,
                  activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The reference: every expert for every token, combined with zero weight for the unrouted ones."""
    num_tokens, num_experts = x.shape[0], params.sizes[0]
    params = params.dequantized(x.dtype)
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], experts].add(weights.astype(jnp.float32))
    hidden = jnp.einsum("td,edi->tei", x, params.up)
    if params.gate is not None:
        hidden = activation(jnp.einsum("td,edi->tei", x, params.gate)) * hidden
    else:
        hidden = activation(hidden)
    return jnp.einsum("tei,eid,te->td", hidden, params.down, combine.astype(x.dtype))
