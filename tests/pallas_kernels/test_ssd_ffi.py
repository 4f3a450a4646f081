"""The C++ FFI Mamba2 SSD kernels on CPU (pallas_kernels/mamba2/cpu) against the reference: decode and ReplaySSM
verify, the pools updated in place, ReplaySSM with W = 1 as plain decoding bit for bit. Greedy engine output
through them: tests/jaxhybrid/test_engine_greedy.py.

Tolerance: the kernels and the reference evaluate the same f32 recurrence in different orders (the kernel sums
C . h in 16 fixed lanes and uses libm's exp). Along a chain of dependent roundings a read sums N terms and every
step (a fold entry or a token) rounds its decay, its dt x, its update and its output terms: `depth` = N + 4 per
step, the earlier steps' errors carried without amplification by the contracting recurrence (tests/tolerances.py).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import replay_sim
from ffi_kernels import kernels  # noqa: F401  (the module's fixture)
from hypothesis import given, settings
from hypothesis import strategies as st
from ssd_replay_op import A, SsdReplay

from pallas_kernels.mamba2 import reference, ssd_decode, ssd_materialize, ssd_verify
from tests.tolerances import Float32

pytestmark = pytest.mark.usefixtures("kernels")

T, R, S, E = 8, 4, 8, 5
SHAPES = [(2, 8, 1, 8), (4, 16, 2, 8)]  # (NH, P, G, N): one group of two heads, two groups of two


def _tolerance(state_size: int, steps: int) -> Float32:
    return Float32(depth=steps * (state_size + 4))


def _tokens(rng, shape):
    nh, p, g, n = shape
    return (rng.standard_normal((T, nh, p), np.float32), rng.uniform(0.01, 1.0, (T, nh)).astype(np.float32),
            -np.exp(rng.uniform(-1, 1, nh)).astype(np.float32), rng.standard_normal((T, g, n), np.float32),
            rng.standard_normal((T, g, n), np.float32), rng.standard_normal(nh).astype(np.float32))


def _state_pool(rng, shape):
    nh, p, g, n = shape
    pool = rng.standard_normal((S, nh, p, n), np.float32)
    pool[0] = 0
    return pool


def _rows(rng, max_length):
    """R rows of 0..max_length tokens (at most T in all) on distinct running slots, some aimed at the null slot."""
    lengths = rng.integers(0, max_length + 1, R)
    while lengths.sum() > T:
        lengths[np.argmax(lengths)] -= 1
    slots = rng.permutation(np.arange(1, S))[:R].astype(np.int32)
    slots[rng.uniform(size=R) < 0.3] = 0  # padding rows
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), slots


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_decode_matches_the_reference(shape, seed):
    rng = np.random.default_rng(seed)
    tokens, pool = _tokens(rng, shape), _state_pool(rng, shape)
    cu, slots = _rows(rng, 1)
    y_ref, pool_ref = reference.ssd_decode(*tokens, cu, pool.copy(), slots)
    y, pool_ffi = ssd_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    tol = _tolerance(shape[3], 1)
    tol.check(y, y_ref, "y")
    tol.check(pool_ffi, pool_ref, "state_pool")
    assert not np.asarray(y)[cu[-1]:].any()  # padding tokens
    untouched = np.setdiff1d(np.arange(S), slots[np.diff(cu) > 0])  # the null slot, idle rows and other slots
    np.testing.assert_array_equal(np.asarray(pool_ffi)[untouched], pool[untouched])


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_verify_matches_the_reference(shape, seed):
    """One call on random trackers: flushing and not, rings wrapping, padding rows, empty rows."""
    _check_verify(shape, seed)


def test_work_shared_among_threads_matches_the_reference():
    """States of 64 x 128 in two groups of four heads: enough work that the kernel hands (row, group) items to
    XLA's other threads."""
    _check_verify((8, 64, 2, 128), seed=5)


def _check_verify(shape, seed):
    rng = np.random.default_rng(seed)
    nh, p, g, n = shape
    tokens, pool = _tokens(rng, shape), _state_pool(rng, shape)
    cu, slots = _rows(rng, 3)
    lengths = np.diff(cu)
    flush = rng.uniform(size=R) < 0.5
    # committed + T_r <= E unless flushing
    committed = np.where(flush, rng.integers(0, E + 1, R), rng.integers(0, E - lengths + 1)).astype(np.int32)
    ring_start = rng.integers(0, E, R).astype(np.int32)
    rings = [rng.standard_normal((S, nh, E, p), np.float32), rng.uniform(0.01, 1.0, (S, nh, E)).astype(np.float32),
             rng.standard_normal((S, g, E, n), np.float32)]
    for ring in rings:
        ring[0] = 0
    trackers = (slots, ring_start, committed, flush)
    expected = reference.ssd_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers)
    actual = ssd_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers, backend="ffi")
    steps = 1 + int(np.max(committed + lengths))
    for i, name in enumerate(("y", "state_pool")):
        _tolerance(n, steps).check(actual[i], expected[i], name)
    for i, name in zip((2, 3, 4), ("ring_x", "ring_dt", "ring_B"), strict=True):
        np.testing.assert_array_equal(actual[i], expected[i], err_msg=name)  # the tokens' inputs, copied
    for pool_out in actual[1:]:
        assert not np.asarray(pool_out)[0].any()  # the null slot is never written
    kept = np.setdiff1d(np.arange(S), slots[flush])
    np.testing.assert_array_equal(np.asarray(actual[1])[kept], pool[kept])  # only a flush writes a state


class FfiReplay(SsdReplay):
    """The replay simulation's op on the FFI kernels (materialize has none: the reference)."""

    def __init__(self, max_query_len=None, max_committed=None):
        super().__init__("ffi", max_query_len, max_committed)

    def materialize(self, pools, src, dst, ring_start, num_entries):
        return ssd_materialize(*pools, A, src, dst, ring_start, num_entries, max_committed=self.max_committed)


@settings(max_examples=3, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_steps_match_recurrent_decoding(max_drafts, seed, data):
    replay_sim.check_verify_matches_recurrent_decoding(FfiReplay(), max_drafts, seed, data)


def test_width_one_is_bit_identical_to_plain_decoding():
    """W = 1: each verify folds and flushes the entry the step before appended, the very update a decode makes, so
    its outputs and its flushed states are plain decoding's bits (a state lags one token: the last is in the ring)."""
    op, rng = FfiReplay(), np.random.default_rng(3)
    pools = op.make_pools(1, rng)
    plain = pools[0].copy()
    slots, cu = np.array([3, 1, 0], np.int32), np.array([0, 1, 2, 2], np.int32)  # the third row is padding
    committed = np.zeros(3, np.int32)
    for _ in range(7):
        tokens = op.tokens(rng, 3)
        out, pools = op.verify(tokens, cu, pools, slots, np.zeros(3, np.int32), committed, committed > 0)
        np.testing.assert_array_equal(np.asarray(pools[0]), np.asarray(plain))
        out_plain, plain = op.decode(tokens, cu, plain, slots)
        np.testing.assert_array_equal(np.asarray(out)[:2], np.asarray(out_plain)[:2])
        committed = np.array([1, 1, 0], np.int32)


def test_the_pool_is_updated_in_place():
    rng = np.random.default_rng(0)
    tokens, host_pool = _tokens(rng, SHAPES[1]), _state_pool(rng, SHAPES[1])
    cu, slots = np.array([0, 1, 2, 2, 3], np.int32), np.array([3, 0, 5, 6], np.int32)
    pool = jnp.asarray(host_pool)
    address = pool.unsafe_buffer_pointer()
    _, updated = ssd_decode(*tokens, cu, pool, slots, backend="ffi")
    assert pool.is_deleted() and updated.unsafe_buffer_pointer() == address  # donated, aliased: no copy
    np.testing.assert_array_equal(np.asarray(updated)[[0, 1, 2, 4, 5, 7]], host_pool[[0, 1, 2, 4, 5, 7]])
    assert not np.array_equal(np.asarray(updated)[[3, 6]], host_pool[[3, 6]])


def test_two_rows_on_one_slot_fail():
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _state_pool(rng, SHAPES[0])
    with pytest.raises(Exception, match="aimed at by two rows"):
        ssd_decode(*tokens, np.array([0, 1, 2, 2, 2], np.int32), pool, np.array([3, 3, 0, 0], np.int32), backend="ffi")
