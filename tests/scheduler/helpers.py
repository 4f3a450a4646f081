"""Shared drivers for the scheduler tests: configs, deterministic step results, one-request traces."""

from __future__ import annotations

import numpy as np

from scheduler import (
    RowKind,
    SchedulerConfig,
    SequenceSpec,
    StepResult,
    StopParams,
    add_request,
    init_state,
    schedule,
    update,
)
from scheduler.plan import BatchPlan
from scheduler.replay import ring_rows
from scheduler.sim.fake_device import FakeDevice


def make_config(**overrides) -> SchedulerConfig:
    base = dict(block_size=16, mamba_block_size=16, max_num_batched_tokens=512, max_num_seqs=8,
                max_model_len=4096, num_blocks=1024, num_state_slots=32, num_spec_tokens=0)
    base.update(overrides)
    return SchedulerConfig(**base)


def request(rid: str, tokens, max_tokens: int = 1, checkpoint: int | None = None, **params) -> SequenceSpec:
    return SequenceSpec(rid, tuple(tokens), StopParams(max_tokens=max_tokens, **params), checkpoint)


def result_for(plan: BatchPlan, k: int, accepted: int = 0, token: int = 7) -> StepResult:
    """Every row samples `token`; verify rows accept `accepted` drafts (echoing them)."""
    rows = plan.row_bucket
    sampled = np.full((rows, 1 + k), token, np.int32)
    num_accepted = np.where(plan.row_kind == RowKind.VERIFY, accepted, 0).astype(np.int32)
    sampled[:, :k] = np.where(np.arange(k) < num_accepted[:, None], plan.draft_token_ids, sampled[:, :k])
    return StepResult(sampled, num_accepted, np.full((rows, k), token + 1, np.int32))


class Driver:
    """Runs schedule/update with a fake device that checks every state read (I1 included)."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg, self.state = cfg, init_state(cfg)
        self.device = FakeDevice(cfg.num_state_slots, ring_rows(cfg.ring_size, cfg.num_spec_tokens))
        self.outputs: list = []

    def add(self, req: SequenceSpec) -> None:
        self.state = add_request(self.state, req)

    def step(self, accepted: int = 0) -> BatchPlan:
        self.state, plan = schedule(self.state)
        self.device.run(self.state, plan)
        self.state, outs = update(self.state, plan, result_for(plan, self.cfg.num_spec_tokens, accepted))
        self.outputs += outs
        assert not self.device.errors, self.device.errors
        return plan

    def drain(self, workload: str, accepted: int = 0, max_steps: int = 300) -> None:
        """Step until no request has work left; a livelock fails after `max_steps` naming the workload."""
        self.run_until(lambda _: not self.state.has_work(), workload, accepted, max_steps)

    def run_until(self, done, workload: str, accepted: int = 0, max_steps: int = 300) -> BatchPlan | None:
        """Step until `done(last plan or None)`; returns that plan; fails after `max_steps` steps."""
        plan = None
        for _ in range(max_steps):
            if done(plan):
                return plan
            plan = self.step(accepted)
        raise AssertionError(f"{workload}: not done after {max_steps} steps (livelock?); waiting "
                             f"{list(self.state.waiting)}, running {list(self.state.row_of)}")

    def chunks(self, plan: BatchPlan) -> dict[str, tuple[int, int]]:
        """request id -> (context_len, context_len + query_len) of each row of `plan`."""
        return {rid: (int(plan.context_lens[r]), int(plan.context_lens[r] + plan.query_lens[r]))
                for r, rid in enumerate(plan.request_ids)}


def trace_ends(cfg: SchedulerConfig, prompt_len: int, max_steps: int = 200) -> list[int]:
    """Chunk ends of one request of `prompt_len` tokens until its prefill completes."""
    driver = Driver(cfg)
    driver.add(request("r", range(3, prompt_len + 3)))
    ends: list[int] = []
    for _ in range(max_steps):
        plan = driver.step()
        ends += [end for _, end in driver.chunks(plan).values()]
        if not driver.state.has_work():
            return ends
    raise AssertionError(f"prefill of {prompt_len} did not finish; ends so far {ends}")
