"""Index maths shared by every op: packed varlen tokens (`cu_seqlens`), chunk tables, slot pools, rings."""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# fp32 references must not silently drop to TF32/bf16 passes on GPU.
HIGHEST = jax.lax.Precision.HIGHEST


TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def dot_precision(dtype, interpret: bool, f32_on_gpu=TF32X3) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset:
    """In-kernel dot precision for operands of `dtype`, always accumulated in f32.

    bf16/fp16 operands run at DEFAULT, on tensor cores (HIGHEST would upcast them to fp32 passes). f32 operands
    run as `f32_on_gpu` on Triton: by default 3xTF32, three tensor-core passes over operands split into high
    and low TF32 halves, close to fp32's accuracy, where IEEE fp32 dots (HIGHEST) are FMA loops whose operands
    fill the registers and spill at GDN's and SSD's prefill tiles (`benchmarks/aot_kernels.py`). Interpret mode
    runs XLA:CPU, which has no TF32: IEEE fp32, as the references.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return jax.lax.Precision.DEFAULT
    return HIGHEST if interpret else f32_on_gpu


class Dots(NamedTuple):
    """What a kernel's dots need to know: their operands' dtype, whether the kernel is interpreted, and how f32
    operands run on Triton (`dot_precision`)."""

    dtype: Any
    interpret: bool
    f32_on_gpu: Any = TF32X3

    def __call__(self, a, b, contract=((1,), (0,))):
        """a @ b (contracting `contract`) on operands cast to this dtype, accumulated in f32."""
        return jax.lax.dot_general(a.astype(self.dtype), b.astype(self.dtype), (contract, ((), ())),
                                   precision=dot_precision(self.dtype, self.interpret, self.f32_on_gpu),
                                   preferred_element_type=jnp.float32)

    @property
    def f32(self) -> "Dots":
        """The same kernel's dots on f32 intermediates."""
        return self._replace(dtype=jnp.float32)


MIN_DOT_SIDE = 16  # Triton's smallest tl.dot side


def dividing_tile(size: int, tile: int, name: str) -> int:
    """The largest power-of-two tile <= `tile` dividing `size` (V = 96, tile 64 -> 32): Triton tiles are powers of
    two, and a grid of size // tile tiles that did not divide would leave the tail unwritten."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"{name}={tile} must be a power of two")
    return math.gcd(size, tile)


def check_dot_sides(interpret: bool, **sides: int) -> None:
    """Triton rejects a dot with a side below 16 at compile time; interpret mode takes any, as tests do."""
    small = {name: side for name, side in sides.items() if side < MIN_DOT_SIDE}
    if small and not interpret:
        raise ValueError(f"Triton dots need every side >= {MIN_DOT_SIDE}: {small}")


def nbytes(*arrays) -> int:
    """Bytes of whole arrays (anything with a shape and a dtype)."""
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def rows_bytes(array, rows: int) -> int:
    """Bytes of `rows` entries of `array`'s first axis: the slots of a pool a kernel reads or writes."""
    return rows * math.prod(array.shape[1:]) * jnp.dtype(array.dtype).itemsize


def cost(flops: float, transcendentals: float, bytes_accessed: float) -> pl.CostEstimate:
    """A pallas_call's CostEstimate (XLA wants integers); each op's `cost` module says what it counts."""
    return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=int(bytes_accessed))


def folded_entries(ring_entries: int, num_tokens: int, num_rows: int) -> int:
    """Ring entries a ReplaySSM row folds on average, from shapes alone: its committed entries, which grow from
    0 to W between flushes (W / 2 on average), where a ring of E = W + 1 + K entries serves rows of 1 + K tokens
    (`scheduler.replay.ring_rows`; a bucket of T tokens over R rows: 1 + K = ceil(T / R)). Decoding's one-entry
    dummy rings fold none."""
    return max(ring_entries - -(-num_tokens // num_rows), 0) // 2


# `pin` fences each small term of a recurrent update, and the state update as a whole, into expressions that every
# program computes alike: XLA:CPU contracts mul and add into FMAs, so an expression fused with different neighbours
# could round differently, and ReplaySSM with W = 1 must reproduce plain decoding bit for bit. The references' reads
# are sums of products, not dots, for the same reason: XLA:CPU's dots round differently with the batch's size, and
# `in_row_blocks` makes blocks of other sizes.
pin = jax.lax.optimization_barrier


def fold_ring(advance: Callable, state: jax.Array, rings: tuple[jax.Array, ...], ring_start: jax.Array,
              count: jax.Array, max_count: int) -> jax.Array:
    """One row's state advanced by its ring entries (ring_start + j) % E, j < count <= max_count: `advance(state,
    *entry)` with entry j of each [X, E, ...] ring page.

    Unrolled to the static bound: under vmap a loop to each row's own count becomes a while loop that copies the
    batch's states every trip, 1.5-3x slower on XLA:CPU at decode sizes (`docs/benchmarks.md`). Entries past
    `count` are zeros, which `advance` must map to the state itself (a decay of e^0 and a write of zero): that
    costs no select over the state."""
    width = rings[0].shape[1]
    for j in range(max_count):
        index = (ring_start + j) % width
        state = advance(state, *(jnp.where(j < count, jnp.take(ring, index, axis=1), 0) for ring in rings))
    return state


# A block of rows' states that stays in a core's cache (L2 is 1 MiB on the EPYC we measure) between the ops of
# `in_row_blocks`.
ROW_BLOCK_BYTES = 2**20


def in_row_blocks(fn: Callable, pool: Any, per_row: tuple[jax.Array, ...], row_bytes: int) -> tuple[Any, Any]:
    """(pool, outs) <- fn(pool, *block) over blocks of the [R, ...] `per_row` arrays, in a loop carrying the pool
    (updated in place) and stacking the blocks' outputs back to [R, ...].

    Whole-batch ops over the states read and write every state from memory once per op; a block of about
    `ROW_BLOCK_BYTES` of states (`row_bytes` each) stays in cache from its gather through its scatter. On XLA:CPU
    this took a batch-64 decode step of the vs_vllm model from 42-44 to 32-36 ms.
    """
    rows = per_row[0].shape[0]
    block = math.gcd(rows, max(1, ROW_BLOCK_BYTES // row_bytes))
    blocks = [x.reshape(rows // block, block, *x.shape[1:]) for x in per_row]
    pool, outs = jax.lax.scan(lambda pool, xs: fn(pool, *xs), pool, blocks)
    return pool, jax.tree.map(lambda y: y.reshape(rows, *y.shape[2:]), outs)


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


def repeat_heads(x: jax.Array, num_heads: int, axis: int) -> jax.Array:
    """GVA/GQA expansion: head h reads source head h // (num_heads // x.shape[axis])."""
    return jnp.repeat(x, num_heads // x.shape[axis], axis=axis)


def gather_slots(pool: jax.Array, slots: jax.Array, has_initial: jax.Array | None = None) -> jax.Array:
    """pool[slots] -> [R, ...]; rows without an initial state read zeros, whatever the slot holds."""
    rows = pool[slots]
    if has_initial is None:
        return rows
    return jnp.where(has_initial.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, 0).astype(pool.dtype)


def scatter_slots(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """pool[slots] = rows, except slot 0: the null slot is never written (padding rows aim there)."""
    target = jnp.where(slots > 0, slots, pool.shape[0])
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


def checkpoint_targets(cu_seqlens, slots, checkpoint_lens, checkpoint_slots):
    """Slots receiving each row's checkpoint: 0 (skip) for rows aimed at the null slot or too short."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return jnp.where((slots > 0) & (checkpoint_lens <= lengths), checkpoint_slots, 0)


def zero_padding(y: jax.Array, cu_seqlens: jax.Array, dtype) -> jax.Array:
    """[T, ...] -> dtype with padding tokens zeroed: kernels never store them (uninitialised memory)."""
    valid = token_rows(cu_seqlens, y.shape[0]).valid
    return jnp.where(valid.reshape((-1,) + (1,) * (y.ndim - 1)), y, 0).astype(dtype)


def int32(*arrays: jax.Array) -> list[jax.Array]:
    """Kernel metadata operands: read as int32 scalars (bool flags become 0/1)."""
    return [v.astype(jnp.int32) for v in arrays]


def checkpoint_counts(table: ChunkTable, checkpoint_lens: jax.Array, num_rows: int) -> jax.Array:
    """[NC] i32: tokens of each chunk before its row's checkpoint, 0 where the checkpoint is not in it."""
    count = checkpoint_lens[jnp.minimum(table.rows, num_rows - 1)] - table.offsets
    return jnp.where((count >= 1) & (count <= table.lengths), count, 0)


def real_blocks(table: ChunkTable, num_rows: int, block: int) -> jax.Array:
    """Blocks of `block` chunks that hold some row's chunks: a table lists its rows' chunks first, then padding."""
    return -(-jnp.sum(table.rows < num_rows) // block)


CHUNK_BLOCK = 8  # chunks prepared together: the table's padding (about one chunk per row of the bucket) is skipped


def carry_chunks(prepare: Callable, chunk: Callable, table: ChunkTable, pool: jax.Array, slots: jax.Array,
                 has_initial: jax.Array, out: jax.ShapeDtypeStruct, checkpoint_counts: jax.Array | None = None,
                 ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Each row's state carried through its chunks in order, block by block of `CHUNK_BLOCK` chunks, on the pool.

    `prepare(block)` does the work that needs no state for the chunks of `block` (a `ChunkTable` of
    `CHUNK_BLOCK` chunks, the token fields unchanged): a pytree with those chunks on its leading axis. Then
    `chunk(prepared, state, count)`, with `prepared` one chunk's slice -> (its output, the state after it, the
    state after its first `count` tokens or None), where `state` is the state before the chunk and `count` is its
    entry of `checkpoint_counts` (None without checkpoints).

    A row's state starts from `pool[slots[row]]` (zeros where `has_initial` is False) and the state after each of
    its chunks is written back there in place (never to the null slot 0): no whole-batch gather, select or scatter
    of the rows' states (8 MB each for 64 GDN rows of the vs_vllm model), so a row without tokens, such as a
    decode row of a mixed step aimed at the null slot, costs nothing. A fresh row without tokens gets zeros.

    Only blocks that hold some row's chunks run, in a loop as long as they are: a prefill bucket's table is sized
    for a partial chunk in every row and is largely padding (at chunk 16, 128 slots for the 71 real chunks of a
    1,024-token step over 64 rows), which preparing the whole table at once also computed.
    The table's length must be a multiple of `CHUNK_BLOCK` (`chunk_table(..., multiple_of=CHUNK_BLOCK)`).
    Returns (outputs [NC, *out.shape] (zeros for padding chunks), the pool, checkpoint states [R, ...] or None, a
    row's initial state where it has no checkpoint)."""
    if table.rows.shape[0] % CHUNK_BLOCK:  # a clamped last block would misalign with its chunks
        raise ValueError(f"chunk table of {table.rows.shape[0]} chunks is not whole blocks of {CHUNK_BLOCK}")
    num_rows, num_slots = slots.shape[0], pool.shape[0]
    num_real = jnp.sum(table.rows < num_rows)

    def step(first, prepared, i, carry):
        state, pool, checkpoint, outs = carry
        n = first + i
        row = table.rows[n]
        index = jnp.minimum(row, num_rows - 1)
        slot = slots[index]
        # the carried pool: no other row writes this slot, and reading the argument would keep a copy of it alive
        initial = lambda: jnp.where(has_initial[index], pool[slot].astype(jnp.float32), 0.0)
        state = jax.lax.cond(table.first[n], initial, lambda: state)
        count = None if checkpoint_counts is None else checkpoint_counts[n]
        output, state, at = chunk(jax.tree.map(lambda x: x[i], prepared), state, count)
        if count is not None:
            checkpoint = checkpoint.at[jnp.where(count > 0, row, num_rows)].set(at, mode="drop")
        target = jnp.where((row < num_rows) & (slot > 0), slot, num_slots)
        pool = pool.at[target].set(state.astype(pool.dtype), mode="drop")
        return state, pool, checkpoint, outs.at[n].set(output)

    def block(b, carry):
        first = b * CHUNK_BLOCK
        prepared = prepare(table.block(first, CHUNK_BLOCK))
        last = jnp.minimum(num_real - first, CHUNK_BLOCK)
        return jax.lax.fori_loop(0, last, functools.partial(step, first, prepared), carry)

    checkpoint = None if checkpoint_counts is None else gather_slots(pool, slots, has_initial).astype(jnp.float32)
    pool = _reset_empty_rows(pool, table, slots, has_initial)
    outs = jnp.zeros(table.rows.shape + out.shape, out.dtype)
    carry = (jnp.zeros(pool.shape[1:], jnp.float32), pool, checkpoint, outs)
    _, pool, checkpoint, outs = jax.lax.fori_loop(0, real_blocks(table, num_rows, CHUNK_BLOCK), block, carry)
    return outs, pool, checkpoint


def _reset_empty_rows(pool: jax.Array, table: ChunkTable, slots: jax.Array, has_initial: jax.Array) -> jax.Array:
    """Zeros in the slots of fresh rows without tokens (a row without tokens ends in its initial state), one slot per
    loop trip, usually none: a scatter over every row's slot cost 2 ms a call on XLA:CPU for a pool of 20 MB."""
    lengths = jnp.zeros(slots.shape[0], jnp.int32).at[table.rows].add(table.lengths, mode="drop")
    fresh = (lengths == 0) & ~has_initial & (slots > 0)
    order = jnp.argsort(~fresh, stable=True)  # fresh rows first
    zero = jnp.zeros(pool.shape[1:], pool.dtype)
    return jax.lax.fori_loop(0, jnp.sum(fresh), lambda i, pool: pool.at[slots[order[i]]].set(zero), pool)


def carry_rows(run: Callable, initial_state: jax.Array) -> tuple[Any, jax.Array]:
    """`run(pool, slots, has_initial) -> (outputs, pool)` on per-row initial states [R, ...] rather than a pool:
    each row gets a slot of its own after a null slot 0. Returns (outputs, final states [R, ...])."""
    pool = jnp.concatenate([jnp.zeros_like(initial_state[:1]), initial_state])
    num_rows = initial_state.shape[0]
    outputs, pool = run(pool, jnp.arange(1, num_rows + 1, dtype=jnp.int32), jnp.ones(num_rows, bool))
    return outputs, pool[1:]


def store_checkpoints(pool, cu_seqlens, slots, checkpoint_lens, checkpoint_slots, checkpoint):
    """Scatter each row's checkpoint state, when asked, to its checkpoint slot."""
    if checkpoint_lens is None:
        return pool
    return scatter_slots(pool, checkpoint_targets(cu_seqlens, slots, checkpoint_lens, checkpoint_slots), checkpoint)


def copy_slots(pool: jax.Array, src_slots: jax.Array, dst_slots: jax.Array) -> jax.Array:
    """pool[dst] = pool[src] for each pair; pairs aimed at the null slot 0 are skipped."""
    return scatter_slots(pool, dst_slots, pool[src_slots])


def snapshot_at(state_pool: jax.Array, snapshots: jax.Array, slots: jax.Array, ring_start: jax.Array,
                count: jax.Array) -> jax.Array:
    """[R, H, ...] f32 state of each slot after its first `count` entries, with snapshots for entries:
    S0 when count == 0, else the snapshot at ring index (ring_start + count - 1) % E.

    state_pool: [S, H, ...]; snapshots: [S, H, E, ...] the full state after each ring entry.
    """
    entry = (ring_start + count - 1) % snapshots.shape[2]
    taken = snapshots[slots[:, None], jnp.arange(snapshots.shape[1])[None, :], entry[:, None]]
    live = (count > 0).reshape((-1,) + (1,) * (taken.ndim - 1))
    return jnp.where(live, taken, state_pool[slots]).astype(jnp.float32)


def store_snapshots(state_pool, snapshots, checkpoint, states, cu_seqlens, slots, ring_start, committed, flush,
                    num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """A snapshot verify's writes: flushed rows' live state `checkpoint` [R, H, ...] becomes S0, and the state
    after each row token, `states` [R, Tq, H, ...], goes to its ring position (`append_tokens`)."""
    state_pool = scatter_slots(state_pool, jnp.where(flush, slots, 0), checkpoint)
    packed = dense_to_rows(states, cu_seqlens, num_tokens)
    return state_pool, append_tokens(snapshots, packed, cu_seqlens, slots, ring_start, committed)


@functools.partial(jax.jit, donate_argnames="state_pool")
def snapshot_materialize(state_pool, snapshots, src_slots, dst_slots, ring_start, num_entries) -> jax.Array:
    """state_pool[dst] = the state of src after num_entries entries (`snapshot_at`): a whole-state copy,
    so XLA on every backend. dst 0 = skip; src and snapshots untouched."""
    return scatter_slots(state_pool, dst_slots, snapshot_at(state_pool, snapshots, src_slots, ring_start, num_entries))


def resolve_backend(backend: str | None, has_pallas: bool = True) -> str:
    """None -> "pallas" on GPU (when the op has a kernel), else "reference"."""
    if backend is None:
        return "pallas" if has_pallas and jax.default_backend() == "gpu" else "reference"
    allowed = ("reference", "pallas", "interpret") if has_pallas else ("reference",)
    if backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    return backend


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


def append_ring(page: jax.Array, new: jax.Array, ring_start, committed, lengths) -> jax.Array:
    """Write new entries i < lengths[r] at ring index (ring_start + committed + i) % E, per row.

    page: [R, X, E, ...] (ring axis 2); new: [R, X, N <= E, ...] in logical order. Other entries are kept. One
    select per new entry (N is 1 + k): a gather that rotated the new entries into place cost a batch-64 decode
    step ~1.4 ms on XLA:CPU."""
    width = page.shape[2]
    logical = (jnp.arange(width)[None, :] - ring_start[:, None] - committed[:, None]) % width  # [R, E]
    expand = (slice(None), None, slice(None)) + (None,) * (page.ndim - 3)
    for i in range(new.shape[2]):
        take = ((logical == i) & (i < lengths[:, None]))[expand]
        page = jnp.where(take, new[:, :, i : i + 1], page)
    return page


def append_dense_rows(rings, new_entries, slots, ring_start, committed, lengths) -> tuple:
    """`append_ring` for each (ring pool [S, X, E, ...], row tokens [R, N <= E, X, ...]) pair, on the rows' slots."""
    return tuple(
        scatter_slots(ring, slots, append_ring(ring[slots], jnp.moveaxis(new, 1, 2), ring_start, committed, lengths))
        for ring, new in zip(rings, new_entries, strict=True)
    )


def append_tokens(ring: jax.Array, values: jax.Array, cu_seqlens, slots, ring_start, committed) -> jax.Array:
    """Scatter each packed token's entry to ring index (ring_start + committed + i) % E of its row's slot.

    ring: [S, X, E, ...]; values: [T, X, ...], token i of row r. Padding tokens and the null slot drop.
    Same result as `append_ring` on gathered pages, without touching the other entries.
    """
    num_slots, width = ring.shape[0], ring.shape[2]
    tok = token_rows(cu_seqlens, values.shape[0])
    rows = jnp.minimum(tok.rows, slots.shape[0] - 1)
    index = (ring_start[rows] + committed[rows] + tok.positions) % width
    target = jnp.where(tok.valid & (slots[rows] > 0), slots[rows], num_slots)
    return ring.at[target, :, index].set(values.astype(ring.dtype), mode="drop")
