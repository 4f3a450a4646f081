"""The progress bound for running prefills (schedule.py, "Progress bound"): the starvation cases that motivated it, and
the bound's step property over random accepted configs and workloads."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import SchedulerConfig, SequenceSpec, StopParams, add_request, init_state, schedule, update
from tests.scheduler.helpers import Driver, result_for


def _starvation_case(logits: bool) -> list[tuple[int, int]]:
    """P (64 tokens) is admitted first; then short turns that decode next step arrive, 20 at once and 2 every
    step, enough decode rows to fill the budget (or, with prompt logprobs, the logits budget) without P.
    Returns P's prefill chunks, one per step, for the steps until P's prefill ends (or 30 steps)."""
    cfg = SchedulerConfig(block_size=16, mamba_block_size=16, max_num_seqs=48, num_spec_tokens=1,
                          max_num_batched_tokens=256 if logits else 20, max_num_logits=20)
    driver = Driver(cfg)
    driver.add(SequenceSpec("P", tuple(range(100, 164)), StopParams(4), logits_from=0 if logits else None))
    arrivals = itertools.count()

    def arrive(count: int) -> None:
        for i in itertools.islice(arrivals, count):
            driver.add(SequenceSpec(f"t{i}", tuple(range(3, 12)) if logits else (5 + i % 50,), StopParams(16)))
    arrive(20)
    chunks = []
    for _ in range(30):
        arrive(2)
        plan = driver.step(accepted=1)
        chunks.append(driver.chunks(plan).get("P"))
        if driver.state.rows.prefill_done[driver.state.row_of["P"]]:
            break
    return chunks


def test_short_turns_that_fill_the_budget_do_not_starve_an_older_prefill():
    assert _starvation_case(logits=False) == [(0, 16), (16, 32), (32, 48), (48, 64)]


def test_short_turns_that_fill_the_logits_budget_do_not_starve_an_older_prompt_logprobs_prefill():
    assert _starvation_case(logits=True) == [(0, 16), (16, 32), (32, 48), (48, 64)]


@st.composite
def configs(draw) -> SchedulerConfig:
    """Any config the scheduler accepts, in small sizes, with memory for every request (no preemption)."""
    k = draw(st.integers(0, 3))
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    budget = draw(st.integers(1 + k, 72))
    max_num_seqs, max_model_len = draw(st.integers(1, 10)), 160
    return SchedulerConfig(
        block_size=block_size, mamba_block_size=block_size * draw(st.sampled_from([1, 2, 4])),
        max_num_batched_tokens=budget, max_num_logits=draw(st.none() | st.integers(1 + k, budget)),
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_spec_tokens=k,
        num_lookahead=draw(st.none() | st.integers(0, 5)), eagle_block_drop=draw(st.none() | st.booleans()),
        cache_mode=draw(st.sampled_from(["align", "none"])), ring_size=draw(st.sampled_from([0, 16])),
        num_blocks=max_num_seqs * -(-(max_model_len + k) // block_size) + 1, num_state_slots=4 * max_num_seqs + 4)


def _older_work(state, rid: str) -> int:
    """W(P): what the running requests admitted before `rid` still have to compute, at most."""
    rows = [state.row_of[older] for older in state.running[:state.running.index(rid)]]
    return int(np.maximum(state.rows.max_len[rows] - state.rows.num_computed[rows], 0).sum())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_a_running_prefill_is_scheduled_or_older_work_shrinks_in_every_step(cfg, data):
    """The bound's step property: in every step, each running prefill P is scheduled, or W(P) (the work left to
    the requests admitted before it, which admission never adds to) shrinks; so P waits at most W(P) steps."""
    state, next_id = init_state(cfg), 0
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    for _ in range(40):
        for _ in range(data.draw(st.integers(0, 3))):
            prompt = int(rng.integers(1, 120))
            logits_from = int(rng.integers(0, prompt)) if rng.random() < 0.3 else None
            state = add_request(state, SequenceSpec(f"r{next_id}", tuple(rng.integers(3, 99, prompt).tolist()),
                                               StopParams(int(rng.integers(0, 12))), logits_from=logits_from))
            next_id += 1
        prefills = [rid for rid in state.running if not state.rows.prefill_done[state.row_of[rid]]]
        before = {rid: _older_work(state, rid) for rid in prefills}
        state, plan = schedule(state)
        scheduled = set(plan.request_ids)
        accepted = int(rng.integers(0, cfg.num_spec_tokens + 1))
        state, _ = update(state, plan, result_for(plan, cfg.num_spec_tokens, accepted, token=int(rng.integers(3, 99))))
        for rid, work in before.items():
            assert rid in scheduled or _older_work(state, rid) < work, (rid, work, plan.request_ids)
    assert state.num_preemptions == 0
