"""The C++ FFI Mamba2 SSD kernels on CPU (pallas_kernels/mamba2/cpu) against the reference: decode, prefill and
ReplaySSM verify, the pools updated in place, ReplaySSM with W = 1 as plain decoding bit for bit. Greedy engine output
through them: tests/jaxhybrid/test_engine_greedy.py.

Tolerance: the kernels and the reference evaluate the same f32 recurrence in different orders (the kernel sums
C . h in 16 fixed lanes and uses libm's exp). Along a chain of dependent roundings a read sums N terms and every
step (a fold entry or a token) rounds its decay, its dt x, its update and its output terms: `depth` = N + 4 per
step, the earlier steps' errors carried without amplification by the contracting recurrence (tests/tolerances.py).
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import replay_sim
from ffi_kernels import (  # noqa: F401  (kernels: the module's fixture)
    E,
    S,
    T,
    check_bf16_outputs,
    check_decode,
    check_prefill,
    check_updated_in_place,
    check_verify_pools,
    check_width_one_is_plain_decoding,
    kernels,
    rows,
    state_pool,
    verify_trackers,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from ssd_replay_op import A, SsdReplay

from pallas_kernels.mamba2 import reference, ssd_decode, ssd_materialize, ssd_prefill, ssd_verify
from tests.tolerances import Float32

pytestmark = pytest.mark.usefixtures("kernels")

SHAPES = [(2, 8, 1, 8), (4, 16, 2, 8)]  # (NH, P, G, N): one group of two heads, two groups of two


def _tolerance(state_size: int, steps: int) -> Float32:
    return Float32(depth=steps * (state_size + 4))


def _tokens(rng, shape):
    nh, p, g, n = shape
    return (rng.standard_normal((T, nh, p), np.float32), rng.uniform(0.01, 1.0, (T, nh)).astype(np.float32),
            -np.exp(rng.uniform(-1, 1, nh)).astype(np.float32), rng.standard_normal((T, g, n), np.float32),
            rng.standard_normal((T, g, n), np.float32), rng.standard_normal(nh).astype(np.float32))


def _pool(rng, shape):
    nh, p, g, n = shape
    return state_pool(rng, (nh, p, n))


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_decode_matches_the_reference(shape, seed):
    rng = np.random.default_rng(seed)
    tokens, pool = _tokens(rng, shape), _pool(rng, shape)
    cu, slots = rows(rng, 1)
    expected = reference.ssd_decode(*tokens, cu, pool.copy(), slots)
    actual = ssd_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    check_decode(actual, expected, pool, cu, slots, _tolerance(shape[3], 1))


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_prefill_matches_the_reference(shape, seed):
    """Rows of up to T tokens, fresh and continued: the token recurrence against the reference's chunked form (one
    chunk here: its in-chunk sums add T terms)."""
    rng = np.random.default_rng(seed)
    tolerance = Float32(depth=_tolerance(shape[3], T).depth + T)
    check_prefill(functools.partial(ssd_prefill, backend="ffi"), reference.ssd_prefill, _tokens(rng, shape),
                  _pool(rng, shape), seed, tolerance)


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
    tokens, pool = _tokens(rng, shape), _pool(rng, shape)
    cu, slots = rows(rng, 3)
    trackers = verify_trackers(rng, cu, slots)
    rings = [rng.standard_normal((S, nh, E, p), np.float32), rng.uniform(0.01, 1.0, (S, nh, E)).astype(np.float32),
             rng.standard_normal((S, g, E, n), np.float32)]
    for ring in rings:
        ring[0] = 0
    expected = reference.ssd_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers)
    actual = ssd_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers, backend="ffi")
    steps = 1 + int(np.max(trackers[2] + np.diff(cu)))
    for i, name in enumerate(("y", "state_pool")):
        _tolerance(n, steps).check(actual[i], expected[i], name)
    for i, name in zip((2, 3, 4), ("ring_x", "ring_dt", "ring_B"), strict=True):
        np.testing.assert_array_equal(actual[i], expected[i], err_msg=name)  # the tokens' inputs, copied
    check_verify_pools(actual, pool, slots, trackers[3])


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
    check_width_one_is_plain_decoding(FfiReplay())


def test_the_pool_is_updated_in_place():
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, SHAPES[1])
    check_updated_in_place(lambda cu, pool, slots: ssd_decode(*tokens, cu, pool, slots, backend="ffi"),
                           _pool(rng, SHAPES[1]))


def test_two_rows_on_one_slot_fail():
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _pool(rng, SHAPES[0])
    with pytest.raises(Exception, match="aimed at by two rows"):
        ssd_decode(*tokens, np.array([0, 1, 2, 2, 2], np.int32), pool, np.array([3, 3, 0, 0], np.int32), backend="ffi")


def test_bf16_activations_round_alike():
    """bf16 x, B, C (the bf16 model's): both paths compute in f32 from the same upcast inputs, so the states agree
    to the f32 bound and the bf16 outputs to it plus one bf16 ulp."""
    rng = np.random.default_rng(1)
    x, dt, a, b, c, d = _tokens(rng, SHAPES[1])
    tokens = (jnp.asarray(x, jnp.bfloat16), dt, a, jnp.asarray(b, jnp.bfloat16), jnp.asarray(c, jnp.bfloat16), d)
    pool, (cu, slots) = _pool(rng, SHAPES[1]), rows(rng, 1)
    y_ref, pool_ref = reference.ssd_decode(*tokens, cu, pool.copy(), slots)
    y, pool_ffi = ssd_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    _tolerance(SHAPES[1][3], 1).check(pool_ffi, pool_ref, "state_pool")
    check_bf16_outputs(y, y_ref, SHAPES[1][3] + 4)
