"""Hypothesis state machine: random adds, aborts (in flight too), steps, acceptances and preemptions, each step
run serially or one step ahead (updated on placeholders, resolved while the next step is in flight).

After every transition: ref counts equal live references, no slot or block owned twice, every state
read by the (fake) device is the one it claims, so no consumer reads an UNREADY checkpoint. At the
end every request finishes (the machine drains), the pools return to their initial free counts, every
per-request map is empty, and the event log replays bit for bit.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler import RowKind, StepResult, init_state, placeholder_result
from scheduler.events import EventLog, replay
from scheduler.replay import ring_rows
from scheduler.sim.fake_device import FakeDevice, device_plan
from scheduler.sim.invariants import check_drained, check_invariants
from tests.scheduler.helpers import make_config, request, result_for

K = 2
CFG = make_config(block_size=4, mamba_block_size=8, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=96,
                  num_blocks=40, num_state_slots=9, num_spec_tokens=K, ring_size=4)
PREFIXES = ([1] * 16, [2] * 8 + [3] * 8)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = init_state(CFG)
        self.log = EventLog(CFG)  # teardown replays it: the same plans and outputs, bit for bit
        self.device = FakeDevice(CFG.num_state_slots, ring_rows(CFG.ring_size, K))
        self.next_id = 0
        self.plan = None  # scheduled, not yet run and updated
        self.pending = None  # one step ahead: the last update's outputs on placeholders, not yet resolved
        self.last_result = None  # what the device returned for the last step it ran

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(1, 16), tail=st.lists(st.integers(4, 9), max_size=12),
          max_tokens=st.integers(1, 12), marked=st.booleans())
    def add(self, prefix, cut, tail, max_tokens, marked):
        tokens = prefix[:cut] + tail
        checkpoint = 8 if marked and len(tokens) > 8 and cut >= 8 else None
        new = request(f"r{self.next_id}", tokens, max_tokens, checkpoint, eos_token_id=3)
        self.state = self.log.add_request(self.state, new)
        self.next_id += 1

    @precondition(lambda self: self.state.requests)
    @rule(data=st.data())
    def abort(self, data):  # between steps, or while one is in flight (before or after the last one's resolve)
        rid = data.draw(st.sampled_from(sorted(self.state.requests)))
        self.state = self.log.abort_request(self.state, rid)

    @precondition(lambda self: self.state.running and self.plan is None)
    @rule(data=st.data())
    def preempt(self, data):
        self.state = self.log.preempt_request(self.state, data.draw(st.sampled_from(sorted(self.state.running))))

    @precondition(lambda self: self.plan is None)
    @rule()
    def schedule(self):
        self.state, self.plan = self.log.schedule(self.state)
        assert check_invariants(self.state) == []

    @precondition(lambda self: self.pending is not None)
    @rule()
    def resolve(self):
        self.state, _ = self.log.resolve(self.state, self.pending, self.last_result)
        self.pending = None

    @precondition(lambda self: self.plan is not None and self.pending is None)
    @rule(data=st.data(), ahead=st.booleans())
    def run_and_update(self, data, ahead):
        rows = self.plan.row_bucket
        accepted = np.array(data.draw(st.lists(st.integers(0, K), min_size=rows, max_size=rows)), np.int32)
        sampled = np.array(data.draw(st.lists(st.integers(3, 9), min_size=rows * (1 + K), max_size=rows * (1 + K))),
                           np.int32).reshape(rows, 1 + K)
        self._run(sampled, accepted, ahead)

    def _run(self, sampled: np.ndarray, accepted: np.ndarray, ahead: bool) -> None:
        """The device runs the plan once the step before is resolved (the fake device checks real tokens); its
        result goes to `update`, or one step ahead a placeholder result does and `resolve` takes it later. A
        plan scheduled before the step before was resolved holds placeholders: it runs one step ahead."""
        plan, self.plan = self.plan, None
        on_device = device_plan(plan, self.last_result)
        self.device.run(self.state, on_device)
        accepted = np.where(plan.row_kind == RowKind.VERIFY, accepted, 0).astype(np.int32)
        sampled[:, :K] = np.where(np.arange(K) < accepted[:, None], on_device.draft_token_ids, sampled[:, :K])
        self.last_result = StepResult(sampled, accepted, np.full((plan.row_bucket, K), 5, np.int32))
        if ahead or (plan.token_ids < 0).any():
            self.state, self.pending = self.log.update(self.state, plan, placeholder_result(plan, K))
        else:
            self.state, _ = self.log.update(self.state, plan, self.last_result)

    @invariant()
    def consistent(self):
        assert check_invariants(self.state) == []
        assert not self.device.errors, self.device.errors

    def teardown(self):
        if self.pending is not None:
            self.resolve()
        if self.plan is not None:
            rows = self.plan.row_bucket
            self._run(np.full((rows, 1 + K), 4, np.int32), np.ones(rows, np.int32), ahead=False)
        if self.pending is not None:
            self.resolve()
        for _ in range(2000):
            if not self.state.has_work():
                break
            self.state, plan = self.log.schedule(self.state)
            self.device.run(self.state, plan)
            self.state, _ = self.log.update(self.state, plan, result_for(plan, K, accepted=1, token=4))
        assert not self.device.errors, self.device.errors
        assert not self.state.has_work(), "requests never finished"
        assert check_drained(self.state) == []
        assert replay(self.log) == []


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
