"""Shared builders for packed varlen test inputs: row lengths inside one padded bucket, per-row loops."""

import numpy as np
from hypothesis import strategies as st

from pallas_kernels.pools import CHUNK_BLOCK
from tests.tolerances import Float32


def cu_seqlens(lengths: list[int], num_rows: int) -> np.ndarray:
    """[R+1] i32 boundaries; missing rows are zero-length padding rows."""
    padded = list(lengths) + [0] * (num_rows - len(lengths))
    return np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)


def prefill_rows(rng, lengths, num_rows, slot_ids, initial_rate=0.5, checkpoint_past_end=False):
    """cu_seqlens and the per-row prefill arguments of a (T, R) bucket, drawn from `rng`.

    Real rows run in the distinct `slot_ids[:R]` (padding rows in the null slot), have an initial state
    with probability `initial_rate`, and 70% of them checkpoint at a random length into `slot_ids[R:2R]`;
    `checkpoint_past_end` also allows row length + 1 (past the row's end: skipped).
    """
    cu = cu_seqlens(lengths, num_rows)
    real = np.arange(num_rows) < len(lengths)
    extra = 2 if checkpoint_past_end else 1
    # One rng draw after another in this order: callers' seeded cases depend on it.
    has_initial = rng.uniform(size=num_rows) < initial_rate
    checkpoint_lens = np.array([rng.integers(0, n + extra) for n in np.diff(cu)], np.int32)
    checkpoint_slots = np.where(real & (rng.uniform(size=num_rows) < 0.7), slot_ids[num_rows : 2 * num_rows], 0)
    return dict(
        cu_seqlens=cu,
        slots=np.where(real, slot_ids[:num_rows], 0).astype(np.int32),
        has_initial=has_initial,
        checkpoint_lens=checkpoint_lens,
        checkpoint_slots=checkpoint_slots.astype(np.int32),
    )


@st.composite
def row_lengths(draw, chunk_size: int, num_tokens: int, num_rows: int) -> list[int]:
    """Row lengths hitting the chunk edge cases (0, 1, C-1, C, C+1, several chunks), total <= T."""
    special = st.sampled_from([0, 1, chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size + 3])
    length = st.one_of(special, st.integers(0, 2 * chunk_size))
    lengths = draw(st.lists(length, min_size=1, max_size=num_rows))
    while sum(lengths) > num_tokens:
        lengths[int(np.argmax(lengths))] //= 2
    return lengths


def row_slice(x: np.ndarray, start: int, stop: int, num_tokens: int) -> np.ndarray:
    """Tokens [start, stop) of packed x, moved to the front of a zero bucket of T tokens."""
    out = np.zeros((num_tokens,) + x.shape[1:], x.dtype)
    out[: stop - start] = x[start:stop]
    return out


def run_rows_separately(fn, token_args, row_states, cu, num_tokens, **kwargs):
    """Call fn(*token_args, cu=[0, L], state[None]) once per row; returns packed outputs and stacked states.

    Every call uses the same single-row bucket, so fn compiles once.
    """
    outputs, finals = [], []
    for r in range(len(cu) - 1):
        start, stop = int(cu[r]), int(cu[r + 1])
        args = [row_slice(a, start, stop, num_tokens) for a in token_args]
        o, final = fn(*args, np.array([0, stop - start], np.int32), row_states[r : r + 1], **kwargs)
        outputs.append(np.asarray(o)[: stop - start])
        finals.append(np.asarray(final)[0])
    return np.concatenate(outputs), np.stack(finals)


def split_row_twice(fn, token_args, state, length, split, num_tokens, **kwargs):
    """Run one row as two consecutive single-row calls, carrying the state; returns (outputs, final)."""
    first = [row_slice(a, 0, split, num_tokens) for a in token_args]
    o1, mid = fn(*first, np.array([0, split], np.int32), state, **kwargs)
    second = [row_slice(a, split, length, num_tokens) for a in token_args]
    o2, final = fn(*second, np.array([0, length - split], np.int32), mid, **kwargs)
    return np.concatenate([np.asarray(o1)[:split], np.asarray(o2)[: length - split]]), np.asarray(final)


def check_packed_equals_per_row_calls(fns, token_args, states, cu, num_tokens, tol: Float32):
    """Each fn(*token_args, cu, states) on the packed bucket equals one call per row (the FLA varlen check)."""
    for fn in fns:
        out, final = fn(*token_args, cu, states)
        out_rows, final_rows = run_rows_separately(fn, token_args, states, cu, num_tokens)
        tol.check(out[: cu[-1]], out_rows)
        tol.check(final, final_rows)


def check_split_row_carries_state(fns, token_args, state, length, split, num_tokens, tol: Float32):
    """Each fn on one row of `length` tokens equals two calls split at `split`, carrying the state."""
    for fn in fns:
        out, final = fn(*token_args, np.array([0, length], np.int32), state)
        out_split, final_split = split_row_twice(fn, token_args, state, length, split, num_tokens)
        tol.check(out[:length], out_split)
        tol.check(final, final_split)


def check_chunked_matches_recurrent(recurrent, chunked, token_args, states, cu, tol: Float32):
    """Real tokens' outputs and every row's final state agree; all outputs (padding too) are finite."""
    out_ref, final_ref = recurrent(*token_args, cu, states)
    out, final = chunked(*token_args, cu, states)
    tol.check(out[: cu[-1]], out_ref[: cu[-1]])
    tol.check(final, final_ref)
    assert np.isfinite(out).all()


def check_a_row_across_chunk_blocks(recurrent, chunked16, make_inputs, state_terms: int):
    """`carry_chunks` prepares blocks of `CHUNK_BLOCK` chunks: a row of 9 chunks of 16 crosses from the first block
    into the second, which holds the other rows' chunks; the table's third block is padding and is skipped.
    `make_inputs(num_tokens, num_rows, seed)` -> (token arrays by name, initial states)."""
    assert CHUNK_BLOCK == 8  # the lengths below are laid out for blocks of 8
    lengths = [0, 9 * 16 - 3, 0, 40, 1, 0, 0, 0]
    tokens, states = make_inputs(192, 8, seed=3)
    tol = Float32(depth=lengths[1] + state_terms + 64)
    check_chunked_matches_recurrent(recurrent, chunked16, list(tokens.values()), states, cu_seqlens(lengths, 8), tol)
