"""Mamba2 (SSD) kernel cases: dims, random tokens and pools, prefill rows (Pallas and stale-slot tests)."""

import jax.numpy as jnp
import numpy as np
from ssd_replay_op import SsdReplay
from varlen_inputs import prefill_rows

NH, P, G, N, S, W = 8, 32, 2, 16, 10, 4  # 4 heads per group; P = 2 tiles of block_p
R, T_VERIFY, T_PREFILL, CHUNK = 4, 16, 128, 16
_RNG = np.random.default_rng(0)
A = -np.exp(_RNG.uniform(-1, 1, NH)).astype(np.float32)
D = _RNG.standard_normal(NH).astype(np.float32)


def random_tokens(rng, num_tokens, dtype):
    """x, dt, B, C of a packed bucket; x/B/C in `dtype`, dt fp32 (processed)."""
    x = jnp.asarray(rng.standard_normal((num_tokens, NH, P), np.float32), dtype)
    b, c = (jnp.asarray(v, dtype) for v in rng.standard_normal((2, num_tokens, G, N), np.float32))
    return x, jnp.asarray(rng.uniform(0.01, 1.0, (num_tokens, NH)), jnp.float32), b, c


def random_pools(rng):
    """Random slot pages (S0, ring_x, ring_dt, ring_B) with a zero null slot, as numpy."""
    return SsdReplay.make_pools(W, rng, (S, NH, P, G, N))


def prefill_case(lengths, rng, dtype):
    slot_ids = rng.permutation(np.arange(1, S))
    args = dict(
        zip(("x", "dt", "B", "C"), random_tokens(rng, T_PREFILL, dtype), strict=True), A=A, D=D,
        **prefill_rows(rng, lengths, R, slot_ids, initial_rate=0.6, checkpoint_past_end=True),
    )  # fmt: skip
    pool = random_pools(rng)[0]
    pool[args["slots"][~args["has_initial"]]] = np.nan  # stale contents must not leak into fresh rows
    pool[0] = 0
    return args, pool
