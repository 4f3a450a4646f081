"""Pallas (Triton backend) Mamba2 SSD chunked varlen prefill (docs/kernels.md#mamba2-ssd) on the state pool.

Two kernels, as mamba_ssm splits `_bmm_chunk_fwd` from `_chunk_scan_fwd`:
1. `_chunk_cb_kernel`, grid (chunk, group): CB = C Bᵀ [BT, BT] f32 of every chunk of BT tokens, computed
   once per group into a scratch output [NC, G, BT, BT] (chunks from `varlen.chunk_table`).
2. `_ssd_prefill_kernel`, grid (row, head, P tile) as in `pallas_kernels.mamba2.pallas`: each program walks
   its row chunk by chunk with its [block_p, N] fp32 state tile in registers and reads the chunk's CB, so
   the heads of a group and the P tiles of a head share one C Bᵀ. With `state_parts` > 1, that many programs
   split each state tile by its N columns; each writes the part of y its columns give, and the launcher sums
   the parts (f32 at N 256, where one program's registers spill).
Tokens are read unpadded: partial chunks are masked loads and stores. Dots take operands in the activation
dtype (`tiles.Dots`) and accumulate in f32.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.mamba2 import cost
from pallas_kernels.mamba2.pallas import check_tiles, pool_call, program_tile
from pallas_kernels.tiles import HIGHEST, Dots, int32
from pallas_kernels.varlen import check_rows, chunk_table, zero_padding

_f32 = jnp.float32


def _load_tokens(ref, start, mask, *index):
    """ref[start : start + BT, *index] with tokens outside `mask` [BT] read as 0, never as stale memory.

    One indexer per load: the Triton lowering rejects composed `.at` views.
    """
    view = ref.at[(pl.ds(start, mask.shape[0]), *index)]
    return plt.load(view, mask=mask.reshape((-1,) + (1,) * (len(view.shape) - 1)), other=0)


# ---------------------------------------------------------------- phase 1: C Bᵀ per (chunk, group)


def _chunk_cb_kernel(
    chunk_starts_ref,  # [NC] i32
    chunk_lengths_ref,  # [NC] i32, 0 for surplus chunks
    B_ref,  # [T, G, N]
    C_ref,  # [T, G, N]
    cb_ref,  # [NC, G, BT, BT] f32
    *, block_t, dots,
):  # fmt: skip
    i_chunk, group = pl.program_id(0), pl.program_id(1)
    start, length = chunk_starts_ref[i_chunk], chunk_lengths_ref[i_chunk]

    @pl.when(length > 0)  # no row reads a surplus chunk
    def _():
        mask = jnp.arange(block_t) < length
        b = _load_tokens(B_ref, start, mask, group, slice(None))
        c = _load_tokens(C_ref, start, mask, group, slice(None))
        cb_ref[i_chunk, group] = dots(c, b.T)


def _chunk_cb(B, C, starts, lengths, *, block_t, dots):
    """[NC, G, BT, BT] f32: C_l . B_s of each chunk (zero past its length); surplus chunks uninitialised."""
    num_chunks, num_groups = starts.shape[0], B.shape[1]
    return pl.pallas_call(
        functools.partial(_chunk_cb_kernel, block_t=block_t, dots=dots),
        out_shape=jax.ShapeDtypeStruct((num_chunks, num_groups, block_t, block_t), _f32),
        grid=(num_chunks, num_groups),
        interpret=dots.interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        cost_estimate=cost.chunk_cb(B, C, block_t),
        name=f"ssd_chunk_cb_{block_t=}",
    )(*int32(starts, lengths), B, C)


# ---------------------------------------------------------------- phase 2: per-head chunk scan


def _chunk_output(state, cb, x, dt, a, c, dots, first_part):
    """y without the D x skip [BT, BP] f32 of one chunk from state [BP, N], and cum = cumsum(dt a) [BT]; with
    the state split over programs by its N columns, the part of y those columns give, and the in-chunk term
    in the `first_part` only.

    cb [BT, BT] f32; x [BT, BP] and c [BT, N] in the activation dtype; dt [BT] f32 (0 on masked tokens, so
    they do not decay the chunk).
    """
    cum = jnp.cumsum(dt * a)
    positions = jnp.arange(cum.shape[0])
    lower = positions[:, None] >= positions[None, :]
    # exp(segsum): mask before exp, the upper triangle is positive and may overflow.
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    # dt folds into the decay matrix (mamba_ssm `_chunk_scan_fwd`), so x enters the dot as loaded.
    y_diag = dots(cb * decay * dt[None, :], x)
    y_off = jnp.exp(cum)[:, None] * dots(c, state.T)
    return jnp.where(first_part, y_diag, 0.0) + y_off, cum


def _state_after(state, x, dt, b, cum, count, dots):
    """State after the chunk's first `count` (>= 1) tokens (the chunk's end state, truncated at count):
    e^{cum[count-1]} state + sum_{s < count} e^{cum[count-1] - cum_s} dt_s x_s (x) b_s."""
    positions = jnp.arange(cum.shape[0])
    taken = positions < count
    last = jnp.sum(jnp.where(positions == count - 1, cum, 0.0))  # cum[count - 1], without a gather
    weights = jnp.where(taken, jnp.exp(jnp.where(taken, last - cum, 0.0)) * dt, 0.0)
    update = dots((x.astype(_f32) * weights[:, None]).T, b)
    return jnp.exp(last) * state + update


def _zero_tokens(y_ref, begin, end, *, head, p0, block_t, block_p):
    """y = 0 on tokens [begin, end) of this program's tile: padding tokens no row owns."""
    offsets = jnp.arange(block_t)

    def body(i, carry):
        start = begin + i * block_t
        mask = (offsets < end - start)[:, None]
        zeros = jnp.zeros((block_t, block_p), y_ref.dtype)
        plt.store(y_ref.at[pl.ds(start, block_t), head, pl.ds(p0, block_p)], zeros, mask=mask)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(end - begin, block_t), body, 0)


def _ssd_prefill_kernel(
    cu_seqlens_ref,  # [R+1] i32
    slots_ref,  # [R] i32
    has_initial_ref,  # [R] i32, 0/1
    checkpoint_lens_ref,  # [R] i32
    checkpoint_slots_ref,  # [R] i32, 0 = no checkpoint
    first_chunks_ref,  # [R] i32, index of the row's first chunk in cb_ref
    A_ref,  # [NH] f32
    D_ref,  # [NH] f32
    x_ref,  # [T, NH, P]
    dt_ref,  # [T, NH] f32
    B_ref,  # [T, G, N]
    C_ref,  # [T, G, N]
    cb_ref,  # [NC, G, BT, BT] f32, from `_chunk_cb_kernel`
    state_ref,  # [S, NH, P, N] f32, aliased to state_out_ref
    y_ref,  # [T, NH, P]; with state_parts > 1 f32 [state_parts, T, NH, P], a part of y per part of N
    state_out_ref,  # [S, NH, P, N] f32
    *, heads_per_group, block_p, block_t, state_parts, dots,
):  # fmt: skip
    i_row, num_rows = pl.program_id(0), slots_ref.shape[0]
    head, group, p0 = program_tile(heads_per_group, block_p, state_parts)
    part, block_n = pl.program_id(2) % state_parts, state_ref.shape[-1] // state_parts
    slot, begin, end = slots_ref[i_row], cu_seqlens_ref[i_row], cu_seqlens_ref[i_row + 1]
    rows, cols = pl.ds(p0, block_p), pl.ds(part * block_n, block_n)
    a, d, first_chunk = A_ref[head], D_ref[head], first_chunks_ref[i_row]
    checkpoint_len, checkpoint_slot = checkpoint_lens_ref[i_row], checkpoint_slots_ref[i_row]
    checkpoint = (checkpoint_slot > 0) & (slot > 0) & (checkpoint_len <= end - begin)
    # where, not a product: a stale slot may hold NaN.
    state = jnp.where(has_initial_ref[i_row] != 0, state_ref[slot, head, rows, cols].astype(jnp.float32), 0.0)

    @pl.when(checkpoint & (checkpoint_len == 0))
    def _():
        state_out_ref[checkpoint_slot, head, rows, cols] = state.astype(state_out_ref.dtype)

    def chunk(i, state):
        start = begin + i * block_t
        count = jnp.minimum(end - start, block_t)
        mask = jnp.arange(block_t) < count
        x = _load_tokens(x_ref, start, mask, head, rows)
        dt = _load_tokens(dt_ref, start, mask, head).astype(_f32)
        b, c = (_load_tokens(ref, start, mask, group, cols) for ref in (B_ref, C_ref))
        y, cum = _chunk_output(state, cb_ref[first_chunk + i, group], x, dt, a, c, dots, part == 0)
        y = (y + jnp.where(part == 0, d, 0.0) * x.astype(_f32)).astype(y_ref.dtype)
        tokens = pl.ds(start, block_t)
        y_tile = y_ref.at[tokens, head, rows] if state_parts == 1 else y_ref.at[part, tokens, head, rows]
        plt.store(y_tile, y, mask=mask[:, None])
        in_chunk = checkpoint_len - i * block_t

        @pl.when(checkpoint & (in_chunk >= 1) & (in_chunk <= block_t))
        def _():
            after = _state_after(state, x, dt, b, cum, in_chunk, dots)
            state_out_ref[checkpoint_slot, head, rows, cols] = after.astype(state_out_ref.dtype)

        return _state_after(state, x, dt, b, cum, count, dots)

    state = jax.lax.fori_loop(0, pl.cdiv(end - begin, block_t), chunk, state)

    @pl.when(slot > 0)
    def _():
        state_out_ref[slot, head, rows, cols] = state.astype(state_out_ref.dtype)

    if state_parts > 1:  # the launcher sums the parts and zeroes the padding tokens
        return
    zero = functools.partial(_zero_tokens, y_ref, head=head, p0=p0, block_t=block_t, block_p=block_p)

    @pl.when(i_row == 0)
    def _():
        zero(0, cu_seqlens_ref[0])

    @pl.when(i_row == num_rows - 1)
    def _():
        zero(cu_seqlens_ref[num_rows], y_ref.shape[0])


# ---------------------------------------------------------------- launcher


def _check_operands(x, B, C, state_pool, block_p, block_t, state_parts, interpret):
    """Validated (block_p, block_t); x, B and C share the dots' operand dtype."""
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"x, B and C must share one dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    if state_pool.dtype not in (_f32, jnp.bfloat16):  # a bf16 pool is read as f32 and rounded once per store
        raise ValueError(f"state_pool must be float32 or bfloat16, got {state_pool.dtype}")
    block_p = check_tiles(state_pool, block_p)
    if block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} (min of block_t and chunk_size) must be a power of two")
    state_size = state_pool.shape[-1]
    if state_parts < 1 or state_size % state_parts:
        raise ValueError(f"state_parts={state_parts} must divide the state's N={state_size}")
    if not interpret and min(block_p, block_t, state_size // state_parts) < 16:
        raise ValueError(f"Triton dots need tiles >= 16: {block_p=}, {block_t=}, N / state_parts = "
                         f"{state_size // state_parts}")
    return block_p, block_t


def default_tiles(state_size: int, dtype) -> tuple[int, int, int]:
    """(block_p, block_t, state_parts): 32 x 64, but 16 x 32 at N >= 256, where the [block_p, N] f32 state and
    the [block_t, N] B and C tiles of the larger tiling need more than 255 registers a thread and spill (bf16,
    8 warps, `benchmarks/aot_kernels.py`). f32 activations take block_t 16, since their 3xTF32 dots hold each
    operand as two TF32 halves and every longer tile spills, and split a state of N > 128 over programs of 128
    columns each (at N 256 one program spilled 164 B)."""
    block_p = 16 if state_size >= 256 else 32
    if jnp.dtype(dtype) == jnp.float32:
        return block_p, 16, max(state_size // 128, 1)
    return block_p, 2 * block_p, 1


def _first_chunks(cu_seqlens, block_t):
    """[R] i32 index of each row's first chunk in `chunk_table` order (a row's chunks are consecutive)."""
    row_chunks = pl.cdiv(cu_seqlens[1:] - cu_seqlens[:-1], block_t)
    return jnp.cumsum(row_chunks) - row_chunks


@functools.partial(
    jax.jit,
    static_argnames=("chunk_size", "block_p", "block_t", "state_parts", "num_warps", "num_stages", "interpret"),
    donate_argnames="state_pool",
)
def ssd_prefill(
    x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, D: jax.Array, cu_seqlens: jax.Array,
    state_pool: jax.Array, slots: jax.Array, has_initial: jax.Array, checkpoint_lens: jax.Array | None = None,
    checkpoint_slots: jax.Array | None = None, *, chunk_size: int = 128, block_p: int | None = None,
    block_t: int | None = None, state_parts: int | None = None,
    num_warps: int = 8, num_stages: int = 2, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Same contract as `reference.ssd_prefill`; x, B, C (and y) in one of f32/bf16/fp16.

    Each row is chunked from its own first token in chunks of min(block_t, chunk_size) tokens; chunk_size
    chunks are whole numbers of them, so results equal the chunked reference up to rounding. A checkpoint
    state is computed inside its chunk. Checkpoint slots must not be running slots of other rows.
    block_p, block_t: tiles of P and of a chunk's tokens; state_parts: programs that split a state tile's N
      columns between them (their parts of y are summed after the kernel); None: `default_tiles`.
    num_warps: 8, since with 4 the block_p 32 / block_t 64 program needs more than 255 registers a thread and
    spills (`benchmarks/aot_kernels.py`, bf16).
    """
    check_rows(cu_seqlens, slots, "slots")
    chosen = (block_p, block_t, state_parts)
    block_p, block_t, state_parts = (d if c is None else c for c, d in zip(chosen, default_tiles(
        state_pool.shape[-1], x.dtype), strict=True))
    block_p, block_t = _check_operands(x, B, C, state_pool, block_p, min(block_t, chunk_size), state_parts,
                                       interpret)
    if checkpoint_lens is None:
        checkpoint_lens, checkpoint_slots = jnp.zeros_like(slots), jnp.zeros_like(slots)
    table = chunk_table(cu_seqlens, x.shape[0], block_t)
    dots = Dots(x.dtype, interpret)
    # C B^T's f32 [BT, N] x [N, BT] tiles fit IEEE's FMA loops; 3xTF32 spills them at N 256 (aot_kernels.py)
    cb = _chunk_cb(B, C, table.starts, table.lengths, block_t=block_t, dots=dots._replace(f32_on_gpu=HIGHEST))
    first_chunks = _first_chunks(cu_seqlens, block_t)
    metadata = int32(cu_seqlens, slots, has_initial, checkpoint_lens, checkpoint_slots, first_chunks)
    operands = [*metadata, A.astype(_f32), D.astype(_f32), x, dt, B, C, cb, state_pool]
    kernel = functools.partial(
        _ssd_prefill_kernel, heads_per_group=x.shape[1] // B.shape[1], block_p=block_p, block_t=block_t,
        state_parts=state_parts, dots=dots,
    )  # fmt: skip
    y_shape = x if state_parts == 1 else jax.ShapeDtypeStruct((state_parts, *x.shape), _f32)
    y, state_pool = pool_call(
        kernel, operands, (y_shape, state_pool), num_rows=slots.shape[0], block_p=block_p, interpret=interpret,
        name=f"ssd_prefill_{block_p=}_{block_t=}_{state_parts=}", num_warps=num_warps, num_stages=num_stages,
        cost_estimate=cost.prefill(x, dt, B, C, state_pool, slots.shape[0], block_t), parts=state_parts,
    )  # fmt: skip
    return (y, state_pool) if state_parts == 1 else (zero_padding(y.sum(0), cu_seqlens, x.dtype), state_pool)
