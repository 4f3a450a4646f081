"""Stale slot contents never reach a result: every kernel of every op, reference and interpret mode.

A freed slot, a preempted request's page, the rejected-draft entries of a ring and the unused tail of a KV
block hold whatever was last written there, NaN and Inf included. A kernel must *select* them away, never
multiply them by zero (0 * NaN is NaN). Each test poisons exactly the memory that no real result may
depend on and checks that the outputs, and every state the call writes, equal the same call on finite
contents.
"""

import numpy as np
import pytest
import replay_sim
from attention_cases import SCALE, make_case
from conv1d_cases import KC
from conv1d_cases import make_inputs as conv_inputs
from gdn_cases import CHUNK as GDN_CHUNK
from gdn_cases import prefill_inputs as gdn_inputs
from gdn_replay_op import GdnReplay
from ssd_cases import CHUNK as SSD_CHUNK
from ssd_cases import prefill_case as ssd_case
from ssd_replay_op import A as SSD_A
from ssd_replay_op import SsdReplay

from pallas_kernels.attention import ragged_paged_attention
from pallas_kernels.conv1d import conv1d_prefill
from pallas_kernels.gdn import gdn_materialize, gdn_prefill
from pallas_kernels.mamba2 import ssd_materialize, ssd_prefill

BACKENDS = ["reference", "interpret"]
POISONS = [np.nan, np.inf, -np.inf]
# Rows 0 and 2 start fresh in their slots, row 1 continues its state, row 3 is padding.
LENGTHS = [7, 5, 17, 0]
HAS_INITIAL = np.array([False, True, False, False])


def _fresh_rows(inputs):
    inputs["has_initial"] = HAS_INITIAL
    return inputs["slots"][~HAS_INITIAL & (inputs["slots"] > 0)]


def _assert_same(poisoned, clean):
    for got, want in zip(poisoned, clean, strict=True):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all(), f"{(~np.isfinite(got)).sum()} non-finite values leaked"
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gdn_prefill_fresh_rows_ignore_their_slot(backend, poison):
    clean = gdn_inputs(LENGTHS, seed=3)
    fresh = _fresh_rows(clean)
    poisoned = dict(clean, state_pool=clean["state_pool"].copy())
    poisoned["state_pool"][fresh] = poison
    run = lambda inputs: gdn_prefill(**inputs, chunk_size=GDN_CHUNK, backend=backend)
    _assert_same(run(poisoned), run(dict(clean, state_pool=clean["state_pool"].copy())))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssd_prefill_fresh_rows_ignore_their_slot(backend, poison):
    args, pool = ssd_case(LENGTHS, np.random.default_rng(3), np.float32)
    fresh = _fresh_rows(args)
    pool[fresh] = 0
    poisoned = pool.copy()
    poisoned[fresh] = poison
    run = lambda p: ssd_prefill(**args, state_pool=p, chunk_size=SSD_CHUNK, backend=backend)
    _assert_same(run(poisoned), run(pool.copy()))


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_conv1d_prefill_fresh_rows_ignore_their_window(backend, poison):
    clean = conv_inputs(LENGTHS[:3] + [1], seed=3)
    fresh = _fresh_rows(clean)
    poisoned = dict(clean, window_pool=clean["window_pool"].copy())
    poisoned["window_pool"][fresh, : KC - 1] = poison  # the columns prefill reads and writes
    run = lambda inputs: conv1d_prefill(**inputs, backend=backend)
    _assert_same(run(poisoned), run(dict(clean, window_pool=clean["window_pool"].copy())))


def _poison_stale_pages(make_pools, poison):
    """make_pools with every ring entry poisoned (committed = 0: all stale) and slots 3 and 5 unused."""

    def make(width, rng, *dims):
        pools = make_pools(width, rng, *dims)
        for ring in pools[1:]:
            ring[1:] = poison
        pools[0][[3, 5]] = poison
        return pools

    return staticmethod(make)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [GdnReplay, SsdReplay])
def test_verify_and_materialize_ignore_stale_ring_entries_and_unused_slots(op, backend, poison):
    """Rows 1, 2 and 4 run verify steps with random acceptance over rings that start full of poison."""

    class Poisoned(op):
        num_slots = 6
        make_pools = _poison_stale_pages(op.make_pools, poison)

    class Rows(op):
        num_slots = 6

    runs = []
    for variant in (Poisoned, Rows):
        rng = np.random.default_rng(11)
        pools = variant.make_pools(4, rng)
        rows = [replay_sim.Row(slot=s, stream=variant.tokens(rng, 24)) for s in (1, 2, 4)]
        pools = replay_sim.run_steps(variant(backend), rows, pools, 4, 3, 6, rng, np.random.default_rng(1), 16)
        src = np.array([r.slot for r in rows], np.int32)
        trackers = (np.array([r.ring_start for r in rows], np.int32), np.array([r.committed for r in rows], np.int32))
        state = variant(backend).materialize(pools, src, np.array([3, 5, 0], np.int32), *trackers)
        runs.append(([out for r in rows for _, out in r.outputs], np.asarray(state)[[1, 2, 3, 4, 5]]))
    (outputs, states), (outputs_clean, states_clean) = runs
    _assert_same(outputs, outputs_clean)
    _assert_same(states, states_clean)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["gdn", "ssd"])
def test_decode_ignores_unused_slots(op, backend, poison):
    replay = {"gdn": GdnReplay, "ssd": SsdReplay}[op]
    rng = np.random.default_rng(5)
    state_pool = replay.make_pools(4, rng)[0]
    tokens = replay.tokens(rng, 4)
    cu, slots = np.array([0, 1, 2, 2], np.int32), np.array([4, 1, 0], np.int32)
    poisoned = state_pool.copy()
    poisoned[[2, 3, 5]] = poison
    decode = lambda pool: replay(backend).decode(tokens, cu, pool, slots)
    out, pool = decode(poisoned)
    out_clean, pool_clean = decode(state_pool.copy())
    _assert_same([out, np.asarray(pool)[[0, 1, 4]]], [out_clean, np.asarray(pool_clean)[[0, 1, 4]]])
    assert not np.isfinite(np.asarray(pool)[[2, 3, 5]]).any()  # unused slots are not touched either


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize(("backend", "num_splits"), [("reference", None), ("interpret", 1), ("interpret", 4)])
def test_attention_ignores_kv_outside_every_context(backend, num_splits, poison):
    """Block tails past a row's context, blocks no row owns: poisoned; the null block stays zero. With 4 KV
    splits the short rows leave splits idle, and their -inf partials must merge to nothing."""
    args, _ = make_case([(3, 9), (1, 14), (0, 5), (6, 6)], seed=2)
    block_size = args["k_pool"].shape[1]
    visible = np.zeros(args["k_pool"].shape[:2], bool)
    query_lens = np.diff(args["cu_seqlens"])
    for table, context, query_len in zip(args["block_table"], args["context_lens"], query_lens, strict=True):
        positions = np.arange(context + query_len)  # cached before the step, then this step's tokens
        visible[table[positions // block_size], positions % block_size] = True
    visible[0] = True
    poisoned = dict(args, k_pool=args["k_pool"].copy(), v_pool=args["v_pool"].copy())
    poisoned["k_pool"][~visible] = poison
    poisoned["v_pool"][~visible] = poison
    run = lambda inputs: ragged_paged_attention(**inputs, scale=SCALE, backend=backend, num_splits=num_splits)[0]
    _assert_same([run(poisoned)], [run(args)])


def test_materialize_reads_only_the_entries_it_folds():
    """num_entries = 0 copies S0 and reads no ring entry at all."""
    for replay, materialize in ((GdnReplay, gdn_materialize), (SsdReplay, ssd_materialize)):
        pools = replay.make_pools(4, np.random.default_rng(0))
        for ring in pools[1:]:
            ring[1:] = np.nan
        extra = (SSD_A,) if replay is SsdReplay else ()
        src, dst, ring_start = (np.array(a, np.int32) for a in ([1, 2], [3, 0], [1, 0]))
        args = (src, dst, ring_start, np.zeros(2, np.int32))
        for backend in BACKENDS:
            out = np.asarray(materialize(*[p.copy() for p in pools], *extra, *args, backend=backend))
            np.testing.assert_array_equal(out[3], pools[0][1])
