"""GDN ReplaySSM verify/decode and materialise against plain recurrent decoding."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replay_sim import Row, run_steps

from pallas_kernels.gdn import gdn_decode, gdn_materialise, gdn_recurrent, gdn_verify

H, HV, K, V, S = 1, 2, 8, 8, 6
NUM_ROWS, STREAM = 3, 64
TOL = dict(atol=1e-4, rtol=1e-4)


class GdnReplay:
    """Adapter for `replay_sim.run_steps`; pools = (state_pool, ring_k, ring_u, ring_g)."""

    def __init__(self, backend="reference"):
        self.backend = backend

    @staticmethod
    def tokens(rng, n):
        return (
            rng.standard_normal((n, H, K), np.float32),
            rng.standard_normal((n, H, K), np.float32),
            rng.standard_normal((n, HV, V), np.float32),
            -rng.exponential(0.3, (n, HV)).astype(np.float32),
            rng.uniform(0, 1, (n, HV)).astype(np.float32),
        )

    def verify(self, packed, cu, pools, slots, ring_start, committed, flush):
        o, *pools = gdn_verify(*packed, cu, *pools, slots, ring_start, committed, flush, backend=self.backend)
        return o, pools

    def materialise(self, pools, src, dst, ring_start, num_entries):
        return gdn_materialise(*pools, src, dst, ring_start, num_entries, backend=self.backend)


def make_pools(width, rng):
    """Random S0 per slot, garbage rings (committed = 0 makes them irrelevant), zero null slot."""
    pools = [
        rng.standard_normal((S, HV, K, V), np.float32),
        rng.standard_normal((S, H, width, K), np.float32),
        rng.standard_normal((S, HV, width, V), np.float32),
        -rng.exponential(0.3, (S, HV, width)).astype(np.float32),
    ]
    for pool in pools:
        pool[0] = 0
    return pools


def oracle(stream, state, length):
    """Plain recurrent decoding of the first `length` stream tokens from `state`: (o, final)."""
    cu = np.array([0, length], np.int32)
    o, final = gdn_recurrent(*stream, cu, state[None])
    return np.asarray(o), np.asarray(final)[0]


def simulate(op, width, max_drafts, seed, garbage_seed, steps):
    rng = np.random.default_rng(seed)
    pools = make_pools(width, rng)
    initial = [p.copy() for p in pools]
    rows = [Row(slot=s, stream=GdnReplay.tokens(rng, STREAM)) for s in (3, 1, 4)]
    pools = run_steps(op, rows, pools, width, max_drafts, steps, rng, np.random.default_rng(garbage_seed), 32)
    return rows, [np.asarray(p) for p in pools], initial


@settings(max_examples=6, deadline=None)
@given(max_drafts=st.integers(0, 3), seed=st.integers(0, 2**16), data=st.data())
def test_verify_matches_recurrent_decoding(max_drafts, seed, data):
    width = 4
    rows, pools, initial = simulate(GdnReplay(), width, max_drafts, seed, seed + 1, steps=3 * width + 2)
    for row in rows:
        o_ref, _ = oracle(row.stream, initial[0][row.slot], STREAM)
        for position, o in row.outputs:
            np.testing.assert_allclose(o, o_ref[position], **TOL)
    # materialise(n) == the state after exactly n more tokens than the checkpoint, source untouched
    entries = [data.draw(st.integers(0, r.committed)) for r in rows]
    src = np.array([r.slot for r in rows], np.int32)
    out = np.asarray(GdnReplay().materialise(
        [p.copy() for p in pools], src, np.array([2, 5, 0], np.int32),
        np.array([r.ring_start for r in rows], np.int32), np.array(entries, np.int32),
    ))  # fmt: skip
    for row, n, dst in zip(rows[:2], entries, (2, 5), strict=False):
        _, state = oracle(row.stream, initial[0][row.slot], row.position - row.committed + n)
        np.testing.assert_allclose(out[dst], state, **TOL)
    np.testing.assert_array_equal(np.delete(out, [2, 5], axis=0), np.delete(pools[0], [2, 5], axis=0))
    for pool in pools:
        assert not pool[0].any()  # null slot never written


def test_ring_wraps_and_rejected_entries_do_not_matter():
    width = 4
    runs = [simulate(GdnReplay(), width, 3, seed=7, garbage_seed=g, steps=5 * width) for g in (1, 2)]
    assert max(r.wraps for r in runs[0][0]) >= 1
    for row_a, row_b in zip(runs[0][0], runs[1][0], strict=True):
        for (pa, oa), (pb, ob) in zip(row_a.outputs, row_b.outputs, strict=True):
            assert pa == pb
            np.testing.assert_array_equal(oa, ob)


@pytest.mark.parametrize("steps", [7])
def test_width_one_is_bit_identical_to_plain_decoding(steps):
    rng = np.random.default_rng(3)
    pools = make_pools(1, rng)
    plain = pools[0].copy()
    slots = np.array([3, 1, 0], np.int32)
    committed = np.zeros(3, np.int32)
    for _ in range(steps):
        tokens = GdnReplay.tokens(rng, 3)
        cu = np.array([0, 1, 2, 2], np.int32)  # third row is padding
        flush = committed + 1 > 1
        o, *pools = gdn_verify(*tokens, cu, *pools, slots, np.zeros(3, np.int32), committed, flush)
        o_plain, plain = gdn_decode(*tokens, cu, plain, slots)
        np.testing.assert_array_equal(o[:2], o_plain[:2])
        committed = np.array([1, 1, 0], np.int32)
    state = gdn_materialise(*pools, slots, np.array([2, 5, 0], np.int32), np.zeros(3, np.int32), committed)
    np.testing.assert_array_equal(np.asarray(state)[[2, 5]], np.asarray(plain)[[3, 1]])
