"""The C++ FFI GDN kernels on CPU (pallas_kernels/gdn/cpu) against the reference: decode and ReplaySSM verify,
the pools updated in place, the fallback without a compiler, and greedy engine output through them.

Tolerance: the kernels and the reference evaluate the same f32 recurrence in different orders (the kernel sums
k order, fuses each update with the next reads and uses libm's exp). Along a chain of dependent roundings, a read
sums K terms and every step (a fold entry or a token) rounds its decay product, its delta, its rank-1 write and
its output sum: `depth` = K + 4 per step, the earlier steps' errors carried without amplification by the
contracting recurrence (tests/tolerances.py).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import replay_sim
from gdn_replay_op import GdnReplay
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.models.model import Model
from jaxhybrid.models.ops import ModelOps
from jaxhybrid.sample.params import SamplingParams
from pallas_kernels.gdn import cpu, gdn_decode, gdn_materialize, gdn_verify, reference
from pallas_kernels.gdn.cpu import build
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, greedy_continuation, run_to_completion
from tests.tolerances import Float32

T, R, S, E = 8, 4, 8, 5
SHAPES = [(1, 2, 8, 8), (2, 4, 16, 8)]  # (H, HV, K, V): GVA groups of 2, one and two qk heads


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not cpu.available():
        pytest.skip(f"the CPU FFI kernels cannot be built here: {cpu.unavailable_reason()}")


def _tolerance(head_dim: int, steps: int) -> Float32:
    return Float32(depth=steps * (head_dim + 4))


def _tokens(rng, shape):
    h, hv, k, v = shape
    return (rng.standard_normal((T, h, k), np.float32), rng.standard_normal((T, h, k), np.float32),
            rng.standard_normal((T, hv, v), np.float32), -rng.exponential(0.3, (T, hv)).astype(np.float32),
            rng.uniform(0, 1, (T, hv)).astype(np.float32))


def _state_pool(rng, shape):
    h, hv, k, v = shape
    pool = rng.standard_normal((S, hv, k, v), np.float32)
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
    o_ref, pool_ref = reference.gdn_decode(*tokens, cu, pool.copy(), slots)
    o, pool_ffi = gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
    tol = _tolerance(shape[2], 1)
    tol.check(o, o_ref, "o")
    tol.check(pool_ffi, pool_ref, "state_pool")
    assert not np.asarray(o)[cu[-1]:].any()  # padding tokens
    untouched = np.setdiff1d(np.arange(S), slots[np.diff(cu) > 0])  # the null slot, idle rows and other slots
    np.testing.assert_array_equal(np.asarray(pool_ffi)[untouched], pool[untouched])


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
    tokens, pool = _tokens(rng, shape), _state_pool(rng, shape)
    cu, slots = _rows(rng, 3)
    lengths = np.diff(cu)
    flush = rng.uniform(size=R) < 0.5
    # committed + T_r <= E unless flushing
    committed = np.where(flush, rng.integers(0, E + 1, R), rng.integers(0, E - lengths + 1)).astype(np.int32)
    ring_start = rng.integers(0, E, R).astype(np.int32)
    rings = [rng.standard_normal((S, h, E, k), np.float32), rng.standard_normal((S, hv, E, v), np.float32),
             -rng.exponential(0.3, (S, hv, E)).astype(np.float32)]
    for ring in rings:
        ring[0] = 0
    trackers = (slots, ring_start, committed, flush)
    expected = reference.gdn_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers)
    actual = gdn_verify(*tokens, cu, pool.copy(), *(r.copy() for r in rings), *trackers, backend="ffi")
    steps = 1 + int(np.max(committed + lengths))
    for i, name in enumerate(("o", "state_pool", "ring_k", "ring_u")):
        _tolerance(k, steps).check(actual[i], expected[i], name)
    np.testing.assert_array_equal(actual[4], expected[4])  # ring_g: the tokens' g, copied
    for pool_out in actual[1:]:
        assert not np.asarray(pool_out)[0].any()  # the null slot is never written
    kept = np.setdiff1d(np.arange(S), slots[flush])
    np.testing.assert_array_equal(np.asarray(actual[1])[kept], pool[kept])  # only a flush writes a state


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
    """W = 1: each verify folds and flushes the entry the step before appended, the very update a decode makes, so
    its outputs and its flushed states are plain decoding's bits (a state lags one token: the last is in the ring).
    (replay_sim's check also compares a reference materialize with these states: the kernels have none.)"""
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
    _, updated = gdn_decode(*tokens, cu, pool, slots, backend="ffi")
    assert pool.is_deleted() and updated.unsafe_buffer_pointer() == address  # donated, aliased: no copy
    np.testing.assert_array_equal(np.asarray(updated)[[0, 1, 2, 4, 5, 7]], host_pool[[0, 1, 2, 4, 5, 7]])
    assert not np.array_equal(np.asarray(updated)[[3, 6]], host_pool[[3, 6]])


def test_two_rows_on_one_slot_fail():
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _state_pool(rng, SHAPES[0])
    with pytest.raises(Exception, match="aimed at by two rows"):
        jax.block_until_ready(gdn_decode(*tokens, np.array([0, 1, 2, 2, 2], np.int32), pool,
                                         np.array([3, 3, 0, 0], np.int32), backend="ffi"))


def test_without_a_compiler_one_warning_and_the_reference_runs(monkeypatch, caplog):
    rng = np.random.default_rng(0)
    tokens, pool = _tokens(rng, SHAPES[0]), _state_pool(rng, SHAPES[0])
    cu, slots = np.array([0, 1, 2, 2, 2], np.int32), np.array([3, 1, 0, 0], np.int32)
    monkeypatch.setenv(build.COMPILER_ENV, "/nonexistent/c++")
    cpu.unavailable_reason.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu.__name__):
            assert not cpu.available()
            o, state = gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
            gdn_decode(*tokens, cu, pool.copy(), slots, backend="ffi")
            with pytest.raises(RuntimeError, match="cannot be built"):
                ModelOps(cpu_kernels="ffi")
            assert ModelOps(cpu_kernels="auto").gdn_decode_backend() is None  # the reference
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage(), warnings
        o_ref, state_ref = reference.gdn_decode(*tokens, cu, pool.copy(), slots)
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(state, state_ref)
    finally:
        monkeypatch.undo()
        cpu.unavailable_reason.cache_clear()
    assert cpu.available() and ModelOps(cpu_kernels="auto").gdn_decode_backend() == "ffi"


def test_greedy_engine_output_through_the_kernels_equals_the_full_forward(monkeypatch):
    """The CPU default: no MTP and W = 1, so every decode step folds and flushes an entry; fp32 fixture."""
    traced = []
    monkeypatch.setattr(cpu, "_verify", lambda *a, _verify=cpu._verify, **kw: traced.append(1) or _verify(*a, **kw))
    base = fixture_model("qwen3_next")
    model = Model(base.config, base.params, ops=ModelOps(cpu_kernels="ffi"))
    engine = engine_for(model, ring_size=1, budget=32, max_num_seqs=4, max_model_len=64, num_blocks=32,
                        num_state_slots=12)
    rng = np.random.default_rng(0)
    prompts = {f"r{i}": Prompt(tuple(int(t) for t in rng.integers(0, model.config.vocab_size, n)))
               for i, n in enumerate((5, 17))}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, params)
    outputs = run_to_completion(engine)
    assert traced  # the step ran the FFI verify
    for name, prompt in prompts.items():
        assert outputs[name].outputs[0].token_ids == greedy_continuation(base, prompt, 6), name
