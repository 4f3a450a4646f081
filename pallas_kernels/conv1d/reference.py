"""Pure-JAX causal depthwise conv1d over packed varlen tokens (docs/kernels.md#causal-conv1d).

Slot pool page: `window_pool[s] = [Kc-1, D]`, the window (oldest first) at the slot's S0, and a ring of the
pre-conv inputs after it (`ring[s] = [1, E, D]`), from which the window at any committed position is
rebuilt (docs/kernels.md#replayssm): verify rows never overwrite a window that a later materialize needs.
"""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.pools import checkpoint_targets, gather_slots, scatter_slots
from pallas_kernels.rings import append_tokens
from pallas_kernels.varlen import check_rows, dense_to_rows, rows_to_dense, token_rows


def _taps(xx, weight):
    """Valid conv: xx [..., L + Kc-1, D] f32 -> [..., L, D]; elementwise multiply-adds (exact fp32 on GPU)."""
    kernel_size = weight.shape[1]
    length = xx.shape[-2] - (kernel_size - 1)
    return sum(weight[:, i] * xx[..., i : i + length, :] for i in range(kernel_size))


def _conv(x, weight, cu_seqlens, initial_window):
    """Conv of every packed row continuing from its window: [T, D] f32 (padding tokens: garbage)."""
    width = initial_window.shape[1]
    xf, weight = x.astype(jnp.float32), weight.astype(jnp.float32)
    # Sliding over the packed buffer is right except for each row's first Kc-1 tokens, which would read
    # the previous row; those are recomputed from the row's own window and overwritten.
    y = _taps(jnp.concatenate([jnp.zeros((width, x.shape[1]), jnp.float32), xf]), weight)
    head = cu_seqlens[:-1, None] + jnp.arange(width)  # [R, Kc-1]
    xx = jnp.concatenate([initial_window.astype(jnp.float32), xf[jnp.minimum(head, x.shape[0] - 1)]], axis=1)
    in_row = jnp.arange(width) < (cu_seqlens[1:] - cu_seqlens[:-1])[:, None]
    return y.at[jnp.where(in_row, head, x.shape[0])].set(_taps(xx, weight), mode="drop")


def _conv_rows(x, weight, cu_seqlens, initial_window, max_row_len):
    """`_conv` for rows of at most `max_row_len` tokens: each row's tokens after its window, [R, Kc-1 + max_row_len,
    D], through the same taps. A decode step's rows take ops over R rows, not a pass over the packed buffer and
    a scatter of every row's first tokens (docs/benchmarks.md#where-a-cpu-decode-step-goes)."""
    rows = rows_to_dense(x.astype(jnp.float32), cu_seqlens, max_row_len)
    xx = jnp.concatenate([initial_window.astype(jnp.float32), rows], axis=1)
    return dense_to_rows(_taps(xx, weight.astype(jnp.float32)), cu_seqlens, x.shape[0])


def _window_after(x, cu_seqlens, initial_window, lengths):
    """Last Kc-1 entries of (initial_window ++ first lengths[r] row tokens) per row: [R, Kc-1, D]."""
    width = initial_window.shape[1]
    extended = lengths[:, None] + jnp.arange(width)  # index into window ++ tokens
    from_tokens = x[jnp.clip(cu_seqlens[:-1, None] + extended - width, 0, x.shape[0] - 1)]
    from_window = jnp.take_along_axis(initial_window, jnp.minimum(extended, width - 1)[:, :, None], axis=1)
    return jnp.where((extended >= width)[:, :, None], from_tokens.astype(initial_window.dtype), from_window)


@functools.partial(jax.jit, static_argnames=("activation", "max_row_len"))
def causal_conv1d(x, weight, bias, cu_seqlens, initial_window, *, activation: bool = True, max_row_len=None):
    """Causal depthwise conv1d over packed rows, each row continuing from its own window.

    y[t, c] = sum_i weight[c, i] * xx[t - (Kc-1) + i, c] (+ bias[c]), then SiLU if `activation`, where xx
    is the row's tokens preceded by its `initial_window` (oldest first). Computed in fp32.

    Args:
      x: [T, D] packed pre-conv inputs; tokens at index >= cu_seqlens[-1] are padding.
      weight: [D, Kc] per-channel taps (HF `conv1d.weight[:, 0, :]`).
      bias: [D] or None.
      cu_seqlens: [R+1] i32 row boundaries.
      initial_window: [R, Kc-1, D] last Kc-1 inputs before each row, oldest first.
      activation: apply SiLU.
      max_row_len: a static bound on every row's length, for rows this short (decode, verify); None: any.

    Returns:
      y: [T, D] in x.dtype (padding tokens zero).
      final_window: [R, Kc-1, D] last Kc-1 inputs of (initial_window ++ row tokens); zero-length rows
        return their initial window.
    """
    if max_row_len is None:
        y = _conv(x, weight, cu_seqlens, initial_window)
    else:
        y = _conv_rows(x, weight, cu_seqlens, initial_window, min(max_row_len, x.shape[0]))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation:
        y = jax.nn.silu(y)
    y = jnp.where(token_rows(cu_seqlens, x.shape[0]).valid[:, None], y, 0.0)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return y.astype(x.dtype), _window_after(x, cu_seqlens, initial_window, lengths)


def _write_columns(pool, slots, start, rows):
    """pool[slots, start:start+n] = rows; the null slot 0 is never written."""
    target = jnp.where(slots > 0, slots, pool.shape[0])
    return pool.at[target, start : start + rows.shape[1]].set(rows.astype(pool.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames="window_pool")
def conv1d_prefill(
    x, weight, bias, cu_seqlens, window_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, activation=True,
):  # fmt: skip
    """Conv over packed rows reading and writing each row's window in the pool; see __init__."""
    check_rows(cu_seqlens, slots, "slots")
    width = weight.shape[1] - 1
    window = gather_slots(window_pool[:, :width], slots, has_initial)
    y, final = causal_conv1d(x, weight, bias, cu_seqlens, window, activation=activation)
    window_pool = _write_columns(window_pool, slots, 0, final)
    if checkpoint_lens is not None:
        targets = checkpoint_targets(cu_seqlens, slots, checkpoint_lens, checkpoint_slots)
        checkpoint = _window_after(x, cu_seqlens, window, checkpoint_lens)
        window_pool = _write_columns(window_pool, targets, 0, checkpoint)
    return y, window_pool


def replay_window(window_pool, ring, slots, ring_start, count):
    """[R, Kc-1, D]: the last Kc-1 of (window ++ the first `count` ring entries) of each row's slot.

    window_pool: [S, Kc-1, D] the window at S0; ring: [S, 1, E, D] pre-conv inputs after S0, entry j at ring
    index (ring_start + j) % E. The window after S0 plus `count` tokens, which a flush or a materialize keeps.
    """
    width, entries = window_pool.shape[1], ring.shape[2]
    index = count[:, None] + jnp.arange(width)  # into window ++ entries
    from_window = jnp.take_along_axis(window_pool[slots], jnp.minimum(index, width - 1)[:, :, None], axis=1)
    ring_index = (ring_start[:, None] + index - width) % entries
    from_ring = jnp.take_along_axis(ring[slots, 0], ring_index[:, :, None], axis=1)
    return jnp.where((index < width)[:, :, None], from_window, from_ring.astype(window_pool.dtype))


@functools.partial(jax.jit, static_argnames=("activation",), donate_argnames=("window_pool", "ring"))
def conv1d_replay(x, weight, bias, cu_seqlens, window_pool, ring, slots, ring_start, committed, flush, *,
                  activation=True):
    """ReplaySSM conv of decode/verify rows; see __init__."""
    check_rows(cu_seqlens, slots, "slots")
    window = replay_window(window_pool, ring, slots, ring_start, committed)
    # the ring is read above before it is written below: say so, or XLA copies the whole ring pool
    window, ring = jax.lax.optimization_barrier((window, ring))
    # verify rows hold 1 + k <= E tokens
    y, _ = causal_conv1d(x, weight, bias, cu_seqlens, window, activation=activation, max_row_len=ring.shape[2])
    window_pool = scatter_slots(window_pool, jnp.where(flush, slots, 0), window)
    return y, window_pool, append_tokens(ring, x[:, None], cu_seqlens, slots, ring_start, committed)


@functools.partial(jax.jit, donate_argnames="window_pool")
def conv1d_materialize(window_pool, ring, src_slots, dst_slots, ring_start, num_entries):
    """window[dst] = the window of src after its first num_entries ring entries; see __init__."""
    return scatter_slots(window_pool, dst_slots, replay_window(window_pool, ring, src_slots, ring_start, num_entries))
