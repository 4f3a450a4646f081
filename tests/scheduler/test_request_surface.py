"""What the engine asks of the scheduler beyond scheduling: per-row sampling records, prompt logits under a
bounded logits budget, and score-only requests (max_tokens = 0)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import FinishReason, SequenceSpec, StopParams, add_request, init_state
from scheduler.sim.invariants import check_drained
from tests.scheduler.helpers import Driver, make_config, request


def _logit_positions(plan) -> dict[str, list[int]]:
    """request id -> absolute positions whose logits the plan asks for, checked against the flat indices."""
    out = {}
    for r, rid in enumerate(plan.request_ids):
        lo, hi = int(plan.cu_logits[r]), int(plan.cu_logits[r + 1])
        assert hi - lo == plan.num_logits[r]
        tokens = plan.logits_indices[lo:hi]
        assert (tokens >= plan.cu_seqlens[r]).all() and (tokens < plan.cu_seqlens[r + 1]).all()
        out[rid] = plan.positions[tokens].tolist()
    assert plan.cu_logits[-1] <= plan.logits_bucket and not plan.logits_indices[plan.cu_logits[-1]:].any()
    return out


@settings(max_examples=25, deadline=None)
@given(prompt=st.integers(2, 90), start=st.data(), max_logits=st.sampled_from([4, 8, 64]), k=st.sampled_from([0, 2]))
def test_prompt_logits_cover_each_position_once_within_the_logits_budget(prompt, start, max_logits, k):
    logits_from = start.draw(st.integers(0, prompt - 1))
    driver = Driver(make_config(num_spec_tokens=k, max_num_logits=max(max_logits, 1 + k), max_num_batched_tokens=64))
    driver.add(SequenceSpec("p", tuple(range(1, prompt + 1)), StopParams(max_tokens=3), logits_from=logits_from))
    driver.add(request("other", range(200, 230), max_tokens=6))
    seen = []
    for _ in range(200):
        if not driver.state.has_work():
            break
        plan = driver.step(accepted=k)
        assert plan.cu_logits[plan.num_rows] <= driver.cfg.max_num_logits
        positions = _logit_positions(plan)
        in_prefill = [r for r, rid in enumerate(plan.request_ids) if rid == "p" and plan.row_kind[r] == 1]
        if in_prefill:
            seen += positions["p"]
    assert seen == list(range(logits_from, prompt))  # the sampling position is the last of them
    assert check_drained(driver.state) == []


def test_a_prefix_hit_stops_at_the_first_position_asking_for_a_logit():
    driver = Driver(make_config(mamba_block_size=16, max_num_batched_tokens=16))
    tokens = list(range(1, 70))
    driver.add(request("a", tokens))
    driver.drain("a caches states at 16, 32, 48 and 64, one chunk at a time")
    for rid, logits_from, hit in (("b", 40, 32), ("c", None, 64)):
        driver.add(SequenceSpec(rid, tuple(tokens), StopParams(max_tokens=1), logits_from=logits_from))
        plan = driver.step()
        assert plan.request_ids == (rid,) and plan.context_lens[0] == hit
        driver.drain(rid)


def test_row_data_rides_with_each_row_and_padding_is_zero():
    driver = Driver(make_config(row_data_bytes=8))
    records = {f"r{i}": np.array([i + 0.5, -i], np.float32).tobytes() for i in range(3)}
    for rid, data in records.items():
        driver.add(SequenceSpec(rid, (1, 2, 3, 4 + len(rid)), StopParams(max_tokens=3), row_data=data))
    for _ in range(3):
        plan = driver.step()
        assert plan.row_data.shape == (plan.row_bucket, 8)
        for r, rid in enumerate(plan.request_ids):
            assert plan.row_data[r].tobytes() == records[rid]
        assert not plan.row_data[plan.num_rows:].any()


def test_max_tokens_zero_scores_the_prompt_and_ends_with_its_prefill():
    driver = Driver(make_config(num_spec_tokens=2))
    driver.add(SequenceSpec("s", tuple(range(1, 40)), StopParams(max_tokens=0), logits_from=0))
    positions = []
    for _ in range(10):
        if driver.state.has_work():
            positions += _logit_positions(driver.step())["s"]
    assert positions == list(range(39))
    (out,) = driver.outputs
    assert out.new_token_ids == () and out.finish_reason is FinishReason.LENGTH
    assert not driver.state.has_work() and check_drained(driver.state) == []


@pytest.mark.parametrize("bad, message", [
    (SequenceSpec("f", (1, 2, 3), logits_from=3), "logits_from"),
    (SequenceSpec("g", (1, 2, 3), logits_from=1.0), "logits_from"),
    (SequenceSpec("c", tuple(range(40)), checkpoint_position=32, logits_from=20), "past logits_from"),
    (SequenceSpec("d", (1, 2, 3), row_data=b"\0" * 3), "row_data"),
])
def test_bad_surface_fields_name_the_field(bad, message):
    state = init_state(make_config(row_data_bytes=4))
    with pytest.raises(ValueError, match=message):
        add_request(state, bad)
    add_request(state, SequenceSpec("ok", (1, 2), row_data=b"\0" * 4))
