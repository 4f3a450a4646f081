"""ReplaySSM trackers and decode-time materialization (docs/scheduler.md#replayssm-trackers).

Here `accepted` in vLLM's tables is the number of committed tokens (1..k+1) = StepResult.num_accepted + 1.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.replay import commit, crossed_boundary, flush_flags, materialize_count, max_committed, ring_rows
from scheduler.sim.invariants import check_drained
from scheduler.slots import SlotKind
from tests.scheduler.helpers import Driver, make_config, request


def _commit(start, committed, query_len, accepted, window=16, rows=20):
    flush = flush_flags(np.array([committed]), query_len, window)
    new_start, new_committed = commit(np.array([start]), np.array([committed]), flush, np.array([accepted]), rows)
    return bool(flush[0]), int(new_start[0]), int(new_committed[0])


@pytest.mark.parametrize("query_len, accepted, committed", [(4, 1, 3), (1, 1, 3), (4, 3, 5)])
def test_f2_tracker_commit_without_flush(query_len, accepted, committed):
    assert _commit(3, 2, query_len, accepted) == (False, 3, committed)


def test_f3_flush_folds_committed_entries_and_moves_the_origin():
    assert _commit(3, 14, 4, 2) == (True, 17, 2)
    assert _commit(18, 14, 4, 4) == (True, (18 + 14) % 20, 4)  # the origin wraps modulo the ring rows


def test_ring_rows_fit_a_flushing_verify_step():
    assert ring_rows(16, 0) == 17 and ring_rows(16, 3) == 20


@settings(max_examples=50, deadline=None)
@given(window=st.integers(1, 8), k=st.integers(0, 4), accepted=st.lists(st.integers(0, 4), min_size=1, max_size=30))
def test_committed_entries_never_pass_the_folds_bound(window, k, accepted):
    rows = ring_rows(window, k)
    bound, start, committed, most = max_committed(rows, k), 0, 0, 0
    for drafts_accepted in accepted:
        most = max(most, committed)
        flush = flush_flags(np.array([committed]), 1 + k, window)
        new_start, new_committed = commit(np.array([start]), np.array([committed]), flush,
                                          np.array([1 + min(drafts_accepted, k)]), rows)
        start, committed = int(new_start[0]), int(new_committed[0])
    assert max(most, committed) <= bound


@pytest.mark.parametrize("window, k", [(4, 0), (1, 3)])
def test_the_folds_bound_is_reached(window, k):
    """W single tokens without a flush, or one flush that accepts every draft."""
    start, committed, most = 0, 0, 0
    for _ in range(window + 1):
        flush = flush_flags(np.array([committed]), 1 + k, window)
        new_start, new_committed = commit(np.array([start]), np.array([committed]), flush, np.array([1 + k]),
                                          ring_rows(window, k))
        start, committed = int(new_start[0]), int(new_committed[0])
        most = max(most, committed)
    assert most == max_committed(ring_rows(window, k), k)


def test_w1_flushes_every_step_after_the_first():
    committed, flushes = 0, []
    for _ in range(5):
        flush, _, committed = _commit(0, committed, 1, 1, window=1, rows=2)
        flushes.append(flush)
    assert flushes == [False, True, True, True, True]


@pytest.mark.parametrize("computed, committed_tokens, boundary", [(47, 3, 48), (44, 4, 48), (40, 4, 0), (14, 1, 0)])
def test_d_boundary_crossing(computed, committed_tokens, boundary):
    after = np.array([computed + committed_tokens])
    assert crossed_boundary(np.array([computed]), after, 16)[0] == boundary


def test_f4_materialization_count():
    # ring_start 7, committed 2, computed_before 14, T = 4, 3 tokens committed -> committed 5, count 4
    flush, start, committed = _commit(7, 2, 4, 3)
    assert (flush, start, committed) == (False, 7, 5)
    assert materialize_count(np.array([16]), np.array([17]), np.array([committed]))[0] == 4
    assert crossed_boundary(np.array([14]), np.array([15]), 16)[0] == 0  # stops at 15: nothing


def test_prefill_rows_reset_the_ring_and_decode_rows_carry_trackers():
    driver = Driver(make_config(num_spec_tokens=3, ring_size=8, max_num_batched_tokens=64))
    driver.add(request("a", range(5, 25), max_tokens=60))
    plan = driver.step()
    assert plan.ring_committed[0] == 0 and not plan.flush[0]
    seen = []
    for _ in range(6):
        plan = driver.step(accepted=3)
        seen.append((int(plan.ring_start[0]), int(plan.ring_committed[0]), bool(plan.flush[0])))
    assert seen[:3] == [(0, 0, False), (0, 4, False), (0, 8, True)]  # 8 + 4 > W = 8


def test_decode_crossing_a_boundary_materializes_it_next_step_and_it_gets_hit():
    driver = Driver(make_config(num_spec_tokens=3, mamba_block_size=32, eagle_block_drop=False))
    driver.add(request("a", range(5, 35), max_tokens=12))  # 30 prompt tokens; decode crosses 32
    driver.step()
    driver.step(accepted=3)  # computed 30 -> 34: boundary 32 crossed
    (ask,) = driver.state.materializations
    assert ask.count == 2 and ask.ring_start == 0
    plan = driver.step(accepted=3)
    assert plan.num_materializations == 1 and plan.materialize_count[0] == 2
    assert plan.materialize_src[0] == plan.state_slots[0]
    assert driver.state.slots.kind[plan.materialize_dst[0]] == SlotKind.CACHED
    history = driver.state.token_ids("a")
    driver.drain("a decodes 12 tokens with K=3 across boundary 32", accepted=1)
    driver.add(request("b", history[:40]))
    plan = driver.step()
    assert plan.context_lens[0] == 32 and plan.num_hit_copies == 1  # checked against I1 by the fake device


@pytest.mark.parametrize("k, prompt, max_tokens", [(3, 30, 5), (0, 31, 2)])
def test_a_boundary_crossed_in_a_requests_last_step_is_materialized(k, prompt, max_tokens):
    """The verify step that finishes A crosses 32: its state at 32 is materialized, not dropped with the row."""
    driver = Driver(make_config(num_spec_tokens=k, mamba_block_size=32, eagle_block_drop=False))
    tokens = list(range(5, 5 + prompt))
    driver.add(request("a", tokens, max_tokens=max_tokens))
    driver.drain("a finishes in the step that crosses 32", accepted=k)
    history = tokens + [t for o in driver.outputs for t in o.new_token_ids]
    assert len(history) >= 34 - (k == 0)
    driver.add(request("b", history[:34] + [1, 2]))
    plan = driver.step()
    assert plan.context_lens[0] == 32 and plan.num_hit_copies == 1  # checked against I1 by the fake device
    driver.drain("b")
    assert check_drained(driver.state) == []


def test_a_full_kv_block_is_published_as_soon_as_decode_fills_it():
    """Decode publishes each KV block as soon as it is full, not once per Mamba block: with block drop B (sharing
    A's first 88 tokens) reaches A's state at 64 only through the block [64, 80)."""
    driver = Driver(make_config(num_spec_tokens=3, block_size=16, mamba_block_size=64))
    driver.add(request("a", range(1, 61), max_tokens=60))
    driver.run_until(lambda _: driver.state.num_tokens("a") >= 92, "a decodes past 92", accepted=3)
    driver.add(request("b", driver.state.token_ids("a")[:88] + [1, 2, 3, 4, 5]))
    plan = driver.step(accepted=3)
    row = plan.request_ids.index("b")
    assert plan.context_lens[row] == 64 and plan.num_hit_copies == 1
