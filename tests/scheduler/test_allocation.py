"""Pools, prefix hits and capacity (ReplaySSM needs one
running slot per request and no per-draft state columns)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import schedule
from scheduler.blocks import BlockPool
from scheduler.sim.invariants import check_drained
from scheduler.slots import SlotKind, SlotPool
from tests.scheduler.helpers import Driver, make_config, request, result_for


def test_block_pool_allocates_uncached_first_then_lru():
    pool = BlockPool(6)
    assert pool.allocate(3).tolist() == [1, 2, 3]
    pool.register([1, 2], [111, 222])
    pool.release([2])
    pool.release([1])
    pool.release([3])
    assert pool.allocate(2).tolist() == [3, 4]  # uncached free blocks go first
    assert pool.allocate(2).tolist() == [5, 2]  # then the least recently released cached one
    assert 222 not in pool.hash_to_block and 111 in pool.hash_to_block
    assert pool.num_free == 1 and pool.free_cached.tolist() == [1]


def test_a_finished_request_frees_its_tail_blocks_first():
    """Of a released request's cached blocks the tail is evicted first, so its prefix head, the part
    other prompts share, stays hit-able longest; a tail is useless once its head is gone."""
    driver = Driver(make_config())
    driver.add(request("a", range(1, 66), max_tokens=3))
    plan = driver.step()
    blocks = plan.block_table[0, :4].tolist()  # the 64 tokens of 4 full KV blocks are cached on release
    driver.run_until(lambda _: not driver.state.requests, "a: 65 tokens, 3 new")
    assert driver.state.blocks.free_cached.tolist() == blocks[::-1]


def test_slot_pool_prefers_free_slots_and_never_evicts_pinned_ones():
    edit = SlotPool(4)
    edit.begin()
    a, b = edit.allocate(SlotKind.PENDING, 10), edit.allocate(SlotKind.PENDING, 20)
    edit.make_ready(a, 1)
    edit.make_ready(b, 2)
    running = edit.allocate(SlotKind.RUNNING)
    assert running == 3
    edit.pin(a, 3)
    assert edit.allocate(SlotKind.RUNNING) == b and edit.evicted == [20]  # a is pinned
    assert edit.num_available() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=9), st.data())
def test_slot_pool_evicts_many_in_the_order_of_one_at_a_time(stamps, data):
    """Evicting several slots in one call picks exactly what repeated single evictions would:
    oldest stamp first, the lowest slot among equal stamps, pinned slots never."""
    def filled():
        edit = SlotPool(len(stamps) + 1)
        edit.begin()
        for key, stamp in enumerate(stamps):
            edit.make_ready(edit.allocate(SlotKind.PENDING, key), stamp)
        return edit
    pinned = data.draw(st.sets(st.integers(1, len(stamps))))
    count = data.draw(st.integers(1, len(stamps) - len(pinned))) if len(pinned) < len(stamps) else 0
    one_by_one, batch = filled(), filled()
    for edit in (one_by_one, batch):
        for slot in pinned:
            edit.pin(slot, edit.stamp[slot])
    singles = [one_by_one.allocate(SlotKind.RUNNING) for _ in range(count)]
    assert batch.allocate_many(SlotKind.RUNNING, count) == singles and batch.evicted == one_by_one.evicted
    assert not set(singles) & pinned


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
    driver.drain("a: 100 tokens, 2 new")
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
    driver.step(accepted=3)  # crosses 32: the next schedule materializes it (PENDING)
    prefix = driver.state.token_ids("a")[:32] + [1, 2, 3]
    driver.add(request("b", prefix))
    state, plan = schedule(driver.state.snapshot())  # a look ahead, on a copy
    assert plan.num_materializations == 1 and "b" not in plan.request_ids and "b" in state.waiting
    driver.step(accepted=0)  # the same pass for real: b is deferred, the state gets written
    plan = driver.step(accepted=0)
    assert "b" in plan.request_ids and plan.context_lens[plan.request_ids.index("b")] == 32


def test_c4_pools_return_to_their_initial_free_counts():
    driver = Driver(make_config(num_spec_tokens=2, num_blocks=128))
    for i in range(6):
        driver.add(request(f"r{i}", [3] * 30 + [i] * 20, max_tokens=9))
    driver.drain("6 requests with a shared 30-token prefix, K=2", accepted=1)
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


class _PoolModel:
    """Plain-Python block pool with the same rules: uncached stack first, then exact LRU eviction."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.stack = list(range(num_blocks - 1, 0, -1))
        self.lru: list[int] = []
        self.hash_of: dict[int, int] = {}

    def copy(self) -> _PoolModel:
        model = _PoolModel(0)
        model.refs, model.stack, model.lru, model.hash_of = list(self.refs), list(self.stack), list(self.lru), dict(
            self.hash_of)
        return model

    def allocate(self, count: int) -> list[int]:
        out = [self.stack.pop() for _ in range(min(count, len(self.stack)))]
        while len(out) < count:
            block = self.lru.pop(0)
            del self.hash_of[block]
            out.append(block)
        for block in out:
            self.refs[block] = 1
        return out

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if not self.refs[block]:
                (self.lru if block in self.hash_of else self.stack).append(block)

    def take(self, blocks: list[int]) -> None:
        for block in blocks:
            if not self.refs[block]:
                self.lru.remove(block)
            self.refs[block] += 1

    def register(self, blocks: list[int], keys: list[int]) -> None:
        for block, key in zip(blocks, keys, strict=True):
            if key not in self.hash_of.values() and block not in self.hash_of:
                self.hash_of[block] = key


def _assert_pool_matches(pool: BlockPool, model: _PoolModel) -> None:
    assert pool.ref_count.tolist() == model.refs
    assert pool.free_uncached.tolist() == model.stack
    assert pool.free_cached.tolist() == model.lru and pool.num_free == len(model.stack) + len(model.lru)
    assert pool.hash_to_block == {key: block for block, key in model.hash_of.items()}


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_block_pool_matches_a_plain_model_and_rolls_back(data):
    """Random allocate / release / hit / publish transactions on a small pool, so that the cached ring
    wraps and compacts; a third of the transactions roll back: the pool matches its model throughout."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pool, model = BlockPool(6), _PoolModel(6)
    next_key = iter(range(1, 10**6))
    for _ in range(data.draw(st.integers(1, 150))):
        pool.begin()
        before = model.copy()
        for _ in range(rng.integers(1, 4)):
            held = [b for b in range(1, 6) if model.refs[b]]
            hit = [b for b in model.lru if rng.random() < 0.3] + [b for b in held if rng.random() < 0.2]
            choice = rng.choice(4, p=[0.15, 0.35, 0.35, 0.15])  # hits and releases leave dead ring entries
            if choice == 0 and model.stack + model.lru:
                count = int(rng.integers(1, len(model.stack) + len(model.lru) + 1))
                assert pool.allocate(count).tolist() == model.allocate(count)
            elif choice == 1 and held:
                # a block may go as often as it is held (requests sharing a prefix released together)
                gone = [b for b in held for _ in range(model.refs[b]) if rng.random() < 0.5]
                rng.shuffle(gone)
                pool.release(gone, distinct=len(set(gone)) == len(gone) and rng.random() < 0.5)
                model.release(gone)
            elif choice == 2 and hit:
                pool.take(np.array(hit, np.int32))
                model.take(hit)
            elif held:
                keys = [next(next_key) if rng.random() < 0.8 else 1 for _ in held]
                pool.register(held, keys)
                model.register(held, keys)
            assert pool.num_free == len(model.stack) + len(model.lru)
        if rng.random() < 0.3:
            pool.rollback()
            model = before
        else:
            pool.commit()
        _assert_pool_matches(pool, model)


def test_cached_ring_compacts_dead_entries_and_keeps_lru_order():
    pool = BlockPool(4)  # a ring of 8 positions
    blocks = pool.allocate(3).tolist()
    pool.register(blocks, [101, 102, 103])
    spans = []
    for cycle in range(6):  # each cycle leaves 3 dead entries: the ring must compact to go on
        order = blocks[cycle % 3:] + blocks[:cycle % 3]
        for block in order:
            pool.release([block])
        assert pool.free_cached.tolist() == order and pool.num_free == 3
        spans.append(pool.queue_end - pool.queue_head)
        if cycle < 5:
            pool.take(np.array(blocks, np.int32))
    assert max(spans) <= 8 < pool.queue_end
    assert pool.allocate(3).tolist() == order and pool.num_free == 0  # evicted oldest first
