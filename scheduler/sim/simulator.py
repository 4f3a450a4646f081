"""Drive the real schedule/update against the fake device with a random workload; count problems.

Workload per seed: requests arrive over the first `steps` steps, drawn from a few shared prefix
families (so prefix hits happen), a `checkpoint_fraction` of them carrying a checkpoint marker at
the end of their family prefix (parsed by the real `parse_checkpoint_marker`, so consumers exist),
an `abort_fraction` of them aborted at a random later step (sometimes while a step is in flight).
The device accepts a random number of drafts per verify row and samples random tokens (with an
eos id in the vocabulary). After the arrival phase the run drains until every request has ended.
One step ahead (`ahead`) the run drives the scheduler as the overlapped engine does: schedule N+1,
resolve N with the device's tokens, run N+1 on the device (placeholders replaced, `device_plan`),
update N+1 on placeholders; aborts land before and after the resolve, and the event log records the
resolves, so such runs replay too.

Counted: stalls (a running prefill scheduled 0 tokens while the step's unused budget covered its
whole remainder, or while no request admitted before it was scheduled: the progress bound,
schedule.py), i1_violations (any state read that is not the state after exactly context_len
tokens of that request, every hit included, or a hit copy of a slot that is not READY) and leaks
(`check_invariants` failures after any transition, and pools not back to their initial free counts
once everything has ended).
"""

from __future__ import annotations

import dataclasses
import random
from typing import NamedTuple

import numpy as np

from scheduler.checkpoints import parse_checkpoint_marker
from scheduler.config import SchedulerConfig
from scheduler.events import EventLog
from scheduler.plan import BatchPlan, RowKind, StepResult
from scheduler.replay import ring_rows
from scheduler.request import SequenceSpec, StepOutputs, StopParams
from scheduler.resolve import placeholder_result
from scheduler.sim.fake_device import FakeDevice, device_plan
from scheduler.sim.invariants import check_drained, check_invariants
from scheduler.state import SchedulerState, init_state

MARKER, EOS, VOCAB = 99_999, 2, 5_000
DRAIN_LIMIT = 20_000


class Workload(NamedTuple):
    steps: int = 300
    checkpoint_fraction: float = 0.33
    abort_fraction: float = 0.1
    arrival_rate: float = 0.35
    max_prompt_blocks: int = 6
    follow_up_rate: float = 0.3  # a finished request comes back as the next turn of its chat


@dataclasses.dataclass
class Report:
    total: int = 0
    ended: int = 0
    stalls: int = 0
    i1_violations: int = 0
    leaks: int = 0
    hits_checked: int = 0
    preemptions: int = 0
    steps: int = 0
    messages: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Report) -> None:
        for f in ("total", "ended", "stalls", "i1_violations", "leaks", "hits_checked", "preemptions", "steps"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.messages += other.messages[:5]

    @property
    def ok(self) -> bool:
        return not (self.stalls or self.i1_violations or self.leaks) and self.ended == self.total

    def summary(self) -> str:
        return (f"finished={self.ended}/{self.total} stalls={self.stalls} "
                f"i1_violations={self.i1_violations} leaks={self.leaks}")


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [3 + int(rng.random() * (VOCAB - 3)) for _ in range(count)]


def make_request(rng: random.Random, cfg: SchedulerConfig, w: Workload, families: list[list[int]],
                 rid: str) -> SequenceSpec:
    family = rng.choice(families)
    unit = cfg.mamba_block_size
    suffix = _tokens(rng, rng.randrange(1, unit * w.max_prompt_blocks // 2 + 2))
    prompt = family[:rng.randrange(1, len(family) + 1)] + suffix if rng.random() < 0.3 else family + suffix
    params = StopParams(max_tokens=rng.randrange(1, 40), eos_token_id=EOS if rng.random() < 0.5 else None,
                            stop_token_ids=(3,) if rng.random() < 0.2 else ())
    prompt = prompt[:cfg.max_model_len - 2]
    if rng.random() < w.checkpoint_fraction and len(family) < len(prompt) and len(family) >= cfg.hash_unit:
        marked = prompt[:len(family)] + [MARKER] + prompt[len(family):]
        parsed = parse_checkpoint_marker(marked, MARKER, cfg.hash_unit)
        return SequenceSpec(rid, parsed.token_ids, params, parsed.checkpoint_position)
    return SequenceSpec(rid, tuple(prompt), params)


def fake_result(rng: np.random.Generator, plan: BatchPlan, k: int) -> StepResult:
    """Random tokens (2% eos), a random number of accepted drafts per verify row, echoed as the rules say."""
    rows = plan.row_bucket
    sampled = rng.integers(3, VOCAB, (rows, 1 + k), dtype=np.int32)
    sampled[rng.random((rows, 1 + k)) < 0.02] = EOS
    accepted = np.where(plan.row_kind == RowKind.VERIFY, rng.integers(0, k + 1, rows), 0).astype(np.int32)
    echoed = np.arange(k) < accepted[:, None]
    sampled[:, :k] = np.where(echoed, plan.draft_token_ids, sampled[:, :k])
    return StepResult(sampled, accepted, rng.integers(3, VOCAB, (rows, k), dtype=np.int32))


def count_stalls(state: SchedulerState, plan: BatchPlan) -> list[str]:
    """Running prefills that got 0 tokens although the unused budget covered their whole remainder, or
    although no request admitted before them was scheduled (the progress bound, schedule.py)."""
    spare = state.config.max_num_batched_tokens - plan.num_tokens
    scheduled = set(plan.request_ids)
    stalls, older_scheduled = [], False
    for rid in state.running:
        row = state.row_of[rid]
        remainder = int(state.rows.prefill_end[row] - state.rows.num_computed[row])
        if not state.rows.prefill_done[row] and rid not in scheduled and (remainder <= spare or not older_scheduled):
            stalls.append(f"step {plan.step_id}: {rid!r} stalled at {state.rows.num_computed[row]}")
        older_scheduled |= rid in scheduled
    return stalls


class Run:
    """One seed: the state, the device, the pending arrivals and aborts, and the report. One step ahead
    (`ahead`), each step is updated on placeholders and resolved while the next one is in flight."""

    def __init__(self, cfg: SchedulerConfig, w: Workload, seed: int, ahead: bool = False) -> None:
        self.cfg, self.w, self.rng, self.ahead = cfg, w, random.Random(seed), ahead
        self.np_rng = np.random.default_rng(seed)
        self.state = init_state(cfg)
        self.log = EventLog(cfg)  # every transition goes through it, so a run can be replayed
        self.device = FakeDevice(cfg.num_state_slots, ring_rows(cfg.ring_size, cfg.num_spec_tokens))
        self.families = [_tokens(self.rng, self.rng.randrange(1, 3 * cfg.mamba_block_size)) for _ in range(3)]
        self.aborts: dict[int, list[str]] = {}
        self.report = Report()
        self.next_id = 0
        self.pending: StepOutputs | None = None  # one step ahead: the last update's outputs, on placeholders
        self.last_result: StepResult | None = None  # what the device returned for the last step it ran

    def has_work(self) -> bool:
        return self.state.has_work() or self.pending is not None

    def arrive(self, step: int) -> None:
        # keep the offered load near what the budget can serve (~600 tokens per request), so small
        # budgets are exercised without an ever-growing queue
        rate = min(self.w.arrival_rate, self.cfg.max_num_batched_tokens / 600)
        while self.rng.random() < rate:
            request = make_request(self.rng, self.cfg, self.w, self.families, f"r{self.next_id}")
            self.next_id += 1
            self.state = self.log.add_request(self.state, request)
            self.report.total += 1
            if self.rng.random() < self.w.abort_fraction:
                self.aborts.setdefault(step + self.rng.randrange(0, 40), []).append(request.request_id)

    def abort_due(self, step: int) -> None:
        for rid in self.aborts.pop(step, []):
            if rid in self.state.requests and rid not in self.state.aborting:  # not ended or aborted already
                self.state = self.log.abort_request(self.state, rid)
                self.report.ended += 1
                self.device.forget(rid)

    def step(self, step: int) -> None:
        self.abort_due(step)
        plan = self._schedule() if self.state.has_work() else None
        if self.pending is not None:  # the last step's tokens arrive while this one is in flight
            self._abort_in_flight(step)
            outputs, self.pending = self.pending, None
            self._record(step, *self._transition("resolve", self.log.resolve, outputs, self.last_result))
        if plan is None:
            return
        on_device = device_plan(plan, self.last_result)
        self.device.run(self.state, on_device)
        self._abort_in_flight(step)
        self.last_result = fake_result(self.np_rng, on_device, self.cfg.num_spec_tokens)
        if self.ahead:
            self.pending = self._transition("update", self.log.update, plan,
                                            placeholder_result(plan, self.cfg.num_spec_tokens))[0]
        else:
            self._record(step, *self._transition("update", self.log.update, plan, self.last_result))

    def _schedule(self) -> BatchPlan:
        running = set(self.state.running)
        self.state, plan = self.log.schedule(self.state)
        self.report.preemptions += len(running & set(self.state.waiting))
        self._check("schedule")
        self.report.stalls += self._note(count_stalls(self.state, plan))
        return plan

    def _abort_in_flight(self, step: int) -> None:
        if self.rng.random() < 0.3:
            self.abort_due(step + 1)  # some aborts land while a step is in flight

    def _transition(self, name: str, transition, *args) -> tuple[StepOutputs, dict[str, list[int]]]:
        """Run `update` or `resolve`; returns its outputs and, for follow-up turns, each request's committed
        tokens before it (less a placeholder: the step's new tokens replace it)."""
        history = {rid: [t for t in self.state.token_ids(rid) if t >= 0] for rid in args[0].request_ids
                   if rid in self.state.requests}
        self.state, outputs = transition(self.state, *args)
        self._check(name)
        return outputs, history

    def _record(self, step: int, outputs: StepOutputs, history: dict[str, list[int]]) -> None:
        for out in outputs:
            if out.finished:
                self.report.ended += 1
                self.device.forget(out.request_id)
                if out.request_id in history:
                    self._maybe_follow_up(step, history[out.request_id] + list(out.new_token_ids))

    def _maybe_follow_up(self, step: int, turn: list[int]) -> None:
        """Multi-turn chat: prompt = the whole previous turn (prompt + output) + a new message, so
        decode-time materialized states get hit."""
        if step >= self.w.steps or self.rng.random() >= self.w.follow_up_rate:
            return
        message = _tokens(self.rng, self.rng.randrange(1, 20))
        prompt = (turn + message)[:self.cfg.max_model_len - 2]
        request = SequenceSpec(f"r{self.next_id}", tuple(prompt), StopParams(max_tokens=self.rng.randrange(1, 40)))
        self.next_id += 1
        self.state = self.log.add_request(self.state, request)
        self.report.total += 1

    def _check(self, where: str) -> None:
        self.report.leaks += self._note([f"after {where}: {e}" for e in check_invariants(self.state)])

    def _note(self, messages: list[str]) -> int:
        self.report.messages += messages[:3]
        return len(messages)

    def finish(self) -> Report:
        self.report.i1_violations = self._note(self.device.errors)
        self.report.hits_checked = self.device.hits_checked
        if not self.has_work():
            self.report.leaks += self._note(check_drained(self.state))
        return self.report


def run_seed(cfg: SchedulerConfig, w: Workload, seed: int, logs: list[EventLog] | None = None,
             ahead: bool = False) -> Report:
    """Simulate one seed (one step ahead if `ahead`); its event log is appended to `logs` if given."""
    run = Run(cfg, w, seed, ahead)
    step = 0
    while step < w.steps or (run.has_work() and step < w.steps + DRAIN_LIMIT):
        if step < w.steps:
            run.arrive(step)
        run.step(step)
        step += 1
    run.report.steps = step
    if logs is not None:
        logs.append(run.log)
    return run.finish()
