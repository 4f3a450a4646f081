"""One step ahead: update on placeholders, then resolve, gives every request the tokens and finish reasons of
the serial loop, reads only correct states on the fake device, and frees everything at the end."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler import (
    RowKind,
    SchedulerConfig,
    SequenceSpec,
    StepResult,
    StopParams,
    abort_request,
    add_request,
    init_state,
    placeholder_result,
    resolve,
    schedule,
    update,
)
from scheduler.plan import BatchPlan
from scheduler.replay import ring_rows
from scheduler.sim.fake_device import FP_ROOT, FakeDevice, device_plan, fold
from scheduler.sim.invariants import check_drained, check_invariants
from scheduler.slots import SlotKind
from scheduler.state import TokenLog
from scheduler.transaction import StateEdit
from tests.scheduler.helpers import make_config, result_for

EOS, VOCAB, MAX_STEPS = 2, 50, 400


def _digest(*key) -> int:
    """A hash of `key` that, unlike `hash` of a str, is the same in every process."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=4).digest(), "little")


def token_at(request_id: str, position: int) -> int:
    """The token a request samples at `position`: a function of both only, as greedy decoding is."""
    value = _digest(request_id, position)
    return EOS if value % 17 == 0 else 3 + value % VOCAB


def draft_at(request_id: str, position: int) -> int:
    """The drafter's guess for `position`: right two times in three."""
    token = token_at(request_id, position)
    return token if _digest("draft", request_id, position) % 3 else 3 + (token + 1) % VOCAB


def device_result(plan: BatchPlan, k: int) -> StepResult:
    """Greedy verification against `token_at`: a verify row accepts its drafts while they are right."""
    rows = plan.row_bucket
    sampled, drafts = np.zeros((rows, 1 + k), np.int32), np.zeros((rows, k), np.int32)
    accepted = np.zeros(rows, np.int32)
    for r in range(plan.num_rows):
        rid, context = plan.request_ids[r], int(plan.context_lens[r])
        if plan.row_kind[r] == RowKind.VERIFY:  # tokens at context .. context + k: the last one, then the drafts
            while accepted[r] < k and plan.draft_token_ids[r, accepted[r]] == token_at(rid, context + 1 + accepted[r]):
                accepted[r] += 1
            sampled[r, :accepted[r] + 1] = [token_at(rid, context + 1 + j) for j in range(accepted[r] + 1)]
            last = context + 1 + accepted[r]
        else:
            last = context + int(plan.query_lens[r])
            sampled[r, 0] = token_at(rid, last)
        drafts[r] = [draft_at(rid, last + 1 + j) for j in range(k)]
    return StepResult(sampled, accepted, drafts)


class Run:
    """One workload driven serially or one step ahead; `streams` collects each request's tokens and end."""

    def __init__(self, cfg, requests, aborts):
        self.cfg, self.state, self.k = cfg, init_state(cfg), cfg.num_spec_tokens
        self.device = FakeDevice(cfg.num_state_slots, ring_rows(cfg.ring_size, self.k))
        self.accepted, self.prefixes, self.cached_checked = 0, {}, 0
        self.pending, self.aborts = list(requests), aborts  # aborts: request id -> after how many tokens
        self.streams: dict[str, list] = {}
        self.steps = 0

    def arrive(self):
        for req in self.pending[:2]:
            self.state = add_request(self.state, req)
        self.pending = self.pending[2:]
        for rid, after in self.aborts.items():
            stream = self.streams.setdefault(rid, [])
            if rid in self.state.requests and len(stream) >= after and "abort" not in stream:
                self.state = abort_request(self.state, rid)
                stream.append("abort")

    def record(self, outputs):
        for out in outputs:
            self.streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.streams[out.request_id].append(out.finish_reason.value)
        assert not check_invariants(self.state), check_invariants(self.state)
        self.check_cached_states()

    def check_cached_states(self):
        """Every READY cached state is the state after the tokens its key names: materializations included,
        whether a request ever hits them or not."""
        unit, state = self.cfg.hash_unit, self.state
        for rid in state.requests:
            tokens = state.token_ids(rid)
            for i, key in enumerate(state.logs[rid].hashes[:len(tokens) // unit]):
                self.prefixes.setdefault(key, tokens[:(i + 1) * unit])
        for key, slot in state.slots.hash_to_slot.items():
            # a key hashed and released within one transition is checked from its next hit on
            if state.slots.kind[slot] == SlotKind.CACHED and key in self.prefixes:
                assert self.device.slots[slot].s0 == fold((0, FP_ROOT), self.prefixes[key]), (key, slot)
                self.cached_checked += 1

    def serial(self):
        while (self.pending or self.state.has_work()) and self.steps < MAX_STEPS:
            self.arrive()
            self.state, plan = schedule(self.state)
            self.device.run(self.state, plan)
            result = device_result(plan, self.k)
            self.accepted += int(result.num_accepted.sum())
            self.state, outputs = update(self.state, plan, result)
            self.steps += 1
            self.record(outputs)
        return self

    def overlapped(self):
        """Schedule N+1 after N's placeholder update; N's tokens are resolved after N+1 is dispatched."""
        pending, last = None, None  # N's outputs on placeholders; the last device step's result
        while (self.pending or self.state.has_work() or pending) and self.steps < MAX_STEPS:
            self.arrive()
            plan = None
            if self.state.has_work():
                self.state, plan = schedule(self.state)
            if pending is not None:
                self.state, outputs = resolve(self.state, pending, last)
                self.record(outputs)
                pending = None
            if plan is not None:
                on_device = device_plan(plan, last)
                self.device.run(self.state, on_device)  # after resolve: the logs hold the real tokens
                last = device_result(on_device, self.k)
                self.accepted += int(last.num_accepted.sum())
                self.state, pending = update(self.state, plan, placeholder_result(plan, self.k))
                assert not check_invariants(self.state), check_invariants(self.state)
                self.check_cached_states()
            self.steps += 1
        return self


def workload(seed: int, num: int):
    rng = np.random.default_rng(seed)
    families = [rng.integers(3, VOCAB, 40).tolist() for _ in range(3)]
    requests = []
    for i in range(num):
        prompt = families[i % 3][:int(rng.integers(8, 40))] + rng.integers(3, VOCAB, int(rng.integers(1, 20))).tolist()
        stop_ids = (int(rng.integers(3, VOCAB)),) if rng.random() < 0.3 else ()
        params = StopParams(int(rng.integers(0, 40)), EOS, stop_ids, ignore_eos=bool(rng.random() < 0.2))
        checkpoint = 16 if len(prompt) > 16 and rng.random() < 0.4 else None  # producers and consumers
        requests.append(SequenceSpec(f"r{i}", tuple(prompt), params, checkpoint))
    aborts = {f"r{int(rng.integers(num))}": int(rng.integers(0, 6)) for _ in range(num // 4)}
    return requests, aborts


@settings(max_examples=12, deadline=None)
# a request preempted and readmitted with its placeholder unresolved, then with drafts: it waits a step for
# its accepted count
@example(seed=1, budget=48, num_blocks=10, k=0, window=4)
@example(seed=1, budget=48, num_blocks=10, k=3, window=4)
@example(seed=2, budget=48, num_blocks=200, k=3, window=0)  # no window: every verify step flushes
@given(seed=st.integers(0, 2**16), budget=st.sampled_from([16, 48, 256]), num_blocks=st.sampled_from([10, 200]),
       k=st.sampled_from([0, 1, 3]), window=st.sampled_from([0, 4]))
def test_one_step_ahead_emits_what_the_serial_loop_emits(seed, budget, num_blocks, k, window):
    cfg = make_config(max_num_batched_tokens=budget, num_blocks=num_blocks, max_num_seqs=6, max_model_len=128,
                      num_state_slots=24, num_spec_tokens=k, ring_size=window and window + k)
    requests, aborts = workload(seed, 12)
    serial = Run(cfg, requests, aborts).serial()
    overlapped = Run(cfg, requests, aborts).overlapped()
    assert serial.steps < MAX_STEPS and overlapped.steps < MAX_STEPS
    assert overlapped.streams.keys() == serial.streams.keys()
    for rid, stream in serial.streams.items():
        if rid not in aborts:
            assert overlapped.streams[rid] == stream, rid
            continue
        # an abort comes once a request has emitted `after` tokens; the modes emit them in different groups (a
        # step late, and with drafts their schedules differ), so the same sequence is cut within two steps
        tokens = sorted(([t for t in run.streams[rid] if isinstance(t, int)] for run in (serial, overlapped)), key=len)
        assert tokens[1][:len(tokens[0])] == tokens[0] and len(tokens[1]) < aborts[rid] + 2 * (1 + k), rid
    for run in (serial, overlapped):
        assert not run.device.errors, run.device.errors[:3]
        assert not check_drained(run.state), check_drained(run.state)
        assert run.cached_checked > 0
    assert (overlapped.accepted > 0) == (k > 0 and serial.accepted > 0)


def test_a_stop_token_ends_the_request_and_the_step_in_flight_emits_nothing_more():
    cfg = make_config()
    state = add_request(init_state(cfg), SequenceSpec("a", (5, 6, 7), StopParams(10, EOS)))
    state, first = schedule(state)
    state, pending = update(state, first, placeholder_result(first, 0))
    assert pending.token_ids[0, 0] == -1 and state.rows.last_token[state.row_of["a"]] == -1
    state, second = schedule(state)  # in flight while the first step's token is unknown
    assert second.token_ids[0] == -1
    state, outputs = resolve(state, pending, StepResult(np.array([[EOS]] * first.row_bucket, np.int32),
                                                        np.zeros(first.row_bucket, np.int32),
                                                        np.zeros((first.row_bucket, 0), np.int32)))
    assert [(o.request_id, o.new_token_ids, o.finish_reason.value) for o in outputs] == [("a", (EOS,), "stop")]
    assert "a" in state.aborting  # released by the update of the step that still runs it
    state, later = update(state, second, placeholder_result(second, 0))
    assert len(later) == 0 and not check_drained(state)


def test_accepted_drafts_are_added_a_step_late_and_end_the_request_at_max_tokens():
    """K = 2: the host counts no accepted draft; `resolve` adds them, cut at max_tokens, while the next step
    (scheduled as if they were all accepted) is in flight; that step's update then emits nothing."""
    cfg = make_config(num_spec_tokens=2, ring_size=4)
    state = add_request(init_state(cfg), SequenceSpec("a", (3, 4, 5, 6, 7), StopParams(4)))
    state, prefill = schedule(state)
    state, first = update(state, prefill, placeholder_result(prefill, 2))
    state, verify = schedule(state)
    assert verify.token_ids[:3].tolist() == [-1, -2, -3] and verify.positions[:3].tolist() == [5, 6, 7]
    rows = prefill.row_bucket
    state, out = resolve(state, first, StepResult(np.full((rows, 3), 10, np.int32), np.zeros(rows, np.int32),
                                                  np.tile(np.array([11, 12], np.int32), (rows, 1))))
    assert [(o.new_token_ids, o.finish_reason) for o in out] == [((10,), None)]
    state, second = update(state, verify, placeholder_result(verify, 2))
    state, third = schedule(state)  # positions as if nothing was accepted; blocks for all K
    assert third.positions[:3].tolist() == [6, 7, 8] and state.rows.num_blocks[state.row_of["a"]] * 16 >= 6 + 2 + 3
    sampled = np.tile(np.array([11, 12, 13], np.int32), (rows, 1))
    state, out = resolve(state, second, StepResult(sampled, np.full(rows, 2, np.int32), np.zeros((rows, 2), np.int32)))
    assert [(o.new_token_ids, o.finish_reason.value) for o in out] == [((11, 12, 13), "length")]
    assert state.token_ids("a") == [3, 4, 5, 6, 7, 10, 11, 12, 13] and "a" in state.aborting
    state, later = update(state, third, placeholder_result(third, 2))
    assert len(later) == 0 and not check_drained(state)


def test_a_placeholder_in_a_full_log_block_is_resolved_and_rehashed():
    """With blocks of 16, the token at position 15 fills a log block: its key is chained over the real token."""
    cfg = make_config()
    prompt = tuple(range(3, 18))  # 15 tokens: the first output fills the block
    state = add_request(init_state(cfg), SequenceSpec("a", prompt, StopParams(3, EOS)))
    state, plan = schedule(state)
    state, pending = update(state, plan, placeholder_result(plan, 0))
    log = state.logs["a"]
    assert log.length == 16 and log.slice(15, 16).tolist() == [-1]
    state, second = schedule(state)
    result = StepResult(np.full((plan.row_bucket, 1), 40, np.int32), np.zeros(plan.row_bucket, np.int32),
                        np.zeros((plan.row_bucket, 0), np.int32))
    state, _ = resolve(state, pending, result)
    expected = add_request(init_state(cfg), SequenceSpec("b", prompt + (40,), StopParams(1))).logs["b"]
    assert state.logs["a"].slice(0, 16).tolist() == list(prompt) + [40]
    assert state.logs["a"].hashes == expected.hashes


def test_a_placeholder_needs_a_result_that_has_its_row():
    cfg = make_config()
    state = add_request(init_state(cfg), SequenceSpec("a", (5, 6, 7), StopParams(4)))
    state, plan = schedule(state)
    state, pending = update(state, plan, placeholder_result(plan, 0))
    with pytest.raises(ValueError, match="placeholders name rows"):
        resolve(state, pending, StepResult(np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                           np.zeros((0, 0), np.int32)))


def test_resolving_no_outputs_with_an_abort_in_flight():
    """A prefill chunk emits nothing: resolve gets empty outputs while an aborted request's step runs."""
    cfg = SchedulerConfig(block_size=16, mamba_block_size=16, max_num_batched_tokens=16)
    state = add_request(init_state(cfg), SequenceSpec("a", tuple(range(1, 60)), StopParams(max_tokens=4)))
    state, first = schedule(state)
    state, pending = update(state, first, placeholder_result(first, 0))
    state, second = schedule(state)
    state = abort_request(state, "a")
    state, outputs = resolve(state, pending, result_for(first, 0, token=9))
    assert len(pending) == len(outputs) == 0
    state, later = update(state, second, placeholder_result(second, 0))
    assert len(later) == 0 and check_drained(state) == []


def _ends_at_eos_before_max_tokens(state, cfg):
    """eos comes one token before max_tokens: resolve ends the request while the next step, which reaches
    max_tokens on a placeholder, is in flight."""
    state = add_request(state, SequenceSpec("x", (5, 6, 7), StopParams(max_tokens=2, eos_token_id=EOS)))
    state, a = schedule(state)
    state, pending_a = update(state, a, placeholder_result(a, 0))
    state, b = schedule(state)
    state, _ = resolve(state, pending_a, result_for(a, 0, token=EOS))
    state, pending_b = update(state, b, placeholder_result(b, 0))
    return resolve(state, pending_b, result_for(b, 0, token=9))[0]


def _aborted_as_it_reaches_max_tokens(state, cfg):
    state = add_request(state, SequenceSpec("x", (5, 6, 7), StopParams(max_tokens=2)))
    state, a = schedule(state)
    state, pending_a = update(state, a, placeholder_result(a, 0))
    state, b = schedule(state)
    state = abort_request(state, "x")
    state, _ = resolve(state, pending_a, result_for(a, 0, token=9))
    state, pending_b = update(state, b, placeholder_result(b, 0))
    return resolve(state, pending_b, result_for(b, 0, token=9))[0]


def _aborted_as_its_prefill_samples_its_only_token(state, cfg):
    state = add_request(state, SequenceSpec("x", (5, 6, 7), StopParams(max_tokens=1)))
    state, a = schedule(state)
    state = abort_request(state, "x")
    state, pending = update(state, a, placeholder_result(a, 0))
    return resolve(state, pending, result_for(a, 0, token=9))[0]


@pytest.mark.parametrize("run", [_ends_at_eos_before_max_tokens, _aborted_as_it_reaches_max_tokens,
                                 _aborted_as_its_prefill_samples_its_only_token])
def test_an_end_on_a_placeholder_of_a_request_that_ended_meanwhile_leaves_nothing(run):
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128, num_blocks=32,
                          num_state_slots=8)
    state = run(init_state(cfg), cfg)
    assert dict(state.unresolved_ends) == {} and check_drained(state) == []


@pytest.mark.parametrize("name", ["unresolved_ends", "parked_tokens", "logs", "row_of"])
def test_check_drained_names_every_map_left_over(name):
    state = init_state(make_config())
    getattr(state, name)["ghost"] = 1  # written from outside: what a leak would leave
    assert any(name in problem for problem in check_drained(state))


def test_a_request_aborted_before_resolve_publishes_its_real_tokens_only():
    """The step in flight still computes the aborted request's last token: its block and boundary state are
    published, under the key of the real token, never the placeholder's."""
    cfg = make_config(block_size=4, mamba_block_size=4)
    state = add_request(init_state(cfg), SequenceSpec("a", (5, 6, 7), StopParams(max_tokens=8)))
    state, first = schedule(state)
    state, pending = update(state, first, placeholder_result(first, 0))
    state, second = schedule(state)
    state = abort_request(state, "a")
    state, outputs = resolve(state, pending, result_for(first, 0, token=40))
    assert len(outputs) == 0  # aborted: it emits nothing more
    state, _ = update(state, second, placeholder_result(second, 0))
    placeholder, real = (TokenLog.create(tokens, 4).hashes[0] for tokens in ([5, 6, 7, -1], [5, 6, 7, 40]))
    assert placeholder not in state.blocks.hash_to_block and real in state.blocks.hash_to_block
    assert [m.key for m in state.materializations] == [real]


def test_a_stop_among_accepted_drafts_publishes_no_placeholder():
    """K = 2: resolve cuts at a stop token (the first of two accepted drafts) while the next step runs, so the
    request computed past its last token; that step's update must not commit its placeholder below the count."""
    cfg = make_config(block_size=4, mamba_block_size=4, num_spec_tokens=2, ring_size=4)
    state = add_request(init_state(cfg), SequenceSpec("a", (5, 6, 7, 8, 9), StopParams(20, EOS)))

    def result(plan, sampled, accepted):
        rows = plan.row_bucket
        return StepResult(np.tile(np.array(sampled, np.int32), (rows, 1)), np.full(rows, accepted, np.int32),
                          np.full((rows, 2), 30, np.int32))
    state, prefill = schedule(state)
    state, pending = update(state, prefill, placeholder_result(prefill, 2))
    state, verify = schedule(state)
    state, _ = resolve(state, pending, result(prefill, [20, 0, 0], 0))
    state, pending = update(state, verify, placeholder_result(verify, 2))
    state, last = schedule(state)
    state, outputs = resolve(state, pending, result(verify, [EOS, 30, 31], 2))
    assert [(o.new_token_ids, o.finish_reason.value) for o in outputs] == [((EOS,), "stop")]
    state, _ = update(state, last, placeholder_result(last, 2))
    real = set(TokenLog.create([5, 6, 7, 8, 9, 20, EOS], 4).hashes)
    assert state.blocks.hash_to_block and set(state.blocks.hash_to_block) <= real
    assert check_drained(state) == []


def test_a_resolve_that_raises_undoes_its_token_replacements(monkeypatch):
    """The placeholder sits in a full log block (resolve replaces it there and re-chains the block's key):
    a resolve that raises at its very end leaves the log as it was, and a retry then resolves it."""
    cfg = make_config()
    prompt = tuple(range(3, 18))
    state = add_request(init_state(cfg), SequenceSpec("a", prompt, StopParams(3, EOS)))
    state, plan = schedule(state)
    state, pending = update(state, plan, placeholder_result(plan, 0))
    state, _ = schedule(state)
    before = (state.logs["a"].slice(0, 16).tolist(), list(state.logs["a"].hashes))

    def broken(edit):
        raise RuntimeError("freeze failed")
    monkeypatch.setattr(StateEdit, "freeze", broken)
    with pytest.raises(RuntimeError, match="freeze failed"):
        resolve(state, pending, result_for(plan, 0, token=40))
    monkeypatch.undo()
    assert (state.logs["a"].slice(0, 16).tolist(), list(state.logs["a"].hashes)) == before
    state, _ = resolve(state, pending, result_for(plan, 0, token=40))
    assert state.logs["a"].slice(0, 16).tolist() == list(prompt) + [40]


@pytest.mark.parametrize("accepted, width, message", [(5, 3, "num_accepted"), (-1, 3, "num_accepted"),
                                                      (0, 2, "sampled_token_ids")])
def test_resolve_checks_its_result_as_update_does(accepted, width, message):
    cfg = make_config(num_spec_tokens=2, ring_size=4)
    state = add_request(init_state(cfg), SequenceSpec("a", (3, 4, 5), StopParams(8)))
    state, prefill = schedule(state)
    state, pending = update(state, prefill, placeholder_result(prefill, 2))
    state, _ = schedule(state)
    rows = prefill.row_bucket
    bad = StepResult(np.full((rows, width), 9, np.int32), np.full(rows, accepted, np.int32),
                     np.zeros((rows, 2), np.int32))
    with pytest.raises(ValueError, match=message):
        resolve(state, pending, bad)
    state, outputs = resolve(state, pending, result_for(prefill, 2, token=9))  # the state is still whole
    assert [o.new_token_ids for o in outputs] == [(9,)]
