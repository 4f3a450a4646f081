"""Conv1d on the window slot pool: prefill read/write, verify + rollback to the last accepted token."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import cu_seqlens, row_lengths

from pallas_kernels.conv1d import causal_conv1d, conv1d_prefill, conv1d_rollback, conv1d_verify
from tests.tolerances import Float32

DIM, KC, E, S = 8, 4, 4, 7
_RNG = np.random.default_rng(0)
WEIGHT = _RNG.standard_normal((DIM, KC)).astype(np.float32)
BIAS = _RNG.standard_normal(DIM).astype(np.float32)


def _pool(rng):
    pool = rng.standard_normal((S, KC - 1 + E, DIM), np.float32)
    pool[0] = 0
    return pool


@settings(max_examples=8, deadline=None)
@given(lengths=row_lengths(KC, 32, 4), seed=st.integers(0, 2**16))
def test_prefill_reads_and_writes_slots(lengths, seed):
    rng = np.random.default_rng(seed)
    pool, x = _pool(rng), rng.standard_normal((32, DIM), np.float32)
    cu = cu_seqlens(lengths, 4)
    slots = np.array([5, 2, 6, 0], np.int32)[: len(lengths)].tolist() + [0] * (4 - len(lengths))
    slots, has_initial = np.array(slots, np.int32), rng.uniform(size=4) < 0.5
    window = np.where(has_initial[:, None, None], pool[slots, : KC - 1], 0)
    y_ref, final_ref = causal_conv1d(x, WEIGHT, BIAS, cu, window)
    y, new_pool = conv1d_prefill(x, WEIGHT, BIAS, cu, pool.copy(), slots, has_initial)
    np.testing.assert_array_equal(y, y_ref)
    expected = pool.copy()
    expected[slots[slots > 0], : KC - 1] = np.asarray(final_ref)[slots > 0]
    np.testing.assert_array_equal(new_pool, expected)  # null, untouched slots and verify columns kept


def test_verify_and_rollback_track_the_accepted_stream():
    rng = np.random.default_rng(1)
    pool = _pool(rng)
    slots = np.array([4, 1, 0], np.int32)
    streams = rng.standard_normal((2, 64, DIM), np.float32)
    windows0 = pool[slots[:2], : KC - 1].copy()
    positions, outputs = [0, 0], [[], []]
    for _ in range(12):
        batch, accepted = [], []
        for r in range(2):
            drafts = int(rng.integers(0, E))
            n = int(rng.integers(0, drafts + 1)) + 1
            true = streams[r, positions[r] : positions[r] + n]
            batch.append(np.concatenate([true, rng.standard_normal((1 + drafts - n, DIM), np.float32)]))
            accepted.append(n)
        x = np.zeros((2 * E, DIM), np.float32)
        x[: sum(map(len, batch))] = np.concatenate(batch)
        cu = cu_seqlens([len(b) for b in batch], 3)
        y, pool = conv1d_verify(x, WEIGHT, BIAS, cu, pool, slots)
        for r in range(2):
            outputs[r] += [(positions[r] + j, np.asarray(y[cu[r] + j])) for j in range(accepted[r])]
            positions[r] += accepted[r]
        pool = conv1d_rollback(pool, slots, np.array(accepted + [0], np.int32), kernel_size=KC)
        for r in range(2):
            history = np.concatenate([windows0[r], streams[r, : positions[r]]])
            np.testing.assert_array_equal(np.asarray(pool)[slots[r], : KC - 1], history[-(KC - 1) :])
    for r in range(2):
        cu = np.array([0, positions[r]], np.int32)
        y_ref, _ = causal_conv1d(streams[r], WEIGHT, BIAS, cu, windows0[r][None])
        for position, y in outputs[r]:
            Float32(depth=KC + 1).check(y, y_ref[position])  # KC taps and the bias
    assert not np.asarray(pool)[0].any()
