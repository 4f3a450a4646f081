"""What the CPU FFI kernel tests share: the library must build (a failure under CI, where g++ is; a skip where
no compiler is), random rows on a small pool, and the checks both mixers' kernels pass against their reference."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from varlen_inputs import cu_seqlens

from pallas_kernels import cpu_ffi
from tests.tolerances import U_BFLOAT16, assert_close, float32_atol

T, R, S, E = 8, 4, 8, 5  # tokens, rows, pool slots, ring entries


@pytest.fixture(scope="module")
def kernels():
    if not cpu_ffi.available():
        message = f"the CPU FFI kernels cannot be built here: {cpu_ffi.unavailable_reason()}"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)


def state_pool(rng, dims):
    """[S, *dims] random states, the null slot zero."""
    pool = rng.standard_normal((S, *dims)).astype(np.float32)
    pool[0] = 0
    return pool


def rows(rng, max_length):
    """R rows of 0..max_length tokens (at most T in all) on distinct running slots, some aimed at the null slot."""
    lengths = rng.integers(0, max_length + 1, R)
    while lengths.sum() > T:
        lengths[np.argmax(lengths)] -= 1
    slots = rng.permutation(np.arange(1, S))[:R].astype(np.int32)
    slots[rng.uniform(size=R) < 0.3] = 0  # padding rows
    return cu_seqlens(lengths, R), slots


def verify_trackers(rng, cu, slots):
    """Random flushes, committed counts (committed + T_r <= E unless flushing) and ring starts."""
    flush = rng.uniform(size=R) < 0.5
    committed = np.where(flush, rng.integers(0, E + 1, R), rng.integers(0, E - np.diff(cu) + 1)).astype(np.int32)
    return slots, rng.integers(0, E, R).astype(np.int32), committed, flush


def check_decode(actual, expected, pool, cu, slots, tolerance):
    """The FFI decode's (out, state_pool) against the reference's; padding outputs zero, other slots untouched."""
    for got, want, name in zip(actual, expected, ("out", "state_pool"), strict=True):
        tolerance.check(got, want, name)
    assert not np.asarray(actual[0])[cu[-1]:].any()  # padding tokens
    untouched = np.setdiff1d(np.arange(S), slots[np.diff(cu) > 0])  # the null slot, idle rows and other slots
    np.testing.assert_array_equal(np.asarray(actual[1])[untouched], pool[untouched])


def check_prefill(prefill, reference, tokens, pool, seed, tolerance):
    """`prefill(*tokens, cu, pool, slots, has_initial)` (the FFI kernel, token by token) against the reference's
    chunked form, on rows of up to T tokens with random fresh rows: a fresh row starts from zeros, even without
    tokens (its slot is zeroed), the null slot and the other slots stay as they were."""
    rng = np.random.default_rng(seed)
    cu, slots = rows(rng, T)
    has_initial = rng.uniform(size=R) < 0.5
    expected = reference(*tokens, cu, pool.copy(), slots, has_initial)
    actual = prefill(*tokens, cu, pool.copy(), slots, has_initial)
    for got, want, name in zip(actual, expected, ("out", "state_pool"), strict=True):
        tolerance.check(got, want, name)
    assert not np.asarray(actual[0])[cu[-1]:].any()  # padding tokens
    written = slots[(np.diff(cu) > 0) | ~has_initial]
    untouched = np.setdiff1d(np.arange(S), written[written > 0])
    np.testing.assert_array_equal(np.asarray(actual[1])[untouched], pool[untouched])


def check_verify_pools(actual, pool, slots, flush):
    """Nothing written to the null slot; a state written only where the row flushes."""
    for pool_out in actual[1:]:
        assert not np.asarray(pool_out)[0].any()
    kept = np.setdiff1d(np.arange(S), slots[flush])
    np.testing.assert_array_equal(np.asarray(actual[1])[kept], pool[kept])


def check_width_one_is_plain_decoding(op):
    """W = 1: each verify folds and flushes the entry the step before appended, the very update a decode makes, so
    its outputs and its flushed states are plain decoding's bits (a state lags one token: the last is in the ring).
    `op` is a `replay_sim.ReplayOp` on the kernels."""
    rng = np.random.default_rng(3)
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


def check_updated_in_place(decode, host_pool):
    """`decode(cu, pool, slots)` donates the pool and writes the rows' slots in its own buffer, nothing else."""
    cu, slots = np.array([0, 1, 2, 2, 3], np.int32), np.array([3, 0, 5, 6], np.int32)
    pool = jnp.asarray(host_pool)
    address = pool.unsafe_buffer_pointer()
    _, updated = decode(cu, pool, slots)
    assert pool.is_deleted() and updated.unsafe_buffer_pointer() == address  # donated, aliased: no copy
    np.testing.assert_array_equal(np.asarray(updated)[[0, 1, 2, 4, 5, 7]], host_pool[[0, 1, 2, 4, 5, 7]])
    assert not np.array_equal(np.asarray(updated)[[3, 6]], host_pool[[3, 6]])


def check_bf16_outputs(actual, expected, depth):
    """bf16 outputs of two f32 evaluation orders: the f32 bound plus one bf16 ulp (2u: the f32 values may straddle
    a rounding boundary)."""
    assert actual.dtype == jnp.bfloat16
    scale = float(np.abs(np.asarray(expected, np.float32)).max())
    assert_close(actual, expected, float32_atol(depth, scale) + 2 * U_BFLOAT16 * scale, "out")
