"""Conv1d prefill cases: packed rows in distinct slots (Pallas and stale-slot tests)."""

import numpy as np
from varlen_inputs import prefill_rows

DIM, KC, S, T, R = 16, 4, 12, 32, 4


def make_inputs(lengths, seed, dtype=np.float32):
    """Random rows in distinct slots; x and the window pool in the activation dtype, like the model's pools."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((S, KC - 1, DIM), np.float32)
    pool[0] = 0
    slot_ids = rng.permutation(np.arange(1, S))
    return dict(
        x=rng.standard_normal((T, DIM), np.float32).astype(dtype),
        weight=rng.standard_normal((DIM, KC), np.float32),
        bias=rng.standard_normal(DIM).astype(np.float32),
        window_pool=pool.astype(dtype),
        **prefill_rows(rng, lengths, R, slot_ids),
    )
