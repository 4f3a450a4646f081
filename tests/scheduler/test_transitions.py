"""Pure transitions, bad requests, decode/MTP bookkeeping, stop conditions and plan padding rules."""

from __future__ import annotations

import copy
import sys

import numpy as np
import pytest

from scheduler import (
    CheckpointMarkerError,
    FinishReason,
    RowKind,
    SchedulerConfig,
    SequenceSpec,
    StepResult,
    abort_request,
    add_request,
    init_state,
    parse_checkpoint_marker,
    preempt_request,
    schedule,
    update,
)
from scheduler.sim.invariants import check_drained, check_invariants
from scheduler.slots import SlotKind
from scheduler.state import BOOL_COLUMNS, INT_COLUMNS, StaleStateError
from tests.scheduler.helpers import Driver, make_config, request, result_for


def snapshot(state) -> dict:
    """Everything observable about a state, deep-copied (numpy columns included)."""
    names = INT_COLUMNS + BOOL_COLUMNS + ("drafts", "block_table", "tail")
    rows = {name: getattr(state.rows, name).copy() for name in names}
    logs = {rid: (state.token_ids(rid), list(state.logs[rid].hashes[:state.num_tokens(rid) // 16]))
            for rid in state.requests}
    return copy.deepcopy(dict(
        rows=rows, logs=logs, waiting=state.waiting, running=state.running, row_of=dict(state.row_of),
        refs=state.blocks.ref_count.copy(), kv=state.blocks.hash_to_block, kinds=state.slots.kind.copy(),
        slots=dict(state.slots.hash_to_slot), claims=dict(state.claims), mats=state.materializations,
        in_flight=state.in_flight, step=state.step, parked=dict(state.parked_tokens)))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict) and key == "rows":
            for name in a[key]:
                np.testing.assert_array_equal(a[key][name], b[key][name], err_msg=name)
        elif isinstance(a[key], np.ndarray):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            assert a[key] == b[key], key


def _busy_state(k: int = 2):
    driver = Driver(make_config(num_spec_tokens=k, max_num_batched_tokens=64))
    for i in range(4):
        driver.add(request(f"r{i}", [5 + i] * 40 + list(range(20 + i)), max_tokens=12, checkpoint=32 if i else None))
    for _ in range(3):
        driver.step(accepted=1)
    return driver


def test_a_consumed_state_raises_and_handed_out_arrays_stay_put():
    """Arrays taken from a state stay readable, a consumed state raises."""
    driver = Driver(make_config(mamba_block_size=64))
    driver.add(request("a", range(1, 21), max_tokens=4))
    s0 = driver.state
    s1, plan = schedule(s0)
    s2, _ = update(s1, plan, result_for(plan, 0))
    table = s2.rows.block_table[0, :4].copy()
    assert table.tolist() == [1, 2, 0, 0]
    for stale in (s0, s1):
        with pytest.raises(StaleStateError):
            stale.rows  # noqa: B018 - the read itself must raise
        with pytest.raises(StaleStateError):
            schedule(stale)
    assert s2.rows.block_table[0, :4].tolist() == table.tolist()


def test_plan_and_output_arrays_are_owned_by_their_receiver():
    """Arrays of a plan and of the outputs are held across the next two transitions and do not change."""
    driver = _busy_state()
    state, plan = schedule(driver.state)
    held = {name: np.array(value) for name, value in plan._asdict().items() if isinstance(value, np.ndarray)}
    state, outputs = update(state, plan, result_for(plan, 2, accepted=1))
    held_out = [np.array(outputs.token_ids), np.array(outputs.num_new_tokens)]
    state, next_plan = schedule(state)
    state, _ = update(state, next_plan, result_for(next_plan, 2, accepted=2))
    for name, value in held.items():
        np.testing.assert_array_equal(getattr(plan, name), value, err_msg=name)
    np.testing.assert_array_equal(outputs.token_ids, held_out[0])
    np.testing.assert_array_equal(outputs.num_new_tokens, held_out[1])
    for name in held:
        assert not np.shares_memory(getattr(plan, name), state.rows.block_table), name


def test_transitions_are_deterministic_functions_of_their_input():
    driver = _busy_state()
    s0 = driver.state
    copy_a, copy_b = s0.snapshot(), copy.deepcopy(s0)
    assert_same(snapshot(copy_a), snapshot(s0))
    s1, plan = schedule(copy_a)
    s1b, plan_b = schedule(copy_b)
    assert_same(snapshot(s1), snapshot(s1b))
    assert all(np.array_equal(getattr(plan, f), getattr(plan_b, f)) for f in ("token_ids", "slot_mapping"))
    result = result_for(plan, 2, accepted=1)
    s2, out = update(s1, plan, result)
    s2b, out_b = update(s1b, plan, result)
    assert out == out_b
    assert_same(snapshot(s2), snapshot(s2b))
    assert_same(snapshot(s0), snapshot(driver.state))  # the original was never touched by its copies


def test_a_transition_that_raises_midway_leaves_the_state_whole(monkeypatch):
    """Transitions write the state's tables in place; an error after some writes (here a failing plan
    assembly, after blocks were allocated and tables grown) must undo them and keep the input valid."""
    s0 = _busy_state().state
    before = snapshot(s0)

    def broken(*args, **kwargs):
        raise RuntimeError("plan assembly failed")
    monkeypatch.setattr(sys.modules["scheduler.schedule"], "assemble", broken)
    with pytest.raises(RuntimeError, match="assembly failed"):
        schedule(s0)
    monkeypatch.undo()
    assert_same(before, snapshot(s0))
    s1, plan = schedule(s0)  # the same step as from an identical state that never failed
    reference, reference_plan = schedule(_busy_state().state)
    assert_same(snapshot(reference), snapshot(s1))
    assert np.array_equal(plan.slot_mapping, reference_plan.slot_mapping) and check_invariants(s1) == []


def test_an_update_that_raises_midway_undoes_its_token_log_appends(monkeypatch):
    driver = Driver(make_config(mamba_block_size=16, num_spec_tokens=0))
    driver.add(request("a", range(1, 17), max_tokens=40))
    for _ in range(16):  # the 16th decode token fills a log block: update appends it to the log
        driver.step()
    state, plan = schedule(driver.state)
    before = snapshot(state)

    def broken(*args, **kwargs):
        raise RuntimeError("finish failed")
    monkeypatch.setattr(sys.modules["scheduler.update"], "_finish_rows", broken)
    with pytest.raises(RuntimeError, match="finish failed"):
        update(state, plan, result_for(plan, 0))
    monkeypatch.undo()
    assert_same(before, snapshot(state))
    update(state, plan, result_for(plan, 0))


@pytest.mark.parametrize("bad, message", [
    (request("e", []), "empty"),
    (request("long", [1] * 4096), "max_model_len"),
    (request("c0", [1] * 40, checkpoint=20), "checkpoint_position"),
    (request("c1", [1] * 40, checkpoint=48), "checkpoint_position"),
    (request("huge", [1] * 100, max_tokens=4000), "can never fit"),
    (request("ok", [4, 5]), "already in use"),
])
def test_bad_requests_raise_and_leave_the_state_unchanged(bad, message):
    cfg = make_config(num_blocks=64)
    state = add_request(init_state(cfg), request("ok", [1, 2, 3]))
    before = snapshot(state)
    with pytest.raises(ValueError, match=message):
        add_request(state, bad)
    assert_same(before, snapshot(state))
    add_request(state, request("next", [4, 5]))  # still the live state


def test_unknown_aborts_and_bad_markers_raise_and_change_nothing():
    state = add_request(init_state(make_config()), request("a", [1, 2, 3]))
    before = snapshot(state)
    with pytest.raises(KeyError):
        abort_request(state, "nope")
    with pytest.raises(CheckpointMarkerError, match="exactly once"):  # the tokenizer layer's check, before add
        parse_checkpoint_marker([1, 9, 2, 9, 3], marker_id=9, hash_unit=1)
    assert_same(before, snapshot(state))
    abort_request(state, "a")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mamba_block_size"):
        SchedulerConfig(block_size=16, mamba_block_size=24)
    with pytest.raises(ValueError, match="cache_mode"):
        SchedulerConfig(cache_mode="all")
    with pytest.raises(ValueError, match="token_buckets"):
        SchedulerConfig(max_num_batched_tokens=100, token_buckets=(8, 64))


def test_schedule_twice_without_update_and_foreign_plans_are_refused():
    state, plan = schedule(add_request(init_state(make_config()), request("a", [1, 2, 3])))
    with pytest.raises(RuntimeError, match="in flight"):
        schedule(state)
    bad = StepResult(np.zeros((plan.row_bucket, 1), np.int32), np.full(plan.row_bucket, 3, np.int32),
                     np.zeros((plan.row_bucket, 0), np.int32))
    with pytest.raises(ValueError, match="num_accepted"):
        update(state, plan, bad)  # refused: the state stays usable
    state2, _ = update(state, plan, result_for(plan, 0))
    with pytest.raises(ValueError, match="not the step in flight"):
        update(state2, plan, result_for(plan, 0))


def test_verify_rows_get_one_plus_k_tokens_and_commit_accepted_drafts():
    k = 3
    driver = Driver(make_config(num_spec_tokens=k))
    driver.add(request("a", range(5, 25), max_tokens=30))
    driver.step()
    state = driver.state
    row = state.row_of["a"]
    assert state.rows.num_computed[row] == 20 and state.rows.num_tokens[row] == 21
    plan = driver.step(accepted=2)
    assert plan.row_kind[0] == RowKind.VERIFY and plan.query_lens[0] == 1 + k and plan.num_logits[0] == 1 + k
    assert list(plan.positions[:4]) == [20, 21, 22, 23] and list(plan.token_ids[1:4]) == [8, 8, 8]
    assert driver.outputs[-1].new_token_ids == (8, 8, 7)  # two accepted drafts + the bonus token
    rows = driver.state.rows
    assert rows.num_computed[row] == 23 and rows.num_tokens[row] == 24  # rejected draft rolled back
    assert (rows.ring_start[row], rows.committed[row]) == (0, 3)


@pytest.mark.parametrize("params, tokens, reason", [
    (dict(max_tokens=3), (8, 8), FinishReason.LENGTH),
    (dict(max_tokens=30, eos_token_id=7), (), FinishReason.STOP),
    (dict(max_tokens=30, stop_token_ids=(7,)), (), FinishReason.STOP),
    (dict(max_tokens=30, eos_token_id=7, ignore_eos=True), None, None),
])
def test_stop_conditions(params, tokens, reason):
    driver = Driver(make_config(num_spec_tokens=2))
    driver.add(request("a", range(5, 25), **params))
    driver.step()
    if reason is FinishReason.STOP:
        assert driver.outputs[-1].finish_reason is reason and not driver.state.has_work()
        return
    driver.step(accepted=2)
    last = driver.outputs[-1]
    if reason is None:
        assert last.finish_reason is None and driver.state.has_work()
    else:
        assert last.new_token_ids == tokens and last.finish_reason is reason  # cut at max_tokens
        assert check_drained(driver.state) == []


def test_preemption_under_memory_pressure_frees_everything_and_recomputes():
    cfg = make_config(num_blocks=9, num_spec_tokens=1, max_num_batched_tokens=128, num_state_slots=8)
    driver = Driver(cfg)
    driver.add(request("old", [1] * 40, max_tokens=60))
    driver.add(request("new", [2] * 40, max_tokens=60))
    preempted = False
    for _ in range(400):
        if not driver.state.has_work():
            break
        driver.step(accepted=1)
        preempted |= "new" in driver.state.waiting and driver.state.num_tokens("new") > 40
        assert check_invariants(driver.state) == []
    assert preempted and not driver.state.has_work()
    assert check_drained(driver.state) == []
    assert {o.request_id for o in driver.outputs if o.finished} == {"old", "new"}


def test_preempt_request_resets_trackers_and_releases_slots():
    driver = _busy_state()
    rid = driver.state.running[0]
    state = preempt_request(driver.state, rid)
    assert rid in state.waiting[:1] and rid not in state.row_of
    assert int(np.count_nonzero(state.slots.kind == SlotKind.RUNNING)) == len(state.running) + 1  # + null
    assert check_invariants(state) == []


def test_abort_while_the_step_is_in_flight_is_ignored_by_update():
    driver = _busy_state()
    state, plan = schedule(driver.state)
    state = abort_request(state, plan.request_ids[0])
    state, outputs = update(state, plan, result_for(plan, 2, accepted=2))
    assert plan.request_ids[0] not in {o.request_id for o in outputs}
    assert check_invariants(state) == []


def test_plan_padding_points_at_the_null_slot_and_block():
    state, plan = schedule(_busy_state().state)
    rows, tokens = plan.num_rows, plan.num_tokens
    assert plan.token_bucket >= tokens and plan.row_bucket >= rows
    assert plan.token_bucket in state.config.token_buckets and plan.row_bucket in state.config.row_buckets
    assert not plan.state_slots[rows:].any() and not plan.block_table[rows:].any()
    assert not plan.slot_mapping[tokens:].any() and not plan.token_ids[tokens:].any()
    assert (plan.row_kind[rows:] == RowKind.PADDING).all() and (plan.cu_seqlens[rows + 1:] == tokens).all()
    assert not plan.token_ids.flags.writeable
    for r in range(rows):
        lo, hi = plan.cu_seqlens[r], plan.cu_seqlens[r + 1]
        blocks = plan.block_table[r, plan.positions[lo:hi] // 16]
        assert (plan.slot_mapping[lo:hi] == blocks * 16 + plan.positions[lo:hi] % 16).all() and blocks.all()


@pytest.mark.parametrize("make, message", [
    (lambda: request("f", [1.5, 2, 3]), "integers"),
    (lambda: request("neg", [1, -2, 3]), r"\[0, 1000\)"),
    (lambda: request("big", [1, 2, 1000]), r"\[0, 1000\)"),
    (lambda: request("cf", [1] * 40, checkpoint=32.0), "checkpoint_position"),
    (lambda: request("mt", [1, 2], max_tokens=2.0), "max_tokens"),
    (lambda: request("st", [1, 2], stop_token_ids=(3, 4.0)), "stop_token_ids"),
    (lambda: request("eos", [1, 2], eos_token_id=-1), "eos_token_id"),
    (lambda: request("bool", (1, True, 3)), "prompt_token_ids"),
    (lambda: SequenceSpec("none", (1, 2), None), "stop_params"),
    (lambda: SequenceSpec("dict", (1, 2), {"max_tokens": 3}), "stop_params"),
    (lambda: SequenceSpec("surrogate", (1, 2), cache_salt="\ud800"), "cache_salt"),
])
def test_request_fields_are_type_and_range_checked(make, message):
    """Fields of the wrong type or range are refused at `add_request` (a float checkpoint would wedge every later
    schedule, float ids would be truncated), and the state is left unchanged."""
    state = add_request(init_state(make_config(vocab_size=1000)), request("ok", [1, 2, 3]))
    before = snapshot(state)
    with pytest.raises(ValueError, match=message):
        add_request(state, make())
    assert_same(before, snapshot(state))
    state, plan = schedule(state)
    assert plan.request_ids == ("ok",)


def test_a_ring_smaller_than_one_verify_row_is_rejected():
    with pytest.raises(ValueError, match="ring_size"):
        SchedulerConfig(num_spec_tokens=3, ring_size=3)


def test_the_slot_pool_minimum_cannot_deadlock_a_producer_with_a_hit():
    """Finding 1: a producer with a prefix hit needs a running, a reserved and a pinned hit slot."""
    with pytest.raises(ValueError, match="num_state_slots"):
        make_config(num_state_slots=3)
    driver = Driver(make_config(num_state_slots=4))
    driver.add(request("U", range(100, 140)))
    driver.drain("U")
    driver.add(request("P", range(100, 160), checkpoint=48))
    driver.add(request("X", [7] * 10))
    driver.drain("P with a checkpoint and a hit, X behind it, 4 state slots", max_steps=20)
    assert {o.request_id for o in driver.outputs if o.finished} == {"U", "P", "X"}


def test_a_request_keeps_its_own_copy_of_a_list_prompt():
    prompt = [1, 2, 3]
    req = SequenceSpec("a", prompt)
    prompt.append(4)
    state = add_request(init_state(make_config()), req)
    prompt.append(5)
    assert req.prompt_token_ids == (1, 2, 3) and state.token_ids("a") == [1, 2, 3]
    with pytest.raises(TypeError, match="prompt_token_ids"):
        SequenceSpec("b", 5)


def _state_arrays(state) -> dict:
    """Every numpy array a caller can read from a state (table views, pools, the running rows)."""
    rows, slots, blocks = state.rows, state.slots, state.blocks
    arrays = {name: getattr(rows, name) for name in INT_COLUMNS + BOOL_COLUMNS}
    arrays.update(ints=rows.ints, bools=rows.bools, drafts=rows.drafts, data=rows.data,
                  block_table=rows.block_table, tail=rows.tail, kind=slots.kind, stamp=slots.stamp,
                  ref_count=blocks.ref_count, queue_pos=blocks.queue_pos, refs=blocks.refs[:], stack=blocks.stack[:],
                  running_rows=state.running_rows, log=state.logs[state.running[0]].slice(0, 4))
    return arrays


def test_arrays_read_from_a_state_are_read_only(monkeypatch):
    """A caller cannot corrupt a live state through what it reads: not at rest, not after a transition raised
    (rolled back), not in a snapshot."""
    driver = _busy_state()
    states = [driver.state, driver.state.snapshot()]
    monkeypatch.setattr(sys.modules["scheduler.schedule"], "assemble", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        schedule(driver.state)
    monkeypatch.undo()
    for state in states:
        for name, array in _state_arrays(state).items():
            with pytest.raises(ValueError, match="read-only"):
                array[...] = 0
                pytest.fail(f"{name} is writable")
            assert array.size or name == "data", name  # row_data_bytes = 0
    state, plan = schedule(driver.state)  # transitions still write
    update(state, plan, result_for(plan, 2, accepted=1))
