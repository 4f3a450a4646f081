"""The MTP head inside the step: every draft the engine proposes is the MTP head's argmax over the
sequence so far (its KV carried across prefill chunks and verify steps), and asking MTP of a checkpoint
without MTP weights is a clear error."""

import dataclasses

import numpy as np
import pytest

import scheduler
from jaxhybrid.sample.sampler import pack_row
from jaxhybrid.worker.runner import Runner
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_each_first_draft_is_the_mtp_heads_argmax(family):
    """After a step, a running row's first draft predicts the token after the one it just emitted: the MTP
    head at the position before that token, reading it (`Model.mtp_logits` over the whole sequence)."""
    model = fixture_model(family)
    runner = engine_for(model, k=2, ring_size=4, budget=16).runner
    state = scheduler.init_state(runner.config)
    sequences = {f"p{n}": [int(t) for t in np.random.default_rng(n).integers(0, 256, n)] for n in (9, 37, 50)}
    for rid, prompt in sequences.items():
        request = scheduler.SequenceSpec(rid, tuple(prompt), scheduler.StopParams(max_tokens=8), row_data=pack_row())
        state = scheduler.add_request(state, request)
    checked = 0
    for _ in range(100):
        if not state.has_work():
            break
        state, plan = scheduler.schedule(state)
        result, _ = runner.step(plan)
        state, outputs = scheduler.update(state, plan, result)
        for output in outputs:
            sequence = sequences[output.request_id]
            sequence += output.new_token_ids
            if not output.finished:
                draft = result.draft_token_ids[plan.request_ids.index(output.request_id), 0]
                mtp = np.asarray(model.mtp_logits(np.array([sequence])))[0, len(sequence) - 2]
                assert draft == np.argmax(mtp), (output.request_id, len(sequence))
                checked += 1
    assert not state.has_work() and checked >= 12


def test_mtp_without_mtp_layers_is_an_error():
    model = fixture_model("nemotron_h")
    with pytest.raises(ValueError, match="no MTP layers"):
        model.mtp_logits(np.zeros((1, 4), np.int32))
    config = dataclasses.replace(engine_for(model).config, num_spec_tokens=1, num_lookahead=1, block_table_buckets=())
    with pytest.raises(ValueError, match="needs MTP weights"):
        Runner(model, config)
