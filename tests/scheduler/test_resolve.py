"""One step ahead: update on placeholders, then resolve, gives every request the tokens and finish reasons of
the serial loop, reads only correct states on the fake device, and frees everything at the end."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from scheduler import (
    Request,
    RowKind,
    SamplingParams,
    StepResult,
    abort_request,
    add_request,
    init_state,
    placeholder_result,
    resolve,
    schedule,
    update,
)
from scheduler.fake_device import FakeDevice
from scheduler.invariants import check_drained, check_invariants
from scheduler.plan import BatchPlan
from scheduler.replay import ring_rows
from tests.scheduler.helpers import make_config

EOS, VOCAB, MAX_STEPS = 2, 50, 400


def token_at(request_id: str, position: int) -> int:
    """The token a request samples at `position`: a function of both only, as greedy decoding is."""
    digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=4).digest()
    value = int.from_bytes(digest, "little")
    return EOS if value % 17 == 0 else 3 + value % VOCAB


def device_result(plan: BatchPlan) -> StepResult:
    rows = plan.row_bucket
    sampled = np.zeros((rows, 1), np.int32)
    for r in range(plan.num_rows):
        if plan.row_kind[r] != RowKind.PADDING:
            sampled[r, 0] = token_at(plan.request_ids[r], int(plan.context_lens[r] + plan.query_lens[r]))
    return StepResult(sampled, np.zeros(rows, np.int32), np.zeros((rows, 0), np.int32))


def with_tokens(plan: BatchPlan, previous: StepResult | None) -> BatchPlan:
    """The plan as the device sees it: placeholder -(1 + r) is the token row r emitted in the step before."""
    tokens = plan.token_ids
    if (tokens < 0).any():
        tokens = np.where(tokens < 0, previous.sampled_token_ids[np.maximum(-1 - tokens, 0), 0], tokens)
    return plan._replace(token_ids=tokens)


class Run:
    """One workload driven serially or one step ahead; `streams` collects each request's tokens and end."""

    def __init__(self, cfg, requests, aborts):
        self.cfg, self.state = cfg, init_state(cfg)
        self.device = FakeDevice(cfg.num_state_slots, ring_rows(cfg.ring_size, 0))
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

    def serial(self):
        while (self.pending or self.state.has_work()) and self.steps < MAX_STEPS:
            self.arrive()
            self.state, plan = schedule(self.state)
            self.device.run(self.state, plan)
            self.state, outputs = update(self.state, plan, device_result(plan))
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
                device_plan = with_tokens(plan, last)
                self.device.run(self.state, device_plan)  # after resolve: the logs hold the real tokens
                last = device_result(device_plan)
                self.state, pending = update(self.state, plan, placeholder_result(plan, 0))
                assert not check_invariants(self.state), check_invariants(self.state)
            self.steps += 1
        return self


def workload(seed: int, num: int):
    rng = np.random.default_rng(seed)
    families = [rng.integers(3, VOCAB, 40).tolist() for _ in range(3)]
    requests = []
    for i in range(num):
        prompt = families[i % 3][:int(rng.integers(8, 40))] + rng.integers(3, VOCAB, int(rng.integers(1, 20))).tolist()
        stop_ids = (int(rng.integers(3, VOCAB)),) if rng.random() < 0.3 else ()
        params = SamplingParams(int(rng.integers(0, 40)), EOS, stop_ids, ignore_eos=bool(rng.random() < 0.2))
        checkpoint = 16 if len(prompt) > 16 and rng.random() < 0.4 else None  # producers and consumers
        requests.append(Request(f"r{i}", tuple(prompt), params, checkpoint))
    aborts = {f"r{int(rng.integers(num))}": int(rng.integers(0, 6)) for _ in range(num // 4)}
    return requests, aborts


@settings(max_examples=16, deadline=None)
@example(seed=1, budget=48, num_blocks=10)  # a request preempted and readmitted with its placeholder unresolved
@given(seed=st.integers(0, 2**16), budget=st.sampled_from([16, 48, 256]), num_blocks=st.sampled_from([10, 200]))
def test_one_step_ahead_emits_what_the_serial_loop_emits(seed, budget, num_blocks):
    cfg = make_config(max_num_batched_tokens=budget, num_blocks=num_blocks, max_num_seqs=6, max_model_len=128,
                      num_state_slots=24)
    requests, aborts = workload(seed, 12)
    serial = Run(cfg, requests, aborts).serial()
    overlapped = Run(cfg, requests, aborts).overlapped()
    assert serial.steps < MAX_STEPS and overlapped.steps < MAX_STEPS
    assert overlapped.streams.keys() == serial.streams.keys()
    for rid, stream in serial.streams.items():
        if rid not in aborts:
            assert overlapped.streams[rid] == stream, rid
            continue
        # an abort reaches the request one step later in its life: by then it may have ended by itself
        tokens = [[t for t in run.streams[rid] if isinstance(t, int)] for run in (serial, overlapped)]
        assert tokens[1][:len(tokens[0])] == tokens[0] and len(tokens[1]) <= len(tokens[0]) + 1, rid
    for run in (serial, overlapped):
        assert not run.device.errors, run.device.errors[:3]
        assert not check_drained(run.state), check_drained(run.state)


def test_a_stop_token_ends_the_request_and_the_step_in_flight_emits_nothing_more():
    cfg = make_config()
    state = add_request(init_state(cfg), Request("a", (5, 6, 7), SamplingParams(10, EOS)))
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


def test_a_placeholder_in_a_full_log_block_is_resolved_and_rehashed():
    """With blocks of 16, the token at position 15 fills a log block: its key is chained over the real token."""
    cfg = make_config()
    prompt = tuple(range(3, 18))  # 15 tokens: the first output fills the block
    state = add_request(init_state(cfg), Request("a", prompt, SamplingParams(3, EOS)))
    state, plan = schedule(state)
    state, pending = update(state, plan, placeholder_result(plan, 0))
    log = state.logs["a"]
    assert log.length == 16 and log.slice(15, 16).tolist() == [-1]
    state, second = schedule(state)
    result = StepResult(np.full((plan.row_bucket, 1), 40, np.int32), np.zeros(plan.row_bucket, np.int32),
                        np.zeros((plan.row_bucket, 0), np.int32))
    state, _ = resolve(state, pending, result)
    expected = add_request(init_state(cfg), Request("b", prompt + (40,), SamplingParams(1))).logs["b"]
    assert state.logs["a"].slice(0, 16).tolist() == list(prompt) + [40]
    assert state.logs["a"].hashes == expected.hashes


def test_placeholders_need_k_zero_and_a_result_that_has_their_rows():
    cfg = make_config()
    state = add_request(init_state(cfg), Request("a", (5, 6, 7), SamplingParams(4)))
    state, plan = schedule(state)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        placeholder_result(plan, 2)
    state, pending = update(state, plan, placeholder_result(plan, 0))
    with pytest.raises(ValueError, match="placeholders name rows"):
        resolve(state, pending, StepResult(np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                                           np.zeros((0, 0), np.int32)))
