"""Grouped two-phase prefill: 1 producer x 512 tokens + N consumers x 64 (+ one unrelated row)."""

import functools

import jax
import numpy as np
import pytest

from pallas_kernels.conv1d import conv1d_prefill
from pallas_kernels.gdn import gdn_prefill
from pallas_kernels.grouped_prefill import grouped_prefill
from pallas_kernels.mamba2 import ssd_prefill
from tests.tolerances import Float32

PREFIX, OWN, OTHER, MAX_CONSUMERS = 512, 64, 100, 16
T, R, S = 1664, 18, 20
TOL = Float32(depth=PREFIX + OTHER + 64)  # the longest row's recurrence and a chunk's sums
_RNG = np.random.default_rng(0)
CONV_W, CONV_B = _RNG.standard_normal((2, 8, 4)).astype(np.float32), _RNG.standard_normal(8).astype(np.float32)
A, D = -np.exp(_RNG.uniform(-1, 1, 4)).astype(np.float32), _RNG.standard_normal(4).astype(np.float32)


def _conv_tokens(rng, n):
    return (rng.standard_normal((n, 8), np.float32),)


def _gdn_tokens(rng, n):
    q, k = rng.standard_normal((2, n, 2, 16), np.float32)
    g = -rng.exponential(0.1, (n, 4)).astype(np.float32)
    return q, k, rng.standard_normal((n, 4, 8), np.float32), g, rng.uniform(0, 1, (n, 4)).astype(np.float32)


def _ssd_tokens(rng, n):
    b, c = rng.standard_normal((2, n, 2, 16), np.float32)
    return rng.standard_normal((n, 4, 8), np.float32), rng.uniform(0.001, 0.1, (n, 4)).astype(np.float32), b, c


def _conv_run(tokens, cu, pool, slots, has_initial, backend="reference"):
    return conv1d_prefill(*tokens, CONV_W[0], CONV_B, cu, pool, slots, has_initial, backend=backend)


def _gdn_run(tokens, cu, pool, slots, has_initial, backend="reference"):
    return gdn_prefill(*tokens, cu, pool, slots, has_initial, backend=backend)


def _ssd_run(tokens, cu, pool, slots, has_initial, backend="reference"):
    x, dt, b, c = tokens
    return ssd_prefill(x, dt, A, b, c, D, cu, pool, slots, has_initial, backend=backend)


def _with_backend(run, backend, *args):
    return run(*args, backend=backend)


OPS = {
    "conv1d": (_conv_tokens, _conv_run, (S, 3, 8)),
    "gdn": (_gdn_tokens, _gdn_run, (S, 4, 16, 8)),
    "mamba2": (_ssd_tokens, _ssd_run, (S, 4, 8, 16)),
}


@functools.partial(jax.jit, static_argnames="run")
def _grouped(run, tokens, cu, num_producers, pool, slots, has_initial, copy_src, copy_dst):
    bound = lambda cu_, pool_, slots_, init_: run(tokens, cu_, pool_, slots_, init_)
    return grouped_prefill(bound, cu, num_producers, pool, slots, has_initial, copy_src, copy_dst)


def _pack(rows):
    """Per-row token tuples -> arrays packed into the (T, R) bucket, and cu_seqlens."""
    lengths = [len(r[0]) for r in rows]
    packed = tuple(
        np.concatenate([r[i] for r in rows] + [np.zeros((T - sum(lengths),) + x.shape[1:], x.dtype)])
        for i, x in enumerate(rows[0])
    )
    return packed, np.concatenate([[0], np.cumsum(lengths + [0] * (R - len(rows)))]).astype(np.int32)


def _from_scratch(run, rows, pool_shape):
    """Each row from a zero state, without producers or copies: [(outputs, final state)] per row.

    Rows are packed greedily into (T, R) buckets and go through the same jitted two-phase function
    (zero producers), so nothing compiles again; packing independence is tested elsewhere.
    """
    results, start = [], 0
    while start < len(rows):
        stop = start + 1
        while stop < len(rows) and stop - start < R and sum(len(r[0]) for r in rows[start : stop + 1]) <= T:
            stop += 1
        packed, cu = _pack(rows[start:stop])
        slots = np.where(np.arange(R) < stop - start, np.arange(R) + 1, 0).astype(np.int32)
        no_copies = np.zeros(MAX_CONSUMERS, np.int32)
        pool = np.zeros(pool_shape, np.float32)
        out, pool = _grouped(run, packed, cu, np.int32(0), pool, slots, np.zeros(R, bool), no_copies, no_copies)
        results += [(np.asarray(out)[cu[i] : cu[i + 1]], np.asarray(pool)[i + 1]) for i in range(stop - start)]
        start = stop
    return results


@pytest.mark.parametrize("num_consumers", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("op", sorted(OPS))
def test_grouped_prefill_equals_rows_run_separately(op, num_consumers):
    make_tokens, run, pool_shape = OPS[op]
    rng = np.random.default_rng(num_consumers)
    prefix, other = make_tokens(rng, PREFIX), make_tokens(rng, OTHER)
    own = [make_tokens(rng, OWN) for _ in range(num_consumers)]
    rows = [prefix, *own, other]
    packed, cu = _pack(rows)
    slots = np.array([1 + r if r < num_consumers + 2 else 0 for r in range(R)], np.int32)
    has_initial = np.array([0 < r <= num_consumers for r in range(R)])
    copy_dst = np.zeros(MAX_CONSUMERS, np.int32)
    copy_dst[:num_consumers] = slots[1 : num_consumers + 1]
    copy_src = np.where(copy_dst > 0, 1, 0).astype(np.int32)
    pool = _RNG.standard_normal(pool_shape).astype(np.float32)  # stale contents must not leak
    pool[0] = 0
    out, pool = _grouped(run, packed, cu, np.int32(1), pool, slots, has_initial, copy_src, copy_dst)
    out, pool = np.asarray(out), np.asarray(pool)
    full_rows = [tuple(np.concatenate(pair) for pair in zip(prefix, t, strict=True)) for t in own]
    separate = _from_scratch(run, [prefix, *full_rows, other], pool_shape)
    for r, (ref_out, ref_state) in enumerate(separate):
        TOL.check(out[cu[r] : cu[r + 1]], ref_out[-(cu[r + 1] - cu[r]) :])
        TOL.check(pool[slots[r]], ref_state)
    assert not pool[0].any()


def _small_case(make_tokens, pool_shape, rng):
    """1 producer x 20 tokens, 2 consumers x 5, one unrelated row x 7, in a (48, 5) bucket."""
    rows = [make_tokens(rng, n) for n in (20, 5, 5, 7)]
    lengths = [20, 5, 5, 7, 0]
    packed = tuple(
        np.concatenate([r[i] for r in rows] + [np.zeros((11,) + x.shape[1:], x.dtype)]) for i, x in enumerate(rows[0])
    )
    pool = rng.standard_normal(pool_shape).astype(np.float32)
    pool[0] = 0
    per_row = dict(
        cu=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), num_producers=np.int32(1), pool=pool,
        slots=np.array([1, 2, 3, 4, 0], np.int32), has_initial=np.array([False, True, True, False, False]),
        copy_src=np.array([1, 1, 0], np.int32), copy_dst=np.array([2, 3, 0], np.int32),
    )  # fmt: skip
    return packed, per_row


@pytest.mark.parametrize("op", ["conv1d", "gdn", "mamba2"])
def test_grouped_prefill_interpret_matches_reference(op):
    make_tokens, run, pool_shape = OPS[op]
    packed, case = _small_case(make_tokens, pool_shape, np.random.default_rng(3))
    results = []
    for backend in ("reference", "interpret"):
        bound = functools.partial(_with_backend, run, backend)
        results.append(_grouped(bound, packed, **dict(case, pool=case["pool"].copy())))
    for x, x_ref in zip(results[1], results[0], strict=True):
        TOL.check(x, x_ref)
