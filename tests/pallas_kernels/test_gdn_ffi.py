"""The C++ FFI GDN kernels on CPU (pallas_kernels/gdn/cpu) against the reference: decode, prefill and ReplaySSM
verify, the pools updated in place, the fallback without a compiler, and where the engine registers them (greedy
engine output through them: tests/jaxhybrid/test_engine_greedy.py).

Tolerance: the kernels and the reference evaluate the same f32 recurrence in different orders (the kernel sums
k order, fuses each update with the next reads and uses libm's exp). Along a chain of dependent roundings, a read
sums K terms and every step (a fold entry or a token) rounds its decay product, its delta, its rank-1 write and
its output sum: `depth` = K + 4 per step, the earlier steps' errors carried without amplification by the
contracting recurrence (tests/tolerances.py).
"""

import functools
import logging

import jax
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
from gdn_replay_op import GdnReplay
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.models.ops import ModelOps
from pallas_kernels import cpu_ffi
from pallas_kernels.gdn import REFERENCE_CHUNK, gdn_decode, gdn_materialize, gdn_prefill, gdn_verify, reference
from tests.tolerances import Float32

pytestmark = pytest.mark.usefixtures("kernels")

SHAPES = [(1, 2, 8, 8), (2, 4, 16, 8)]  # (H, HV, K, V): GVA groups of 2, one and two qk heads


def _tolerance(head_dim: int, steps: int) -> Float32:
    return Float32(depth=steps * (head_dim + 4))


def _tokens(rng, shape):
    h, hv, k, v = shape
    return (rng.standard_normal((T, h, k), np.float32), rng.standard_normal((T, h, k), np.float32),
            rng.standard_normal((T, hv, v), np.float32), -rng.exponential(0.3, (T, hv)).astype(np.float32),
            rng.uniform(0, 1, (T, hv)).astype(np.float32))


def _pool(rng, shape):
    h, hv, k, v = shape
    return state_pool(rng, (hv, k, v))


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_decode_matches_the_reference(shape, seed):
    rng = np.random.default_rng(seed)
    tokens, pool = _tokens(rng, shape), _pool(rng, shape)
    cu, slots = rows(rng, 1)
    expected = reference.gdn_decode(*tokens, cu, pool.copy(), slots)
    actual = gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    check_decode(actual, expected, pool, cu, slots, _tolerance(shape[2], 1))


@settings(max_examples=6, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_prefill_matches_the_reference(shape, seed):
    """Rows of up to T tokens, fresh and continued: the token recurrence against the reference's chunked form, whose
    in-chunk triangular solve adds a chunk's depth."""
    rng = np.random.default_rng(seed)
    tolerance = Float32(depth=_tolerance(shape[2], T).depth + REFERENCE_CHUNK)
    check_prefill(functools.partial(gdn_prefill, backend="ffi"), reference.gdn_prefill, _tokens(rng, shape),
                  _pool(rng, shape), seed, tolerance)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16))
def test_verify_matches_the_reference(shape, seed):
    """One call on random trackers: flushing and not, rings wrapping, padding rows, empty rows."""
    _check_verify(shape, seed)


def test_work_shared_among_threads_matches_the_reference():
    """States of 128 x 128: enough work that the kernel hands (row, qk head) items to XLA's other threads."""
    _check_verify((2, 4, 128, 128), seed=5)


def _check_verify(shape, seed):
    rng = np.random.default_rng(seed)
    h, hv, k, v = shape
    tokens, pool = _tokens(rng, shape), _pool(rng, shape)
    cu, slots = rows(rng, 3)
    trackers = verify_trackers(rng, cu, slots)
    rings = [rng.standard_normal((S, h, E, k), np.float32), rng.standard_normal((S, hv, E, v), np.float32),
             -rng.exponential(0.3, (S, hv, E)).astype(np.float32)]
    for ring in rings:
        ring[0] = 0
    expected = reference.gdn_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers)
    actual = gdn_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers, backend="ffi")
    steps = 1 + int(np.max(trackers[2] + np.diff(cu)))
    for i, name in enumerate(("o", "state_pool", "ring_k", "ring_u")):
        _tolerance(k, steps).check(actual[i], expected[i], name)
    np.testing.assert_array_equal(actual[4], expected[4])  # ring_g: the tokens' g, copied
    check_verify_pools(actual, pool, slots, trackers[3])


class FfiReplay(GdnReplay):
    """The replay simulation's op on the FFI kernels (materialize has none: the reference)."""

    def __init__(self, max_query_len=None, max_committed=None):
        super().__init__("ffi", max_query_len, max_committed)

    def materialize(self, pools, src, dst, ring_start, num_entries):
        return gdn_materialize(*pools, src, dst, ring_start, num_entries, max_committed=self.max_committed)


@settings(max_examples=3, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_steps_match_recurrent_decoding(max_drafts, seed, data):
    replay_sim.check_verify_matches_recurrent_decoding(FfiReplay(), max_drafts, seed, data)


def test_width_one_is_bit_identical_to_plain_decoding():
    check_width_one_is_plain_decoding(FfiReplay())


def test_the_pool_is_updated_in_place():
    rng = np.random.default_rng(0)
    tokens = _tokens(rng, SHAPES[1])
    check_updated_in_place(lambda cu, pool, slots: gdn_decode(*tokens, cu, pool, slots, backend="ffi"),
                           _pool(rng, SHAPES[1]))


def test_two_rows_on_one_slot_fail():
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _pool(rng, SHAPES[0])
    with pytest.raises(Exception, match="aimed at by two rows"):
        jax.block_until_ready(gdn_decode(*tokens, np.array([0, 1, 2, 2, 2], np.int32), pool,
                                         np.array([3, 3, 0, 0], np.int32), backend="ffi"))


def test_without_a_compiler_one_warning_and_the_reference_runs(monkeypatch, caplog):
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _pool(rng, SHAPES[0])
    cu, slots = np.array([0, 1, 2, 2, 2], np.int32), np.array([3, 1, 0, 0], np.int32)
    monkeypatch.setenv(cpu_ffi.COMPILER_ENV, "/nonexistent/c++")
    cpu_ffi.unavailable_reason.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_ffi.__name__):
            assert not cpu_ffi.available()
            o, state = gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
            gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
            with pytest.raises(RuntimeError, match="cannot be built"):
                ModelOps(cpu_kernels="ffi")
            assert ModelOps(cpu_kernels="auto").state_backend() is None  # the reference
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage(), warnings
        o_ref, state_ref = reference.gdn_decode(*tokens, cu, pool.copy(), slots)
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(state, state_ref)
    finally:
        monkeypatch.undo()
        cpu_ffi.unavailable_reason.cache_clear()
    assert cpu_ffi.available() and ModelOps(cpu_kernels="auto").state_backend() == "ffi"


def test_the_model_registers_the_kernels_where_it_is_built():
    """Not from a step's trace, which may run on a background compile thread (XLA's registry has no lock)."""
    cpu_ffi.unavailable_reason.cache_clear()
    ModelOps(cpu_kernels="auto")
    assert cpu_ffi.unavailable_reason.cache_info().currsize == 1


def test_bf16_activations_round_alike():
    """bf16 q, k, v (the bf16 model's): both paths normalise with the same JAX code and compute in f32, so the
    states agree to the f32 bound and the bf16 outputs to it plus one bf16 ulp."""
    rng = np.random.default_rng(1)
    q, k, v, g, beta = _tokens(rng, SHAPES[1])
    tokens = (*(jnp.asarray(t, jnp.bfloat16) for t in (q, k, v)), g, beta)
    pool, (cu, slots) = _pool(rng, SHAPES[1]), rows(rng, 1)
    o_ref, pool_ref = reference.gdn_decode(*tokens, cu, pool.copy(), slots)
    o, pool_ffi = gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    _tolerance(SHAPES[1][2], 1).check(pool_ffi, pool_ref, "state_pool")
    check_bf16_outputs(o, o_ref, SHAPES[1][2] + 4)
