"""Routed experts: each token runs through its top-k experts only, as a grouped matmul over tiles.

The `T × k` (token, expert) assignments are sorted by expert and laid out in tiles of `tile` rows, each tile
holding rows of one expert (an expert's last tile is padded with zero rows). A tile's expert weights are
gathered and multiplied with its rows; the outputs are weighted and added back to their tokens. Every
shape is static: at most `(T k + min(E, T k) (tile - 1)) / tile` tiles are used, so the cost grows with
`T k`, and with the number of experts `E` only through the padding of at most one tile per routed expert.

The tile is chosen per shape from a roofline (`choose_tile`): one-row tiles when decoding a few tokens
(each assignment reads its expert's weights once, nothing is padded), taller tiles when many tokens share
an expert (each expert's weights are read once per tile). Tiles are processed in chunks whose gathered
weights stay within `GATHER_BUDGET_BYTES`; a shape that fits in one chunk has no loop, so XLA's
`cost_analysis` of it is complete. `dense_experts` is the reference: every expert for every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

GATHER_BUDGET_BYTES = 256 * 2**20  # gathered expert weights per chunk of tiles
MAX_TILE = 1024
# Flops per byte at which a tile's matmul stops being bound by reading its weights (the machine balance):
# H100/H200 run ~989 TFLOP/s of dense bf16 against ~3.4-4.8 TB/s. On XLA:CPU a tile's weights are gathered
# (copied) and packed again for the batched matmul, so a tile costs as much as ~128 of its rows: measured on
# 2 cores in bf16 (E 8, top 2, 512 x 256 experts), 1024 tokens take 77 ms a layer in tiles of 8 rows and
# 8.8 ms in tiles of 128; 512 tokens 40 ms and 6-8 ms.
MACHINE_BALANCE = {"gpu": 200.0, "cpu": 128.0}


class ExpertWeights(NamedTuple):
    """Stacked expert weights: up `[E, d, I]`, down `[E, I, d]`, gate `[E, d, I]` for a gated (SwiGLU) MLP."""

    up: jax.Array
    down: jax.Array
    gate: jax.Array | None = None


class Tiling(NamedTuple):
    tile: int        # rows per tile
    num_tiles: int   # tiles laid out (a multiple of `chunk`), at least the most a routing can use
    chunk: int       # tiles per step of the loop over tiles


def max_tiles(num_assignments: int, num_experts: int, tile: int) -> int:
    """The most tiles a routing can use: each routed expert pads at most `tile - 1` rows."""
    return (num_assignments + min(num_experts, num_assignments) * (tile - 1)) // tile


def choose_tile(num_assignments: int, num_experts: int, weight_bytes: int, row_flops: int, balance: float) -> int:
    """The power-of-two tile with the least roofline time: tiles' rows × `row_flops` at `balance` flops per
    byte against tiles × `weight_bytes` (one expert's weights, read once per tile)."""
    def time(tile: int) -> float:
        tiles = max_tiles(num_assignments, num_experts, tile)
        return max(tiles * tile * row_flops / balance, tiles * weight_bytes)

    candidates = [1 << i for i in range(MAX_TILE.bit_length()) if 1 << i <= max(num_assignments, 1)]
    return min(candidates, key=lambda tile: (time(tile), tile))


def plan_tiles(num_assignments: int, weights: ExpertWeights, platform: str, tile: int | None = None) -> Tiling:
    """The tiling for `num_assignments` rows on `platform` ("cpu", "gpu"); `tile` overrides the choice."""
    num_experts, dim, inter = weights.up.shape
    matrices = 2 if weights.gate is None else 3
    weight_bytes = matrices * dim * inter * weights.up.dtype.itemsize
    tile = tile or choose_tile(num_assignments, num_experts, weight_bytes, 2 * matrices * dim * inter,
                               MACHINE_BALANCE.get(platform, MACHINE_BALANCE["cpu"]))
    tiles = max(max_tiles(num_assignments, num_experts, tile), 1)
    chunk = max(1, min(tiles, GATHER_BUDGET_BYTES // weight_bytes))
    return Tiling(tile, -(-tiles // chunk) * chunk, chunk)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, params: ExpertWeights,
                   activation: Callable[[jax.Array], jax.Array], tiling: Tiling | None = None) -> jax.Array:
    """`sum_j weights[t, j] expert_{experts[t, j]}(x[t])` for x `[T, d]`, weights and experts `[T, k]`.

    A gated expert is `down(activation(gate(x)) * up(x))`, a plain one `down(activation(up(x)))`. `tiling`
    defaults to `plan_tiles` for this shape on the default backend."""
    num_tokens, top_k = experts.shape
    num_experts, dim = params.up.shape[:2]
    tiling = tiling or plan_tiles(num_tokens * top_k, params, jax.default_backend())
    rows, tile_experts = _layout(experts.reshape(-1), num_experts, tiling)
    tokens = jnp.arange(num_tokens * top_k) // top_k
    tiled = jnp.zeros((tiling.num_tiles * tiling.tile, dim), x.dtype).at[rows].set(x[tokens])
    tiled = tiled.reshape(tiling.num_tiles // tiling.chunk, tiling.chunk, tiling.tile, dim)
    tile_experts = tile_experts.reshape(-1, tiling.chunk)

    def run_chunk(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        chunk_rows, chunk_experts = args
        gathered = lambda stacked: stacked[chunk_experts].astype(x.dtype)  # cast after the gather: k, not E
        hidden = jnp.einsum("cmd,cdi->cmi", chunk_rows, gathered(params.up))
        if params.gate is not None:
            hidden = activation(jnp.einsum("cmd,cdi->cmi", chunk_rows, gathered(params.gate))) * hidden
        else:
            hidden = activation(hidden)
        return jnp.einsum("cmi,cid->cmd", hidden, gathered(params.down))

    if tiled.shape[0] == 1:  # one chunk: no loop, so XLA's cost analysis sees every flop
        out = run_chunk((tiled[0], tile_experts[0]))[None]
    else:
        out = jax.lax.map(run_chunk, (tiled, tile_experts))
    per_assignment = out.reshape(-1, dim)[rows].astype(jnp.float32) * weights.reshape(-1, 1).astype(jnp.float32)
    return jnp.zeros((num_tokens, dim), jnp.float32).at[tokens].add(per_assignment).astype(x.dtype)


def _layout(experts: jax.Array, num_experts: int, tiling: Tiling) -> tuple[jax.Array, jax.Array]:
    """Each assignment's row in the tiled layout (grouped by expert, in assignment order within a group), and
    each tile's expert (tiles past the last used one repeat an expert; their rows are zero)."""
    tile = tiling.tile
    sizes = jnp.bincount(experts, length=num_experts)
    group_starts = jnp.cumsum(sizes) - sizes
    tile_ends = jnp.cumsum(-(-sizes // tile))
    tile_starts = tile_ends - -(-sizes // tile)
    order = jnp.argsort(experts, stable=True)
    rank = jnp.zeros_like(experts).at[order].set(jnp.arange(experts.shape[0]))  # position in the sorted order
    rows = tile_starts[experts] * tile + rank - group_starts[experts]
    tile_experts = jnp.searchsorted(tile_ends, jnp.arange(tiling.num_tiles), side="right")
    return rows, jnp.minimum(tile_experts, num_experts - 1)


def dense_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, params: ExpertWeights,
                  activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The reference: every expert for every token, combined with zero weight for the unrouted ones."""
    num_tokens, num_experts = x.shape[0], params.up.shape[0]
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], experts].add(weights.astype(jnp.float32))
    hidden = jnp.einsum("td,edi->tei", x, params.up.astype(x.dtype))
    if params.gate is not None:
        hidden = activation(jnp.einsum("td,edi->tei", x, params.gate.astype(x.dtype))) * hidden
    else:
        hidden = activation(hidden)
    return jnp.einsum("tei,eid,te->td", hidden, params.down.astype(x.dtype), combine.astype(x.dtype))
