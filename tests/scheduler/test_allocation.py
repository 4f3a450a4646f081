"""Pools, prefix hits and capacity (reference §6 C, in this design's terms: ReplaySSM needs one
running slot per request and no per-draft state columns)."""

from __future__ import annotations

import numpy as np

from scheduler import schedule
from scheduler.blocks import BlockPool
from scheduler.invariants import check_drained
from scheduler.slots import SlotKind, SlotPool
from tests.scheduler.helpers import Driver, make_config, request, result_for


def test_block_pool_allocates_uncached_first_then_lru():
    pool = BlockPool.create(6)
    edit = pool.edit()
    assert edit.allocate(3).tolist() == [1, 2, 3]
    edit.register([1, 2], [111, 222])
    edit.release([2])
    edit.release([1])
    edit.release([3])
    after = edit.freeze()
    edit = after.edit()
    assert edit.allocate(2).tolist() == [3, 4]  # uncached free blocks go first
    assert edit.allocate(2).tolist() == [5, 2]  # then the least recently released cached one
    assert 222 not in edit.hash_to_block and 111 in edit.hash_to_block
    final = edit.freeze()
    assert final.num_free == 1 and final.free_cached.tolist() == [1]
    assert pool.num_free == 5 and 111 in after.hash_to_block and 222 in after.hash_to_block  # old values intact


def test_slot_pool_prefers_free_slots_and_never_evicts_pinned_ones():
    edit = SlotPool.create(4).edit()
    a, b = edit.allocate(SlotKind.PENDING, 10), edit.allocate(SlotKind.PENDING, 20)
    edit.make_ready(a, 1)
    edit.make_ready(b, 2)
    running = edit.allocate(SlotKind.RUNNING)
    assert running == 3
    edit.pin(a, 3)
    assert edit.allocate(SlotKind.RUNNING) == b and edit.evicted == [20]  # a is pinned
    assert edit.num_available() == 0


def test_c1_one_running_slot_and_kv_for_the_drafts():
    driver = Driver(make_config(block_size=4, mamba_block_size=4, num_spec_tokens=2))
    driver.add(request("a", [1, 2, 3], max_tokens=10))
    driver.step()
    plan = driver.step()
    row = driver.state.row_of["a"]
    assert plan.query_lens[0] == 3 and driver.state.rows.num_blocks[row] == 2  # cdiv(3 + 3, 4)
    assert int(np.count_nonzero(driver.state.slots.kind == SlotKind.RUNNING)) == 2  # null + one running


def test_c2_hit_shares_blocks_copies_the_slot_and_grows_one_block_at_a_time():
    driver = Driver(make_config(num_spec_tokens=0, mamba_block_size=32))
    driver.add(request("a", range(100), max_tokens=2))
    while driver.state.has_work():
        driver.step()
    driver.add(request("b", list(range(100)) + [7, 7], max_tokens=40))
    plan = driver.step()
    assert plan.context_lens[0] == 96 and plan.hit_copy_dst[0] == plan.state_slots[0]
    row = driver.state.row_of["b"]
    refs = driver.state.blocks.ref_count[driver.state.rows.block_table[row, :6]]
    assert (refs == 1).all()  # a has finished; b holds the cached blocks now
    grown = []
    for _ in range(20):
        driver.step()
        grown.append(int(driver.state.rows.num_blocks[row]))
    assert all(b - a in (0, 1) for a, b in zip(grown, grown[1:], strict=False))


def test_c3_same_step_hit_on_a_pending_state_is_deferred_one_step():
    driver = Driver(make_config(num_spec_tokens=3, mamba_block_size=32, eagle_block_drop=False))
    driver.add(request("a", range(5, 35), max_tokens=12))
    driver.step()
    driver.step(accepted=3)  # crosses 32: the next schedule materialises it (PENDING)
    prefix = driver.state.token_ids("a")[:32] + [1, 2, 3]
    driver.add(request("b", prefix))
    state, plan = schedule(driver.state)
    assert plan.num_materializations == 1 and "b" not in plan.request_ids and "b" in state.waiting
    driver.step(accepted=0)  # the same pass for real: b is deferred, the state gets written
    plan = driver.step(accepted=0)
    assert "b" in plan.request_ids and plan.context_lens[plan.request_ids.index("b")] == 32


def test_c4_pools_return_to_their_initial_free_counts():
    driver = Driver(make_config(num_spec_tokens=2, num_blocks=128))
    for i in range(6):
        driver.add(request(f"r{i}", [3] * 30 + [i] * 20, max_tokens=9))
    while driver.state.has_work():
        driver.step(accepted=1)
    assert check_drained(driver.state) == []
    assert driver.state.blocks.num_free == 127


def test_waiting_request_without_memory_waits_instead_of_failing():
    driver = Driver(make_config(num_blocks=12, num_spec_tokens=0, max_num_batched_tokens=256))
    driver.add(request("a", [1] * 100, max_tokens=50))
    driver.add(request("b", [2] * 100, max_tokens=50))
    state, plan = schedule(driver.state)
    assert plan.request_ids == ("a",)
    state, _ = __import__("scheduler").update(state, plan, result_for(plan, 0))
    assert "b" in state.waiting
