"""Mamba2 SSD (selective state space) over packed varlen tokens and a state-slot pool.

Shapes: T packed tokens, R rows, NH heads of dim P, G groups of B/C (head h reads group h // (NH // G)),
N state size, S pool slots (slot 0 is the null slot: zeros, never written; padding rows aim there),
E ReplaySSM ring entries per slot (E = W + 1 + k: the scheduler's window W and the 1 + k entries a
verify row with k drafts appends, `scheduler.replay.ring_rows`), C chunk.

Activations x, B, C (and y, returned in x.dtype) are f32, bf16 or fp16, one dtype per prefill call; dt, A,
D, the state pool and the rings are f32 (ring appends upcast). Kernels accumulate in f32.

Slot page (one row of each pool, all fp32):
  state_pool [S, NH, P, N]   checkpoint state S0
  ring_x     [S, NH, E, P]   x of recent tokens
  ring_dt    [S, NH, E]      processed dt (after softplus(dt + bias) and clamping)
  ring_B     [S, G, E, N]    B per group
Ring entry j of a row lives at ring index (ring_start + j) % E; the first `committed` entries are live:
the state after them is S0 advanced by each entry in turn (h <- e^{dt A} h + dt x (x) B). Trackers are
owned by the scheduler and passed per row (docs/kernels.md#replayssm).
"""

import jax.numpy as jnp

from pallas_kernels import tuning
from pallas_kernels.backend import resolve_backend
from pallas_kernels.mamba2 import cpu, pallas, pallas_prefill, reference
from pallas_kernels.mamba2.reference import ssd_chunked, ssd_recurrent

__all__ = [
    "ssd_chunked", "ssd_decode", "ssd_materialize", "ssd_prefill", "ssd_recurrent", "ssd_verify",
    "ssd_verify_snapshots",
]


def ssd_prefill(
    x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens=None, checkpoint_slots=None,
    *, chunk_size=128, backend=None,
):  # fmt: skip
    """Chunked SSD (docs/kernels.md#mamba2-ssd) varlen prefill reading and writing row states in the slot pool.

    Args:
      x: [T, NH, P]; dt: [T, NH] f32 processed; A, D: [NH] f32; B, C: [T, G, N] in x.dtype (see
        `ssd_recurrent`).
      cu_seqlens: [R+1] i32; tokens outside [cu_seqlens[0], cu_seqlens[-1]) are padding.
      state_pool: [S, NH, P, N] f32, donated and updated in place.
      slots: [R] i32 running slot per row (padding rows: 0).
      has_initial: [R] bool; False rows start from zeros whatever their slot holds.
      checkpoint_lens: optional [R] i32 in [0, row length]: also store the state after that many of the
        row's tokens ...
      checkpoint_slots: ... into this slot ([R] i32, 0 = no checkpoint).
      chunk_size: C; each row is chunked from its own first token.
      backend: "reference", "pallas" (Triton), "interpret" (the Pallas kernel on CPU) or "ffi" (the C++ CPU
        kernel, token by token, `pallas_kernels.mamba2.cpu`); None picks "pallas" on GPU, else "reference".

    Returns:
      y: [T, NH, P] in x.dtype, state_pool with each row's final state in its slot.
    """
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, slots, has_initial, checkpoint_lens, checkpoint_slots)
    if backend == "ffi":
        return cpu.ssd_prefill(*args, chunk_size=chunk_size)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ssd_prefill(*args, chunk_size=chunk_size)
    launch = _launch("ssd_prefill", pallas_prefill.ssd_prefill, state_pool, "block_p", "block_t", "state_parts",
                     dtype=jnp.dtype(x.dtype))
    return pallas_prefill.ssd_prefill(*args, chunk_size=chunk_size, interpret=backend == "interpret", **launch)


def ssd_decode(x, dt, A, B, C, D, cu_seqlens, state_pool, slots, *, backend=None):
    """Plain decoding: rows of 0 or 1 token; each row's state is read from and written back to its slot.

    backend: "reference", "pallas", "interpret" or "ffi" (the C++ CPU kernel, `pallas_kernels.mamba2.cpu`; the
    reference where it cannot be built); None: pallas on GPU, reference on CPU.
    """
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, slots)
    if backend == "ffi":
        return cpu.ssd_decode(*args)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ssd_decode(*args)
    launch = _launch("ssd_decode", pallas.ssd_decode, state_pool, "block_p")
    return pallas.ssd_decode(*args, interpret=backend == "interpret", **launch)


def ssd_verify(
    x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush,
    *, max_query_len=None, max_committed=None, backend=None,
):  # fmt: skip
    """ReplaySSM verify/decode: each row has T_r = 1 + k tokens (1 for plain decode), T_r <= E.

    Outputs equal sequential decoding from (S0 advanced by the `committed` live entries). The state
    pool is written only for rows with `flush`: S0 <- S0 advanced by the committed entries. Every row
    appends its T_r new entries (x, dt, B) at ring positions committed .. committed + T_r - 1 (mod E,
    from ring_start). The caller then commits: committed' = accepted if flush else committed + accepted;
    on flush ring_start' = (ring_start + committed) % E. Needs committed + T_r <= E unless flushing.

    Args:
      x, dt, A, B, C, D, cu_seqlens, slots: as in `ssd_prefill`.
      state_pool, ring_x, ring_dt, ring_B: the slot page (module docstring), donated, updated in place.
      ring_start, committed: [R] i32 trackers of each row's slot.  flush: [R] bool.
      max_query_len, max_committed: static bounds on every T_r and every committed, as in `gdn_verify`.
      backend: as in `ssd_decode`.

    Returns:
      y: [T, NH, P] in x.dtype, state_pool, ring_x, ring_dt, ring_B.
    """
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, ring_x, ring_dt, ring_B, slots, ring_start, committed, flush)
    if backend == "ffi":
        return cpu.ssd_verify(*args, max_query_len=max_query_len, max_committed=max_committed)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ssd_verify(*args, max_query_len=max_query_len, max_committed=max_committed)
    launch = _launch("ssd_verify", pallas.ssd_verify, state_pool, "block_p")
    return pallas.ssd_verify(*args, interpret=backend == "interpret", **launch)


def ssd_verify_snapshots(
    x, dt, A, B, C, D, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush,
    *, max_query_len=None, backend=None,
):  # fmt: skip
    """`ssd_verify` for the snapshot-every-position baseline: ring entry j is the full state after it.

    The same trackers and results as `ssd_verify` with `snapshots` [S, NH, E, P, N] f32 in place of the
    rings (contract: `pallas_kernels.gdn.gdn_verify_snapshots`). Materializing is
    `pallas_kernels.rings.snapshot_materialize`. backend "ffi" runs the reference: the CPU kernels cover the
    ReplaySSM rings only.

    Returns:
      y: [T, NH, P] in x.dtype, state_pool, snapshots.
    """
    args = (x, dt, A, B, C, D, cu_seqlens, state_pool, snapshots, slots, ring_start, committed, flush)
    backend = resolve_backend("reference" if backend == "ffi" else backend)
    if backend == "reference":
        return reference.ssd_verify_snapshots(*args, max_query_len=max_query_len)
    launch = _launch("ssd_verify_snapshots", pallas.ssd_verify_snapshots, state_pool, "block_p")
    return pallas.ssd_verify_snapshots(*args, interpret=backend == "interpret", **launch)


def ssd_materialize(
    state_pool, ring_x, ring_dt, ring_B, A, src_slots, dst_slots, ring_start, num_entries, *, max_committed=None,
    backend=None,
):
    """state_pool[dst] = S0 of src advanced by its first num_entries ring entries; src and rings untouched.

    Args:
      state_pool: [S, NH, P, N] f32, donated.  ring_x, ring_dt, ring_B: the rings.  A: [NH] f32.
      src_slots, dst_slots: [M] i32 (dst 0 = skip).  ring_start, num_entries: [M] i32 of the src slot.
      max_committed: static bound on every num_entries, as in `gdn_verify`.
    """
    args = (state_pool, ring_x, ring_dt, ring_B, A, src_slots, dst_slots, ring_start, num_entries)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ssd_materialize(*args, max_committed=max_committed)
    launch = _launch("ssd_materialize", pallas.ssd_materialize, state_pool, "block_p")
    return pallas.ssd_materialize(*args, interpret=backend == "interpret", **launch)


def _launch(op, launcher, state_pool, *tiles, dtype=None):
    return tuning.for_state_pool(op, launcher, state_pool, ("P", "N"), *tiles, dtype=dtype)
