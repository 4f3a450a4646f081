"""Packed varlen tokens: which row and position each token has (`cu_seqlens`), per-row chunk tables, and moves
between packed [T, ...] tokens and chunk-major or row-major dense layouts."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


def check_rows(cu_seqlens: jax.Array, per_row: jax.Array, name: str) -> None:
    """Raise unless `per_row` has one entry per row of `cu_seqlens: [R+1]`."""
    if per_row.shape[0] != cu_seqlens.shape[0] - 1:
        num_rows = cu_seqlens.shape[0] - 1
        raise ValueError(f"{name} has {per_row.shape[0]} rows but cu_seqlens describes {num_rows}")


class TokenRows(NamedTuple):
    """Where each packed token lives.

    Tokens outside [cu_seqlens[0], cu_seqlens[-1]) are padding: row R, valid False. cu_seqlens[0] is 0
    except in the second phase of a grouped prefill, which skips the first rows' tokens.
    """

    rows: jax.Array  # [T] i32, in [0, R]
    positions: jax.Array  # [T] i32, index of the token inside its row
    valid: jax.Array  # [T] bool


def token_rows(cu_seqlens: jax.Array, num_tokens: int) -> TokenRows:
    """Row and in-row position of every packed token; `cu_seqlens: [R+1] i32`."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # side="right" skips zero-length rows: the last row starting at or before t owns t.
    rows = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    valid = (t >= cu_seqlens[0]) & (t < cu_seqlens[-1])
    rows = jnp.where(valid, rows, cu_seqlens.shape[0] - 1)
    return TokenRows(rows, t - cu_seqlens[rows], valid)


class ChunkTable(NamedTuple):
    """Per-row chunking of packed tokens: chunk j covers tokens [starts[j], starts[j] + lengths[j]).

    Each row is cut into chunks from its own first token, so no chunk straddles two rows (FLA
    `prepare_chunk_indices`). Surplus chunks beyond the real ones have length 0 and row R.
    """

    rows: jax.Array  # [NC] i32, in [0, R]
    starts: jax.Array  # [NC] i32
    offsets: jax.Array  # [NC] i32, index of the chunk's first token inside its row
    lengths: jax.Array  # [NC] i32, in [0, C]
    first: jax.Array  # [NC] bool, first chunk of its row
    token_chunk: jax.Array  # [T] i32, chunk holding each token (clipped for padding tokens)
    token_offset: jax.Array  # [T] i32, position of each token inside its chunk
    token_valid: jax.Array  # [T] bool, False for padding tokens

    def block(self, first: jax.Array, size: int) -> "ChunkTable":
        """Chunks [first, first + size); the token fields unchanged."""
        cut = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=size)
        return self._replace(rows=cut(self.rows), starts=cut(self.starts), offsets=cut(self.offsets),
                             lengths=cut(self.lengths), first=cut(self.first))


def max_num_chunks(num_tokens: int, num_rows: int, chunk_size: int) -> int:
    # Each non-empty row wastes at most one partial chunk (none when chunks are single tokens).
    return num_tokens // chunk_size + (min(num_rows, num_tokens) if chunk_size > 1 else 0)


def chunk_table(cu_seqlens: jax.Array, num_tokens: int, chunk_size: int, multiple_of: int = 1) -> ChunkTable:
    """Static-size chunk table for `cu_seqlens: [R+1] i32` over a bucket of T tokens, its length rounded up to a
    multiple of `multiple_of` (blocks of chunks, see `carry_chunks`)."""
    num_rows = cu_seqlens.shape[0] - 1
    num_chunks = -(-max_num_chunks(num_tokens, num_rows, chunk_size) // multiple_of) * multiple_of
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    row_chunks = (lengths + chunk_size - 1) // chunk_size
    chunk_offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(row_chunks).astype(jnp.int32)])
    j = jnp.arange(num_chunks, dtype=jnp.int32)
    rows = jnp.searchsorted(chunk_offsets, j, side="right").astype(jnp.int32) - 1
    index_in_row = j - chunk_offsets[rows]
    starts = cu_seqlens[rows] + index_in_row * chunk_size
    ends = cu_seqlens[jnp.minimum(rows + 1, num_rows)]
    chunk_lengths = jnp.where(rows < num_rows, jnp.clip(ends - starts, 0, chunk_size), 0)
    tok = token_rows(cu_seqlens, num_tokens)
    token_chunk = jnp.minimum(chunk_offsets[tok.rows] + tok.positions // chunk_size, num_chunks - 1)
    return ChunkTable(
        rows,
        starts,
        index_in_row * chunk_size,
        chunk_lengths,
        index_in_row == 0,
        token_chunk,
        tok.positions % chunk_size,
        tok.valid,
    )


def gather_chunks(x: jax.Array, table: ChunkTable, chunk_size: int) -> jax.Array:
    """[T, ...] -> [NC, C, ...]; positions past a chunk's length are zero."""
    offsets = jnp.arange(chunk_size, dtype=jnp.int32)
    index = jnp.minimum(table.starts[:, None] + offsets, x.shape[0] - 1)
    mask = offsets < table.lengths[:, None]
    gathered = x[index]
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), gathered, 0)


def scatter_chunks(y: jax.Array, table: ChunkTable) -> jax.Array:
    """[NC, C, ...] -> [T, ...]; padding tokens get zeros."""
    out = y[table.token_chunk, table.token_offset]
    valid = table.token_valid
    return jnp.where(valid.reshape(valid.shape + (1,) * (out.ndim - 1)), out, 0)


def zero_padding(y: jax.Array, cu_seqlens: jax.Array, dtype) -> jax.Array:
    """[T, ...] -> dtype with padding tokens zeroed: kernels never store them (uninitialised memory)."""
    valid = token_rows(cu_seqlens, y.shape[0]).valid
    return jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, 0).astype(dtype)


def rows_to_dense(x: jax.Array, cu_seqlens: jax.Array, width: int) -> jax.Array:
    """Packed [T, ...] -> [R, width, ...], row r's tokens first, zeros after (rows must be <= width long)."""
    offsets = jnp.arange(width, dtype=jnp.int32)
    index = jnp.minimum(cu_seqlens[:-1, None] + offsets, x.shape[0] - 1)
    mask = offsets < (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - 1)), x[index], 0)


def dense_to_rows(y: jax.Array, cu_seqlens: jax.Array, num_tokens: int) -> jax.Array:
    """[R, width, ...] -> packed [T, ...]; padding tokens get zeros."""
    tok = token_rows(cu_seqlens, num_tokens)
    rows = jnp.minimum(tok.rows, y.shape[0] - 1)
    out = y[rows, jnp.clip(tok.positions, 0, y.shape[1] - 1)]
    return jnp.where(tok.valid.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0)


def checkpoint_counts(table: ChunkTable, checkpoint_lens: jax.Array, num_rows: int) -> jax.Array:
    """[NC] i32: tokens of each chunk before its row's checkpoint, 0 where the checkpoint is not in it."""
    count = checkpoint_lens[jnp.minimum(table.rows, num_rows - 1)] - table.offsets
    return jnp.where((count >= 1) & (count <= table.lengths), count, 0)


def real_blocks(table: ChunkTable, num_rows: int, block: int) -> jax.Array:
    """Blocks of `block` chunks that hold some row's chunks: a table lists its rows' chunks first, then padding."""
    return -(-jnp.sum(table.rows < num_rows) // block)


def repeat_heads(x: jax.Array, num_heads: int, axis: int) -> jax.Array:
    """GVA/GQA expansion: head h reads source head h // (num_heads // x.shape[axis])."""
    return jnp.repeat(x, num_heads // x.shape[axis], axis=axis)
