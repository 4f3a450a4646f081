"""Causal depthwise conv1d over packed varlen tokens and a window slot pool.

Shapes: T packed tokens, R rows, D channels, Kc taps, S pool slots (slot 0 is the null slot: zeros,
never written; padding rows aim there), E ReplaySSM ring entries per slot (E = W + 1 + k: the
scheduler's window W and the 1 + k entries a verify row with k drafts appends, `scheduler.replay.ring_rows`).

Slot page: window_pool [S, Kc-1, D], the window (the last Kc-1 pre-conv inputs, oldest first) at the
slot's checkpoint state S0, and ring [S, 1, E, D], the pre-conv inputs after S0 in the mixer's ring
order. Like the state, the window is replayed, never rolled back: the window at any committed position
is S0's window followed by that many ring entries (docs/kernels.md#replayssm).
"""

from pallas_kernels import tuning
from pallas_kernels.backend import resolve_backend
from pallas_kernels.conv1d import pallas, reference
from pallas_kernels.conv1d.reference import causal_conv1d

__all__ = ["causal_conv1d", "conv1d_materialize", "conv1d_prefill", "conv1d_replay"]


def conv1d_prefill(
    x, weight, bias, cu_seqlens, window_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, activation=True, backend=None,
):  # fmt: skip
    """Conv over packed rows, each continuing from the window in its slot, which it then replaces.

    Args:
      x: [T, D] f32, bf16 or fp16 pre-conv inputs (the conv accumulates in f32); tokens outside
        [cu_seqlens[0], cu_seqlens[-1]) are padding.
      weight: [D, Kc]; bias: [D] or None.  cu_seqlens: [R+1] i32.
      window_pool: [S, Kc-1, D] in the activation dtype (windows are copies of inputs), donated.
      slots: [R] i32 (padding rows: 0).  has_initial: [R] bool; False rows start from a zero window.
      checkpoint_lens: optional [R] i32 in [0, row length]: also store the window after that many of
        the row's tokens ...
      checkpoint_slots: ... into this slot ([R] i32, 0 = no checkpoint).
      activation: SiLU after the conv.
      backend: "reference", "pallas" or "interpret" (the kernel interpreted on CPU); None: pallas on GPU,
        reference on CPU.

    Returns:
      y: [T, D] in x.dtype, window_pool with each row's final window (last Kc-1 of window ++ tokens).
    """
    args = (x, weight, bias, cu_seqlens, window_pool, slots, has_initial, checkpoint_lens, checkpoint_slots)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.conv1d_prefill(*args, activation=activation)
    launch = tuning.for_launcher("conv1d_prefill", pallas.conv1d_prefill,
                                 tuning.shape_class(D=x.shape[1], Kc=weight.shape[1]), "block_t", "block_d")
    return pallas.conv1d_prefill(*args, activation=activation, interpret=backend == "interpret", **launch)


def conv1d_replay(x, weight, bias, cu_seqlens, window_pool, ring, slots, ring_start, committed, flush, *,
                  activation=True, backend=None):
    """ReplaySSM conv of decode/verify rows (1 + k tokens each), the conv half of `gdn_verify` / `ssd_verify`.

    The slot keeps the window at S0 (`window_pool [S, Kc-1, D]`) and a ring of the pre-conv inputs after it
    (`ring [S, 1, E, D]`, indexed like the mixer's rings). Each row convolves its tokens from the window after
    its `committed` live entries, appends its inputs at ring positions committed .. committed + T_r - 1 (mod
    E, from ring_start) and, where `flush`, stores that window as the new S0 window. Rejecting drafts is a
    tracker move, and the window at any committed position stays rebuildable (`conv1d_materialize`).

    Args:
      x, weight, bias, cu_seqlens, slots, activation: as in `conv1d_prefill`.
      window_pool, ring: the slot page, donated.  ring_start, committed: [R] i32.  flush: [R] bool.
      backend: accepted for symmetry: a window gather and a conv over at most E tokens per row, which XLA
        fuses on every platform.

    Returns:
      y: [T, D] in x.dtype, window_pool, ring.
    """
    resolve_backend(backend)
    return reference.conv1d_replay(x, weight, bias, cu_seqlens, window_pool, ring, slots, ring_start, committed,
                                   flush, activation=activation)


def conv1d_materialize(window_pool, ring, src_slots, dst_slots, ring_start, num_entries, *, backend=None):
    """window_pool[dst] = the window of src after its first num_entries ring entries (dst 0 = skip), the conv
    half of `gdn_materialize` / `ssd_materialize`. backend: accepted for symmetry (pure data movement)."""
    resolve_backend(backend)
    return reference.conv1d_materialize(window_pool, ring, src_slots, dst_slots, ring_start, num_entries)
