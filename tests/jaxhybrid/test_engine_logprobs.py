"""Logprobs through the engine equal the full forward's log-softmax (float32): prompt logprobs of a prefill
cut into chunks by the budget, and the logprobs of generated tokens on decode rows and MTP verify rows.
That checks every chunk, every carried state and every decode step against one full forward.

The two paths sum in different orders (chunked WY form against the token recurrence, other matmul
blockings), so they agree to float32 rounding as deep as `model_depth` over the sequence, scaled by the
logits' magnitude (log-softmax adds one logsumexp over the vocabulary).
"""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import HealthCheck, example, given, settings

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import engine_for, run_to_completion
from tests.tolerances import assert_close, float32_atol, model_depth

NEW_TOKENS = 6


@functools.cache
def _engine(family: str, budget: int, k: int):
    return engine_for(fixture_model(family), k=k, budget=budget)


def _check_position(position: dict, reference: np.ndarray, token: int, atol: float, what: str) -> None:
    assert token in position, what
    for token_id, logprob in position.items():
        assert_close(logprob.logprob, reference[token_id], atol, f"{what} token {token_id}")
    best = min(position.items(), key=lambda item: item[1].rank)
    assert best[1].rank == 1 and reference[best[0]] >= reference.max() - 2 * atol, what
    # vLLM's rank in the whole vocabulary: the tokens at least as likely, up to ties within the rounding
    value = reference[token]
    surely_above, maybe_above = int((reference > value + 2 * atol).sum()), int((reference >= value - 2 * atol).sum())
    assert surely_above + 1 <= position[token].rank <= maybe_above, (what, position[token].rank)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(family="qwen3_next", budget=16, k=2, length=75, seed=1)  # every family, chunked prefills, MTP verify rows
@example(family="nemotron_h", budget=64, k=0, length=120, seed=2)
@example(family="qwen3_5_text", budget=16, k=2, length=33, seed=3)
@given(family=st.sampled_from(["qwen3_next", "nemotron_h", "qwen3_5_text"]), budget=st.sampled_from([16, 64]),
       k=st.sampled_from([0, 2]), length=st.integers(2, 120), seed=st.integers(0, 2**16))
def test_prompt_and_token_logprobs_equal_the_full_forward(family, budget, k, length, seed):
    model = fixture_model(family)
    k = k if model.config.mtp_layers else 0
    engine = _engine(family, budget, k)
    prompt = tuple(int(t) for t in np.random.default_rng(seed).integers(0, model.config.vocab_size, length))
    rid = f"{seed}-{length}"
    engine.add_request(rid, Prompt(prompt), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                           logprobs=3, prompt_logprobs=2))
    output = run_to_completion(engine)[rid]
    generated = output.outputs[0].token_ids
    sequence = np.array([prompt + tuple(generated)])
    logits = np.asarray(model(sequence))[0]
    reference = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    atol = float32_atol(model_depth(model.config, sequence.shape[1]), float(np.abs(logits).max()))
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == length
    for p in range(1, length):
        _check_position(output.prompt_logprobs[p], reference[p - 1], prompt[p], atol, f"prompt position {p}")
    for i, token in enumerate(generated):
        assert token == int(np.argmax(logits[length - 1 + i]))
        _check_position(output.outputs[0].logprobs[i], reference[length - 1 + i], token, atol, f"output {i}")
    assert_close(output.outputs[0].cumulative_logprob,
                 sum(reference[length - 1 + i, t] for i, t in enumerate(generated)), NEW_TOKENS * atol)
