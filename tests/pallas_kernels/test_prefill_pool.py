"""GDN and Mamba2 chunked prefill on the slot pool: slots, has_initial, in-chunk checkpoints."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import cu_seqlens, row_lengths

from pallas_kernels.gdn import gdn_prefill, gdn_recurrent
from pallas_kernels.mamba2 import ssd_prefill, ssd_recurrent
from tests.tolerances import Float32

T, R, S, CHUNK = 96, 4, 12, 16
TOL = Float32(depth=T + 16 + CHUNK)  # a row's recurrence, the state terms, a chunk's sums
_RNG = np.random.default_rng(0)
A = -np.exp(_RNG.uniform(-1, 1, 4)).astype(np.float32)
D = _RNG.standard_normal(4).astype(np.float32)


def _gdn(rng):
    tokens = (
        rng.standard_normal((T, 2, 16), np.float32),
        rng.standard_normal((T, 2, 16), np.float32),
        rng.standard_normal((T, 4, 16), np.float32),
        -rng.exponential(0.5, (T, 4)).astype(np.float32),
        rng.uniform(0, 1, (T, 4)).astype(np.float32),
    )
    prefill = lambda cu, *pool_args: gdn_prefill(*tokens, cu, *pool_args, chunk_size=CHUNK)
    oracle = lambda cu, state: gdn_recurrent(*tokens, cu, state)
    return prefill, oracle, (S, 4, 16, 16)


def _ssd(rng):
    x, dt = rng.standard_normal((T, 4, 8), np.float32), rng.uniform(0.01, 1, (T, 4)).astype(np.float32)
    b, c = rng.standard_normal((2, T, 2, 16), np.float32)
    prefill = lambda cu, *pool_args: ssd_prefill(x, dt, A, b, c, D, cu, *pool_args, chunk_size=CHUNK)
    oracle = lambda cu, state: ssd_recurrent(x, dt, A, b, c, D, cu, state)
    return prefill, oracle, (S, 4, 8, 16)


@settings(max_examples=6, deadline=None)
@given(op=st.sampled_from([_gdn, _ssd]), lengths=row_lengths(CHUNK, T, R), seed=st.integers(0, 2**16))
def test_prefill_on_pool_matches_oracle(op, lengths, seed):
    rng = np.random.default_rng(seed)
    prefill, oracle, pool_shape = op(rng)
    cu = cu_seqlens(lengths, R)
    slot_ids = rng.permutation(np.arange(1, S))
    real = np.arange(R) < len(lengths)
    slots = np.where(real, slot_ids[:R], 0).astype(np.int32)
    ckpt_slots = np.where(real & (rng.uniform(size=R) < 0.7), slot_ids[R : 2 * R], 0).astype(np.int32)
    ckpt_lens = np.array([rng.integers(0, n + 1) for n in np.diff(cu)], np.int32)
    has_initial = rng.uniform(size=R) < 0.5
    pool = rng.standard_normal(pool_shape, np.float32)
    pool[0] = 0
    o, new_pool = prefill(cu, pool.copy(), slots, has_initial, ckpt_lens, ckpt_slots)
    new_pool, expected = np.asarray(new_pool), pool.copy()
    for r in range(R):
        start = np.where(has_initial[r], pool[slots[r]], 0)[None]
        x_cu = np.array([cu[r], cu[r + 1]], np.int32)
        o_ref, final = oracle(x_cu, start)  # tokens before cu[r] are padding for a one-row call
        TOL.check(o[cu[r] : cu[r + 1]], o_ref[cu[r] : cu[r + 1]])
        expected[slots[r]] = final[0]
        if ckpt_slots[r]:
            expected[ckpt_slots[r]] = oracle(np.array([cu[r], cu[r] + ckpt_lens[r]], np.int32), start)[1][0]
    expected[0] = 0
    TOL.check(new_pool, expected)
    assert not new_pool[0].any()
