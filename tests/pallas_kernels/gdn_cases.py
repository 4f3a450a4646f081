"""GDN prefill cases: packed rows in one (T, R) bucket (Pallas and stale-slot tests)."""

import jax.numpy as jnp
import numpy as np
from varlen_inputs import prefill_rows

# Chunk 32: two 16-row blocks, so the kernel's blocked (I + A)^-1 merges; the chunk-64 tests merge four.
T, R, S, CHUNK, KERNEL_CHUNK = 96, 4, 12, 32, 64


def prefill_inputs(lengths, seed, dtype=jnp.float32):
    """Packed rows in one (T, R) bucket, distinct random slots, random has_initial and checkpoints.

    GVA: 2 qk heads, 4 value heads. Head dims are 16 so that the same inputs compile on a GPU (Triton dots
    need 16).
    """
    rng = np.random.default_rng(seed)
    slot_ids = rng.permutation(np.arange(1, S))
    pool = rng.standard_normal((S, 4, 16, 16), np.float32)
    pool[0] = 0
    return dict(
        q=jnp.asarray(rng.standard_normal((T, 2, 16), np.float32), dtype),
        k=jnp.asarray(rng.standard_normal((T, 2, 16), np.float32), dtype),
        v=jnp.asarray(rng.standard_normal((T, 4, 16), np.float32), dtype),
        g=-rng.exponential(0.5, (T, 4)).astype(np.float32),
        beta=rng.uniform(0, 1, (T, 4)).astype(np.float32),
        state_pool=pool,
        **prefill_rows(rng, lengths, R, slot_ids),
    )
