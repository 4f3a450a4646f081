"""Conv1d on the window slot pool: prefill read/write; ReplaySSM verify rows that replay the window from S0
and the ring of pre-conv inputs, and materialize the window at any committed position."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from varlen_inputs import cu_seqlens, row_lengths

from pallas_kernels.conv1d import causal_conv1d, conv1d_materialize, conv1d_prefill, conv1d_replay
from scheduler.replay import commit, flush_flags
from tests.tolerances import Float32

DIM, KC, S, K, W = 8, 4, 7, 3, 5  # W: the ring size; the ring has W + 1 + K entries
_RNG = np.random.default_rng(0)
WEIGHT = _RNG.standard_normal((DIM, KC)).astype(np.float32)
BIAS = _RNG.standard_normal(DIM).astype(np.float32)


def _pool(rng):
    pool = rng.standard_normal((S, KC - 1, DIM), np.float32)
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
    np.testing.assert_array_equal(new_pool, expected)  # null and untouched slots kept


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_replayed_rows_follow_the_accepted_stream_and_materialize_any_position(seed):
    """Two rows verify 1 + K tokens per step with random acceptance, under the scheduler's own tracker
    rules (flush, commit); outputs of accepted tokens equal one conv over the accepted stream, and
    `conv1d_materialize` rebuilds the window after any committed count."""
    rng = np.random.default_rng(seed)
    entries = W + 1 + K
    pool, ring = _pool(rng), rng.standard_normal((S, 1, entries, DIM), np.float32)  # stale ring contents
    ring[0] = 0  # the null slot
    slots = np.array([4, 1, 0], np.int32)
    streams = rng.standard_normal((2, 80, DIM), np.float32)
    windows0 = pool[slots[:2]].copy()
    start, committed = np.zeros(3, np.int32), np.zeros(3, np.int32)
    positions, outputs = [0, 0], [[], []]
    for _ in range(14):
        flush = flush_flags(committed, 1 + K, W) & (slots > 0)
        accepted = np.array([int(rng.integers(1, 2 + K)) for _ in range(2)] + [0], np.int32)
        x = np.zeros((3 * (1 + K), DIM), np.float32)
        for r in range(2):  # the accepted prefix is the true stream, the rest are rejected drafts
            x[r * (1 + K):r * (1 + K) + accepted[r]] = streams[r, positions[r]:positions[r] + accepted[r]]
            x[r * (1 + K) + accepted[r]:(r + 1) * (1 + K)] = rng.standard_normal((1 + K - accepted[r], DIM))
        cu = cu_seqlens([1 + K, 1 + K], 3)
        y, pool, ring = conv1d_replay(x, WEIGHT, BIAS, cu, pool, ring, slots, start, committed, flush)
        for r in range(2):
            outputs[r] += [(positions[r] + j, np.asarray(y[cu[r] + j])) for j in range(accepted[r])]
            positions[r] += int(accepted[r])
        start, committed = commit(start, committed, flush, accepted, entries)
    for r in range(2):
        history = np.concatenate([windows0[r], streams[r, :positions[r]]])
        y_ref, _ = causal_conv1d(streams[r], WEIGHT, BIAS, np.array([0, positions[r]], np.int32), windows0[r][None])
        for position, y in outputs[r]:
            Float32(depth=KC + 1).check(y, y_ref[position])  # KC taps and the bias
        for count in range(committed[r] + 1):  # S0 sits `committed` tokens before the row's position
            target = np.array([6], np.int32)
            out = conv1d_materialize(np.asarray(pool).copy(), ring, slots[r:r + 1], target, start[r:r + 1],
                                     np.array([count], np.int32))
            before = positions[r] - committed[r] + count
            np.testing.assert_array_equal(np.asarray(out)[6], history[before:before + KC - 1])
    assert not np.asarray(pool)[0].any() and not np.asarray(ring)[0].any()
