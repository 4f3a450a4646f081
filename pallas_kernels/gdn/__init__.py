"""Gated DeltaNet (gated delta rule) over packed varlen tokens and a state-slot pool.

Shapes (FLA letters): T packed tokens, R rows, H qk heads, HV value heads (HV % H == 0; value head h
reads qk head h // (HV // H)), K/V head dims, S pool slots (slot 0 is the null slot: all zeros, never
written; padding rows aim there), E ReplaySSM ring entries per slot (E = W + 1 + k: the scheduler's
window W and the 1 + k entries a verify row with k drafts appends, `scheduler.replay.ring_rows`), C chunk.

Slot page (one row of each pool, all fp32):
  state_pool [S, HV, K, V]   checkpoint state S0, K-major
  ring_k     [S, H, E, K]    l2-normalised keys k^ of recent tokens (per qk head, unscaled)
  ring_u     [S, HV, E, V]   corrected updates u = beta (v - (e^g S)^T k^) (docs/kernels.md#gated-delta-rule)
  ring_g     [S, HV, E]      log-decays g
Ring entry j of a row lives at ring index (ring_start + j) % E; the first `committed` entries are live:
the state after them is S0 advanced by each entry in turn (S <- e^g S + k^ (x) u). Trackers
(`ring_start`, `committed`, `flush`) are owned by the scheduler and passed per row; the ops never move
them (docs/kernels.md#replayssm).
"""

import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.backend import resolve_backend
from pallas_kernels.gdn import cpu, pallas, pallas_prefill, reference
from pallas_kernels.gdn.reference import gdn_chunked, gdn_recurrent

REFERENCE_CHUNK = 16
# The kernel's chunk by activation dtype: tensor-core tiles of 64 rows; f32's 3xTF32 dots hold each operand as
# two TF32 halves, and at chunk 32 or 64 the intra-chunk and output calls spill (`benchmarks/aot_kernels.py`).
KERNEL_CHUNK = {jnp.dtype(jnp.bfloat16): 64, jnp.dtype(jnp.float16): 64, jnp.dtype(jnp.float32): 16}

__all__ = [
    "gdn_chunked", "gdn_decode", "gdn_materialize", "gdn_prefill", "gdn_recurrent", "gdn_verify",
    "gdn_verify_snapshots",
]


def gdn_prefill(
    q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, scale=None, use_qk_l2norm=True, chunk_size=None, backend=None,
):  # fmt: skip
    """Chunked (WY/UT form) varlen prefill reading and writing row states in the slot pool.

    The maths: docs/kernels.md#gated-delta-rule.

    Args:
      q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV] f32 (see `gdn_recurrent`). q, k, v are f32, bf16
        or fp16; the Pallas kernel's dots take their dtype and accumulate in f32.
      cu_seqlens: [R+1] i32; tokens outside [cu_seqlens[0], cu_seqlens[-1]) are padding.
      state_pool: [S, HV, K, V] f32, donated and updated in place.
      slots: [R] i32 running slot per row (padding rows: 0).
      has_initial: [R] bool; False rows start from zeros whatever their slot holds.
      checkpoint_lens: optional [R] i32 in [0, row length]: also store the state after that many of the
        row's tokens ...
      checkpoint_slots: ... into this slot ([R] i32, 0 = no checkpoint).
      chunk_size: C (for the Pallas kernel a power of two >= 16: whole 16-row blocks); each row is chunked
        from its own first token.
        None: `KERNEL_CHUNK` of the activations' dtype for the kernel (64; f32: 16), 16 for the reference,
        whose in-chunk solve costs C^2 per token (docs/benchmarks.md#where-a-cpu-decode-step-goes).
      backend: "reference", "pallas", "interpret" (the Pallas kernel interpreted on CPU) or "ffi" (the C++ CPU
        kernel, token by token, `pallas_kernels.gdn.cpu`); None: pallas on GPU, reference on CPU.

    Returns:
      o: [T, HV, V] in v.dtype, state_pool with each row's final state in its slot.
    """
    args = (q, k, v, g, beta, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens, checkpoint_slots)
    if backend == "ffi":
        chunk_size = chunk_size or REFERENCE_CHUNK  # for mid-row checkpoints, which run the reference
        return cpu.gdn_prefill(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    backend = resolve_backend(backend)
    chunk_size = chunk_size or (REFERENCE_CHUNK if backend == "reference" else KERNEL_CHUNK[jnp.dtype(v.dtype)])
    options = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    if backend == "reference":
        return reference.gdn_prefill(*args, **options)
    launch = _launch("gdn_prefill", pallas_prefill.gdn_prefill, state_pool, "state_block_v", "output_block_v",
                     dtype=jnp.dtype(v.dtype))
    return pallas_prefill.gdn_prefill(*args, **options, interpret=backend == "interpret", **launch)


def gdn_decode(q, k, v, g, beta, cu_seqlens, state_pool, slots, *, scale=None, use_qk_l2norm=True, backend=None):
    """Plain decoding: rows of 0 or 1 token; each row's state is read from and written back to its slot.

    Arguments as in `gdn_prefill` (no has_initial: decode rows always continue a state); backend:
    "reference", "pallas", "interpret" (the Pallas kernel interpreted on CPU) or "ffi" (the C++ CPU kernel,
    `pallas_kernels.gdn.cpu`; the reference where it cannot be built); None: pallas on GPU, reference on CPU.
    """
    if backend == "ffi":
        return cpu.gdn_decode(q, k, v, g, beta, cu_seqlens, state_pool, slots, scale=scale, use_qk_l2norm=use_qk_l2norm)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.gdn_decode(
            q, k, v, g, beta, cu_seqlens, state_pool, slots, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
    return pallas.gdn_decode(
        q, k, v, g, beta, cu_seqlens, state_pool, slots, scale=scale, use_qk_l2norm=use_qk_l2norm,
        interpret=backend == "interpret", **_launch("gdn_decode", pallas.gdn_decode, state_pool, "block_v"),
    )  # fmt: skip


def gdn_verify(
    q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, max_query_len=None, max_committed=None, backend=None,
):  # fmt: skip
    """ReplaySSM verify/decode: each row has T_r = 1 + k tokens (1 for plain decode), T_r <= E.

    Outputs equal sequential decoding from (S0 advanced by the `committed` live entries). The state
    pool is written only for rows with `flush`: S0 <- S0 advanced by the committed entries. Every row
    appends its T_r new entries (k^, u, g) at ring positions committed .. committed + T_r - 1 (mod E,
    from ring_start); entries past the accepted ones are garbage that later calls overwrite. The caller
    then commits: committed' = accepted if flush else committed + accepted; on flush
    ring_start' = (ring_start + committed) % E. Needs committed + T_r <= E unless flushing.

    Args:
      q, k, v, g, beta, cu_seqlens, slots: as in `gdn_prefill`.
      state_pool, ring_k, ring_u, ring_g: the slot page (module docstring), donated, updated in place.
      ring_start, committed: [R] i32 trackers of each row's slot.  flush: [R] bool.
      max_query_len: static bound on every T_r (1 + k); the reference steps through this many tokens per
        row (None: the ring's width, which always holds). The Pallas kernel stops at each row's own T_r.
      max_committed: static bound on every `committed`; the reference folds this many entries per row, masked
        (None: the ring's width). The engine's is `scheduler.replay.max_committed`. The Pallas kernel stops at
        each row's own count.
      backend: "reference", "pallas", "interpret" or "ffi" (as in `gdn_decode`); None: pallas on GPU,
        reference on CPU.

    Returns:
      o: [T, HV, V] in v.dtype, state_pool, ring_k, ring_u, ring_g.
    """
    args = (q, k, v, g, beta, cu_seqlens, state_pool, ring_k, ring_u, ring_g, slots, ring_start, committed, flush)
    if backend == "ffi":
        return cpu.gdn_verify(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, max_query_len=max_query_len,
                              max_committed=max_committed)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.gdn_verify(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, max_query_len=max_query_len,
                                    max_committed=max_committed)
    launch = _launch("gdn_verify", pallas.gdn_verify, state_pool, "block_v")
    return pallas.gdn_verify(*args, scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret",
                             **launch)


def gdn_verify_snapshots(
    q, k, v, g, beta, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
    *, scale=None, use_qk_l2norm=True, max_query_len=None, backend=None,
):  # fmt: skip
    """`gdn_verify` for the snapshot-every-position baseline: ring entry j is the full state after it.

    The same trackers and results as `gdn_verify` with `snapshots` [S, HV, E, K, V] f32 in place of the
    rings: the live state (S0 advanced by `committed` entries) is read whole from the snapshot at
    (ring_start + committed - 1) % E, or S0 when nothing is committed; a flush writes it to S0; the
    state after each of the row's T_r tokens is stored at ring positions committed .. committed + T_r - 1
    (mod E, from ring_start). Materializing is `pallas_kernels.rings.snapshot_materialize`.

    backend "ffi" runs the reference: the CPU kernels cover the ReplaySSM rings only.

    Returns:
      o: [T, HV, V] in v.dtype, state_pool, snapshots.
    """
    args = (q, k, v, g, beta, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush)
    backend = resolve_backend("reference" if backend == "ffi" else backend)
    if backend == "reference":
        return reference.gdn_verify_snapshots(*args, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                              max_query_len=max_query_len)
    launch = _launch("gdn_verify_snapshots", pallas.gdn_verify_snapshots, state_pool, "block_v")
    return pallas.gdn_verify_snapshots(*args, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                       interpret=backend == "interpret", **launch)


def gdn_materialize(state_pool, ring_k, ring_u, ring_g, src_slots, dst_slots, ring_start, num_entries, *,
                    max_committed=None, backend=None):
    """state_pool[dst] = S0 of src advanced by its first num_entries ring entries; src and rings untouched.

    Args:
      state_pool: [S, HV, K, V] f32, donated.  ring_k, ring_u, ring_g: the rings (module docstring).
      src_slots, dst_slots: [M] i32 (dst 0 = skip; no dst may also be a src).
      ring_start, num_entries: [M] i32 of the src slot.
      max_committed: static bound on every num_entries, as in `gdn_verify`.
      backend: "reference", "pallas" or "interpret"; None: pallas on GPU, reference on CPU.
    """
    args = (state_pool, ring_k, ring_u, ring_g, src_slots, dst_slots, ring_start, num_entries)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.gdn_materialize(*args, max_committed=max_committed)
    launch = _launch("gdn_materialize", pallas.gdn_materialize, state_pool, "block_v")
    return pallas.gdn_materialize(*args, interpret=backend == "interpret", **launch)


def _launch(op, launcher, state_pool, *tiles, dtype=None):
    return tuning.for_state_pool(op, launcher, state_pool, ("K", "V"), *tiles, dtype=dtype)
