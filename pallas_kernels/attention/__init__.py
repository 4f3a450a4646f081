"""Ragged paged attention over packed varlen queries and a paged KV pool.

Shapes: T packed tokens, R rows, HQ query heads, HKV kv heads (query head h reads kv head
h // (HQ // HKV)), Dh head dim, NB pool blocks of BS tokens (block 0 is the null block), MB blocks per
row in `block_table`.
"""

from pallas_kernels import tuning
from pallas_kernels.attention import pallas, reference
from pallas_kernels.backend import resolve_backend

__all__ = ["ragged_paged_attention"]


def ragged_paged_attention(
    q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens, *, scale, backend=None,
    k_scale: float = 1.0, v_scale: float = 1.0, block_m: int | None = None, num_splits: int | None = None,
):  # fmt: skip
    """Write the new K/V into the paged pool, then attend causally within each row (one call for all
    row kinds: prefill chunks, decode and verify rows).

    Query token i of row r sits at position context_lens[r] + i and sees cache positions 0..that position
    of row r, read through block_table[r]. Softmax in fp32. Names and meanings are the BatchPlan's.

    Args:
      q: [T, HQ, Dh] packed queries, f32, bf16 or fp16 (the kernel's dots run in q.dtype with f32
        accumulation, whatever the pools hold); tokens at index >= cu_seqlens[-1] are padding.
      k, v: [T, HKV, Dh] new keys/values.
      k_pool, v_pool: [NB, BS, HKV, Dh] in the model's dtype or float8_e4m3fn; returned updated (donate them at
        the caller's jit). An fp8 pool stores K / k_scale and V / v_scale saturated to +-448; reads dequantize.
      slot_mapping: [T] i32 flat slot (block * BS + offset) per token; padding tokens -> 0 (null block).
      block_table: [R, MB] i32 block ids per row.  cu_seqlens: [R+1] i32.
      context_lens: [R] i32 tokens of each row in the cache before this step (the plan's).
      scale: softmax scale.  k_scale, v_scale: the pools' per-tensor scales (floats; 1.0 is vLLM's default).
      backend: "reference" | "pallas" | "interpret"; None = pallas on GPU.
      block_m, num_splits: the kernel's tiling (dot rows per program, KV splits per query tile; see
        `pallas.ragged_paged_attention`); None: block_m as measured for this shape class
        (`pallas_kernels.tuning`), else both from the static shapes. The reference ignores them.

    Returns:
      o: [T, HQ, Dh] in q.dtype (padding tokens zero), k_pool, v_pool.
    """
    args = (q, k, v, k_pool, v_pool, slot_mapping, block_table, cu_seqlens, context_lens)
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference.ragged_paged_attention(*args, scale=scale, k_scale=k_scale, v_scale=v_scale)
    # decode-sized and prefill-sized buckets get different tiles by default, so they are separate classes
    kind = pallas.default_block_m(q.shape[0], block_table.shape[0], q.dtype)
    launch = tuning.for_launcher("ragged_paged_attention", pallas.ragged_paged_attention,
                                 tuning.shape_class(Dh=q.shape[2], G=q.shape[1] // k.shape[1], M=kind), "block_m")
    if block_m is not None:
        launch["block_m"] = block_m
    return pallas.ragged_paged_attention(*args, scale=scale, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits,
                                         **launch,
                                         interpret=backend == "interpret")
