"""Sampling through the engine: penalties as vLLM defines them, seeds that give the same tokens whatever
else is in the batch, and MTP verification that samples exactly from the target distribution.
References are computed independently in numpy from the full forward."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.sample.params import SamplingParams
from tests.hf_fixtures import fixture_model
from tests.jaxhybrid.engine_helpers import default_model, default_tokenizer, engine_for, run_to_completion


def _penalized_greedy(model, prompt: tuple[int, ...], params: SamplingParams) -> list[int]:
    """vLLM's penalties in numpy: repetition over prompt and output tokens, presence and frequency over
    output tokens, then the argmax."""
    sequence = list(prompt)
    for _ in range(params.max_tokens):
        logits = np.asarray(model(np.array([sequence])), np.float64)[0, -1]
        output = sequence[len(prompt):]
        counts = np.bincount(output, minlength=logits.size)
        seen = (np.bincount(prompt, minlength=logits.size) > 0) | (counts > 0)
        rep = params.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        sequence.append(int(np.argmax(logits)))
    return sequence[len(prompt):]


@pytest.mark.parametrize("family, k", [("qwen3_next", 2), ("nemotron_h", 0)])
def test_penalties_follow_vllm(family, k):
    """Greedy with strong penalties: the engine's tokens equal the numpy reference, also for requests that
    start from a checkpoint (their history comes with the copied page) and with MTP verify rows."""
    model = fixture_model(family)
    engine = engine_for(model, k=k, ring_size=4, budget=64)
    rng = np.random.default_rng(3)
    anchor = tuple(int(t) for t in rng.integers(0, 256, 40))
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.2,
                             repetition_penalty=0.7)]
    prompts = [anchor + tuple(int(t) for t in rng.integers(0, 256, n)) for n in (5, 9, 14)]
    for wave in range(2):  # the second wave hits the first wave's checkpoint
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{wave}/{i}", Prompt(prompt, 32), p)
        outputs = run_to_completion(engine)
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            assert outputs[f"{wave}/{i}"].outputs[0].token_ids == _penalized_greedy(model, prompt, p), (wave, i)
    assert engine.stats.hit_copies >= 3


def test_a_seed_gives_the_same_tokens_in_any_batch():
    model = fixture_model("qwen3_next")
    engine = engine_for(model, k=2, ring_size=4, budget=64)
    prompt = Prompt(tuple(range(1, 30)))
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    engine.add_request("alone", prompt, sampled)
    alone = run_to_completion(engine)["alone"].outputs[0].token_ids
    for i in range(5):
        engine.add_request(f"other{i}", Prompt(tuple(range(2 + i, 40 + i))),
                           SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True))
    engine.add_request("mixed", prompt, sampled)
    engine.add_request("reseeded", prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99,
                                                          ignore_eos=True))
    outputs = run_to_completion(engine)
    assert outputs["mixed"].outputs[0].token_ids == alone
    assert outputs["reseeded"].outputs[0].token_ids != alone


def _exact_distribution(model, prompt: tuple[int, ...], top_k: int, length: int) -> dict[tuple[int, ...], float]:
    """P(next `length` tokens) under temperature 1 and top-k, from full forwards of every prefix."""
    probabilities = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in probabilities.items():
            logits = np.asarray(model(np.array([prompt + prefix])), np.float64)[0, -1]
            top = np.argsort(logits)[-top_k:]
            q = np.exp(logits[top] - logits[top].max())
            for token, qi in zip(top.tolist(), (q / q.sum()).tolist(), strict=True):
                grown[prefix + (token,)] = p * qi
        probabilities = grown
    return probabilities


@pytest.mark.parametrize("k", [0, 2])
def test_sampling_matches_the_exact_distribution_with_and_without_mtp(k):
    """Chi-square goodness of fit of 400 three-token samples (top-k 2: 8 outcomes) against the exact
    probabilities. With K = 2 the second and third tokens come from verification (accepted drafts or
    resampled residuals), so a lossy verifier would skew them. Fixed seeds: the test is deterministic;
    the threshold (p < 1e-3) is what a correct sampler fails once in a thousand seeds."""
    model = default_model()  # its trained MTP head drafts tokens the target often accepts
    engine = engine_for(model, k=k, ring_size=4, budget=256, max_num_seqs=64, num_blocks=400)
    prompt = tuple(default_tokenizer().encode("import os\n\n\ndef read_config(path):\n    with open("))
    exact = _exact_distribution(model, prompt, top_k=2, length=3)
    engine.add_request("r", Prompt(prompt), SamplingParams(n=400, temperature=1.0, top_k=2, max_tokens=3, seed=7,
                                                           ignore_eos=True))
    outputs = run_to_completion(engine, max_steps=2000)["r"].outputs
    counts = collections.Counter(tuple(o.token_ids) for o in outputs)
    assert set(counts) <= set(exact)
    observed = np.array([counts[outcome] for outcome in exact])
    expected = np.array(list(exact.values())) * len(outputs)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(jax.scipy.stats.chi2.sf(statistic, len(exact) - 1))
    assert p_value > 1e-3, (statistic, dict(zip(exact, observed.tolist(), strict=True)), expected)
    if k:
        assert engine.stats.accepted_tokens > 0  # verification did accept drafts along the way


def test_distinct_seeds_cover_the_outcomes():
    """The n completions of one request use seeds seed + i: they differ (not one sample repeated)."""
    model = fixture_model("nemotron_h")
    engine = engine_for(model, budget=64)
    engine.add_request("r", Prompt(tuple(range(3, 25))), SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=1,
                                                                      ignore_eos=True))
    outputs = run_to_completion(engine)["r"].outputs
    assert [o.index for o in outputs] == list(range(8))
    assert len({tuple(o.token_ids) for o in outputs}) > 4
