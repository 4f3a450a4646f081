"""Application-directed checkpoints: marker parsing and the producer/consumer machine
(docs/scheduler.md#application-directed-checkpoints)."""

from __future__ import annotations

import sys

import pytest

from scheduler import (
    CheckpointMarkerError,
    abort_request,
    add_request,
    parse_checkpoint_marker,
    preempt_request,
    schedule,
    update,
)
from scheduler.checkpoints import TRANSITIONS, CheckpointEvent, CheckpointStatus, advance
from scheduler.sim.invariants import check_drained
from scheduler.sim.simulate import config_from, parse_args
from scheduler.sim.simulator import Workload, run_seed
from scheduler.slots import SlotKind
from tests.scheduler.helpers import Driver, make_config, request, result_for

MARKER = 99

# E1: the eight marker cases (marker id 99, hash unit 4) ------------------------------------


def test_e1_no_marker_leaves_the_prompt_unchanged():
    assert parse_checkpoint_marker([10, 11, 12], MARKER, 4) == ((10, 11, 12), None, ())


def test_e1_marker_is_stripped_and_input_not_mutated():
    tokens = [10, 11, 12, 13, 99, 14]
    parsed = parse_checkpoint_marker(tokens, MARKER, 4)
    assert parsed.token_ids == (10, 11, 12, 13, 14) and parsed.checkpoint_position == 4
    assert tokens == [10, 11, 12, 13, 99, 14]


def test_e1_position_rounds_down_to_the_hash_unit():
    assert parse_checkpoint_marker([1, 2, 3, 4, 5, 6, 7, 99, 8], MARKER, 4).checkpoint_position == 4


@pytest.mark.parametrize("tokens, message", [
    ([10, 99, 11, 99, 12, 13, 14], "exactly once"),
    ([99, 10, 11, 12, 13], "both sides"),
    ([10, 11, 12, 13, 99], "both sides"),
    ([10, 11, 99, 12, 13], "too small"),
])
def test_e1_marker_errors(tokens, message):
    with pytest.raises(CheckpointMarkerError, match=message):
        parse_checkpoint_marker(tokens, MARKER, 4)


def test_e1_placeholders_after_the_marker_shift_left():
    tokens = [10, 0, 0, 11, 12, 99, 0, 0, 13]
    parsed = parse_checkpoint_marker(tokens, MARKER, 4, placeholders=[(1, 2), (6, 2)])
    assert parsed.placeholders == ((1, 2), (5, 2))


def test_e1_marker_inside_a_placeholder_is_rejected():
    with pytest.raises(CheckpointMarkerError, match="cannot be inside"):
        parse_checkpoint_marker([10, 0, 0, 0, 99, 0, 11], MARKER, 4, placeholders=[(1, 5)])


# the transition table -------------------------------------------------------------------------------


def test_every_status_event_pair_is_either_in_the_table_or_rejected():
    for status in CheckpointStatus:
        for event in CheckpointEvent:
            if (status, event) in TRANSITIONS:
                assert advance(status, event, b"\x01" * 32) is TRANSITIONS[status, event]
            else:
                with pytest.raises(RuntimeError, match="can't handle"):
                    advance(status, event, b"\x01" * 32)


def test_happy_path_walks_absent_to_ready():
    status = CheckpointStatus.ABSENT
    for event in (CheckpointEvent.CLAIM, CheckpointEvent.SCHEDULE_END, CheckpointEvent.STEP_DONE):
        status = advance(status, event, b"\x01" * 32)
    assert status is CheckpointStatus.READY


# E2-E8 through the real scheduler (bs 16, hash unit 16) ----------------------------------------------

PRODUCER = [10] * 100
CONSUMER = [10] * 48 + [20] * 50


def _driver(**overrides) -> Driver:
    return Driver(make_config(**overrides))


def _claim(driver: Driver):
    (claim,) = driver.state.claims.values()
    return claim


def test_e2_producer_is_truncated_at_the_checkpoint_and_unready():
    driver = _driver()
    driver.add(request("P", PRODUCER, checkpoint=48))
    from scheduler import schedule
    state, plan = schedule(driver.state)
    assert plan.query_lens[0] == 48 and plan.phase[0] == 1 and plan.num_publishes == 1
    assert next(iter(state.claims.values())).status is CheckpointStatus.UNREADY


def test_e3_consumer_waits_while_producing_without_blocking_others():
    driver = _driver(max_num_batched_tokens=24)
    driver.add(request("P", PRODUCER, checkpoint=48))
    driver.step()
    assert _claim(driver).status is CheckpointStatus.PRODUCING
    driver.add(request("C", CONSUMER, checkpoint=48))
    driver.add(request("U", [30] * 5))
    plan = driver.step()
    assert set(plan.request_ids) == {"P", "U"} and "C" in driver.state.waiting  # U is not blocked by C
    plan = driver.run_until(lambda last: last and "C" in driver.chunks(last), "E3: C waits for P's checkpoint")
    assert driver.chunks(plan)["C"][0] == 48 and plan.num_hit_copies == 1  # READY: a hit at exactly c
    assert not driver.state.claims


def test_e4_same_step_pairing_shares_blocks_and_runs_in_phase_two():
    driver = _driver(max_num_batched_tokens=512)
    driver.add(request("P", PRODUCER, checkpoint=48, max_tokens=2))
    driver.add(request("C", CONSUMER, checkpoint=48))
    plan = driver.step()
    assert driver.chunks(plan) == {"P": (0, 48), "C": (48, 98)}
    assert list(plan.phase[:2]) == [1, 2] and plan.num_pair_copies == 1
    assert (plan.pair_copy_src[0], plan.pair_copy_dst[0]) == (plan.state_slots[0], plan.state_slots[1])
    assert list(plan.block_table[1, :3]) == list(plan.block_table[0, :3])  # the shared prefix KV
    plan = driver.step()
    assert driver.chunks(plan) == {"P": (48, 100)}  # C finished in step 1 (max_tokens=1)
    assert [o.request_id for o in driver.outputs] == ["C", "P"]


def test_e5_only_the_declared_boundary_is_cached():
    driver = _driver(num_spec_tokens=0)
    driver.add(request("P", range(64), checkpoint=32, max_tokens=40))
    driver.step()
    key = driver.state.logs["P"].hashes[1]
    assert driver.state.slots.ready_slot(key) is not None
    driver.drain("E5: P with a checkpoint at 32 decodes 40 tokens")
    hashes = driver.state.blocks  # the KV blocks are cached as usual ...
    assert len(hashes.hash_to_block) >= 4
    cached = set(driver.state.slots.hash_to_slot)
    assert cached == {key}  # ... but the only state is the checkpoint (no 48, 64, 80, ... boundary)


def test_e6_e7_consumer_hit_layout_at_aligned_and_unaligned_checkpoints():
    for bs, c in ((64, 64), (64, 48)):
        driver = _driver(mamba_block_size=bs)
        driver.add(request("P", [10] * 100, checkpoint=c))
        driver.step()
        driver.step()
        driver.add(request("C", [10] * c + [20] * 30, checkpoint=c))
        prefix = driver.state.logs["C"].hashes[:c // 16]
        shared = [driver.state.blocks.hash_to_block[h] for h in prefix]
        plan = driver.step()
        assert driver.chunks(plan)["C"] == (c, c + 30)
        row = plan.request_ids.index("C")
        assert plan.hit_copy_dst[0] == plan.state_slots[row] and plan.has_initial_state[row]
        assert list(plan.block_table[row, :c // 16]) == shared


@pytest.mark.parametrize("lose", [abort_request, preempt_request])
def test_e8_producer_lost_before_ready_hands_the_role_on(lose):
    driver = _driver(max_num_batched_tokens=16)
    driver.add(request("P", PRODUCER, checkpoint=48))
    driver.add(request("C", CONSUMER, checkpoint=48))
    driver.step()
    assert _claim(driver).producer_id == "P" and "C" in driver.state.waiting
    driver.state = lose(driver.state, "P")
    assert not driver.state.claims
    reserved = driver.state.slots.kind == SlotKind.RESERVED
    assert not reserved.any()
    driver.drain(f"P {lose.__name__}d with C waiting", max_steps=40)  # nobody waits forever


def test_a_preempted_producer_back_at_the_queue_head_reclaims_the_role():
    """Preempting P releases its checkpoint hash (nobody can wait on a lost producer); P goes back to
    the front of the queue, ahead of C, so the next admission makes P the producer again and C its
    consumer."""
    driver = _driver(max_num_batched_tokens=16)
    driver.add(request("P", PRODUCER, checkpoint=48))
    driver.step()
    driver.add(request("C", CONSUMER, checkpoint=48))
    driver.state = preempt_request(driver.state, "P")  # P goes back to the queue head
    assert not driver.state.claims and driver.state.waiting == ("P", "C")
    driver.step()
    assert _claim(driver).producer_id == "P"  # P is first in line again and reclaims
    driver.drain("P preempted after C queued")
    assert {o.request_id for o in driver.outputs if o.finished} == {"P", "C"}


def _compare_the_producer_wait_shortcut(monkeypatch) -> list[bool]:
    """Make every admission check run with and without `_waits_for_producer` (which skips a consumer's
    prefix search while its producer prefills) and assert both agree; returns the shortcut's answers."""
    admit = sys.modules["scheduler.admit"]
    plan_admission, shortcut, answers = admit._plan_admission, admit._waits_for_producer, []

    def answered(*args):
        answers.append(shortcut(*args))
        return answers[-1]

    def compared(p, rid):
        monkeypatch.setattr(admit, "_waits_for_producer", lambda *args: False)
        full = plan_admission(p, rid)
        monkeypatch.setattr(admit, "_waits_for_producer", answered)
        fast = plan_admission(p, rid)
        assert (fast is None) == (full is None), rid
        assert fast is None or (fast.role, fast.hit.num_tokens) == (full.role, full.hit.num_tokens)
        return fast

    monkeypatch.setattr(admit, "_plan_admission", compared)
    return answers


def test_consumers_wait_for_a_producing_checkpoint_without_a_prefix_search(monkeypatch):
    """A long queue of consumers is looked at every step while its producer prefills: each one that
    must wait is found with a few lookups, and the full check agrees."""
    answers = _compare_the_producer_wait_shortcut(monkeypatch)
    driver = _driver(max_num_batched_tokens=24)
    driver.add(request("P", PRODUCER, checkpoint=48))
    driver.step()
    for i in range(4):
        driver.add(request(f"C{i}", CONSUMER, checkpoint=48))
    driver.step()
    assert answers.count(True) == 4 and len(driver.state.waiting) == 4
    driver.drain("4 consumers queued behind a producing P")


def test_a_consumer_with_a_cached_prefix_past_a_producing_checkpoint_does_not_wait(monkeypatch):
    """While P produces the checkpoint at 48, C (marked at 48 too) has states cached past 48 by U, an
    unmarked request with C's tokens: C is not made to wait for P and takes a hit past the checkpoint."""
    answers = _compare_the_producer_wait_shortcut(monkeypatch)
    driver = _driver(max_num_batched_tokens=88, eagle_block_drop=False)
    tokens = [10] * 48 + [20] * 82
    driver.add(request("U", tokens))
    driver.step()  # U computes [0, 80) and caches the state at 80 (none at 48)
    driver.add(request("P", PRODUCER, checkpoint=48))
    driver.add(request("C", tokens, checkpoint=48))
    plan = driver.step()  # P claims the checkpoint and gets [0, 32); C has a hit at 80 but no budget left
    assert driver.chunks(plan) == {"U": (80, 128), "P": (0, 32)} and _claim(driver).status is CheckpointStatus.PRODUCING
    assert answers == [False, False] and driver.state.waiting == ("C",)  # P had no claim yet; C's prefix is cached
    plan = driver.step()
    assert driver.chunks(plan)["C"] == (128, 130) and plan.num_hit_copies == 1
    driver.drain("C with a cached prefix past P's producing checkpoint")


@pytest.mark.parametrize("budget, seed", [(32, 1), (64, 2), (256, 3)])
def test_the_producer_wait_shortcut_agrees_on_simulator_workloads(monkeypatch, budget, seed):
    _compare_the_producer_wait_shortcut(monkeypatch)
    args = parse_args(["--token-budget", str(budget), "--checkpoint-fraction", "0.6"])
    report = run_seed(config_from(args), Workload(steps=150, checkpoint_fraction=0.6), seed=seed)
    assert report.ok, report.summary()


@pytest.mark.parametrize("k, drop", [(0, False), (2, True)])
def test_a_consumer_pairs_even_when_the_checkpoint_prefix_kv_is_cached(k, drop):
    """A consumer that reaches the producer's pending checkpoint state through cached KV blocks pairs with it in
    the same step; it is not deferred by a step."""
    driver = _driver(mamba_block_size=64, num_spec_tokens=k, eagle_block_drop=drop)
    driver.add(request("U", [10] * 48 + [30] * 12))
    driver.drain("U caches the KV of [10] * 48")
    driver.add(request("P", [10] * 100, checkpoint=48))
    driver.add(request("C", [10] * 48 + [20] * 50, checkpoint=48))
    plan = driver.step()
    assert driver.chunks(plan) == {"P": (0, 48), "C": (48, 98)} and plan.num_pair_copies == 1
    assert list(plan.phase[:2]) == [1, 2]
    driver.drain("P and C")


def test_a_producer_aborted_in_flight_still_serves_its_consumers():
    """Finding 5: P is aborted between `schedule` and `update` of the step that computes its checkpoint.
    That step still runs: its KV blocks and checkpoint state are published once it completes, so the
    consumers queued meanwhile hit at 48 instead of each recomputing the prefix."""
    driver = _driver(mamba_block_size=64)
    driver.add(request("P", [10] * 100, checkpoint=48))
    state, plan = schedule(driver.state)
    assert driver.chunks(plan) == {"P": (0, 48)}
    for i in range(4):
        state = add_request(state, request(f"C{i}", [10] * 48 + [20 + i] * 30, checkpoint=48))
    state = abort_request(state, "P")
    driver.device.run(state, plan)
    driver.state, _ = update(state, plan, result_for(plan, 0))
    computed = []
    for _ in range(40):
        if not driver.state.has_work():
            break
        plan = driver.step()
        computed += [end - start for start, end in driver.chunks(plan).values() if end - start > 1]
    assert not driver.state.has_work() and sum(computed) == 4 * 30, computed
    assert check_drained(driver.state) == []
