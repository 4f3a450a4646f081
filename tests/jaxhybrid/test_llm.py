"""`LLM` on the embedded default model: text, chat and token prompts with markers, MTP on, stop strings,
prompt logprobs with a checkpoint, candidate scoring from one, and the errors a user sees."""

from __future__ import annotations

import numpy as np
import pytest

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER
from jaxhybrid.models.pools import RecurrentPool, has_snapshots, layer_pools
from scheduler import CheckpointMarkerError
from tests.hf_fixtures import HF_FIXTURES
from tests.jaxhybrid.engine_helpers import ANCHOR, CANDIDATES, greedy_continuation
from tests.tolerances import assert_close, float32_atol, model_depth

SCORED_ANCHOR = ("class Config:\n    \"\"\"Settings read from the environment.\"\"\"\n\n"
                 "    def __init__(self, env):\n        self.env = env\n\n    def get(self, key):\n")
LOGPROB_ANCHOR = ("def parse(line):\n    \"\"\"Split a comma separated line into its fields.\"\"\"\n"
                  "    fields = line.split(\",\")\n    return [field.strip() for field in fields]\n\n\n")


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 3}, num_blocks=256,
               num_state_slots=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
               mamba_block_size=16, token_buckets=(64,), row_buckets=(8,))


def test_greedy_text_prompts_with_and_without_markers_equal_the_full_forward(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [ANCHOR + CHECKPOINT_MARKER + c for c in CANDIDATES] + [ANCHOR + c for c in CANDIDATES]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    marker = tokenizer.token_id(CHECKPOINT_MARKER)
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = [t for t in tokenizer.encode(prompt) if t != marker]  # the marker token, stripped
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == greedy_continuation(llm.model, tuple(ids), 12)
        assert output.outputs[0].text == tokenizer.decode(output.outputs[0].token_ids)
    assert outputs[1].num_cached_tokens > 0  # a consumer starts from the anchor's checkpoint
    assert llm.engine.stats.accepted_tokens > llm.engine.stats.draft_tokens / 3  # the trained MTP head drafts well


def test_the_snapshot_baseline_generates_what_replayssm_generates(llm):
    """replayssm_window = 0: verify keeps the whole state after every position instead of a replay ring."""
    snapshots = LLM(replayssm_window=0, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                    num_blocks=256, num_state_slots=48, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                    mamba_block_size=16, token_buckets=(64,), row_buckets=(8,))
    pool = next(pool for pool in layer_pools(snapshots.engine.runner.state) if isinstance(pool, RecurrentPool))
    assert has_snapshots(pool.rings) and pool.rings[0].shape[2] == 1 + 3  # one whole state per verify position
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [ANCHOR + CHECKPOINT_MARKER + c for c in CANDIDATES[:2]] + [ANCHOR + c for c in CANDIDATES[2:]]
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert [out.outputs[0].token_ids for out in snapshots.generate(prompts, params, use_tqdm=False)] == expected
    assert snapshots.engine.stats.accepted_tokens > 0


def test_stop_strings_cut_the_text(llm):
    prompt = ANCHOR + CANDIDATES[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop and text.index(stop) > 0
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert full.outputs[0].token_ids[:len(kept.token_ids)] == kept.token_ids


def test_chat_uses_the_checkpoints_template(llm):
    messages = [{"role": "user", "content": "Write a function that reads a file."}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    assert output.prompt_token_ids == tokenizer.encode(tokenizer.apply_chat_template(messages))


def _assert_prompt_logprobs_equal(marked, plain, depth: int) -> None:
    """Every prompt position but the first (which has no context) carries the same logprobs with the marker
    as without it: the marker is no token of the model's input, so it has no position of its own."""
    assert marked.prompt_token_ids == plain.prompt_token_ids
    ids = plain.prompt_token_ids
    assert marked.prompt_logprobs[0] is None and plain.prompt_logprobs[0] is None
    assert len(marked.prompt_logprobs) == len(ids) and all(p is not None for p in marked.prompt_logprobs[1:])
    got = [marked.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    want = [plain.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert_close(np.array(got), np.array(want), min(1e-4, float32_atol(depth, max(map(abs, want)))))


def test_prompt_logprobs_with_a_checkpoint_cover_every_prompt_position(llm):
    """A marked prompt reports prompt logprobs at every position, equal to the unmarked prompt's: next to the
    request that produces its checkpoint, and once that checkpoint is cached (a request starting from it
    would have no logits for the positions before it)."""
    tokenizer = llm.get_tokenizer()
    anchor, marker = tokenizer.encode(LOGPROB_ANCHOR), tokenizer.token_id(CHECKPOINT_MARKER)  # not cached yet
    candidates = [tokenizer.encode(c) for c in CANDIDATES]
    assert len(anchor) >= 32  # the checkpoint lies past the first hash units
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    producer = SamplingParams(max_tokens=1, temperature=0)
    marked = llm.generate([anchor + [marker] + c for c in candidates[:2]], [producer, params], use_tqdm=False)[1:]
    cached = llm.generate(anchor + [marker] + candidates[0], producer, use_tqdm=False)[0]
    assert cached.num_cached_tokens >= len(anchor) // 16 * 16  # the checkpoint is cached now
    marked += llm.generate([anchor + [marker] + c for c in candidates[2:]], params, use_tqdm=False)
    plain = llm.generate([anchor + c for c in candidates[1:]], params, use_tqdm=False)
    depth = model_depth(llm.model.config, max(len(o.prompt_token_ids) for o in plain))
    for with_marker, without in zip(marked, plain, strict=True):
        _assert_prompt_logprobs_equal(with_marker, without, depth)
        assert with_marker.outputs[0].token_ids == without.outputs[0].token_ids


def test_score_candidates_computes_the_anchor_once(llm):
    """1 anchor x N candidates: the candidates' logprobs equal prompt logprobs without any checkpoint, while
    the anchor's tokens are computed once (the other candidates start at its checkpoint)."""
    tokenizer = llm.get_tokenizer()
    anchor = tokenizer.encode(SCORED_ANCHOR)  # not cached yet
    candidates = [tokenizer.encode(c) for c in CANDIDATES]
    before = llm.engine.stats.prefill_tokens
    scores = llm.score_candidates(anchor, candidates)
    computed = llm.engine.stats.prefill_tokens - before
    plain = llm.generate([anchor + c for c in candidates], SamplingParams(max_tokens=0, prompt_logprobs=0),
                         use_tqdm=False)
    c = (len(anchor) - 1) // 16 * 16  # the checkpoint: before the anchor's last token, on the hash unit
    lengths = [len(o.prompt_token_ids) for o in plain]
    assert c >= 32 and computed == c + sum(n - c for n in lengths)
    depth = model_depth(llm.model.config, max(lengths))
    for score, without in zip(scores.candidates, plain, strict=True):
        ids = without.prompt_token_ids
        want = [without.prompt_logprobs[p][ids[p]].logprob for p in range(len(anchor), len(ids))]
        assert_close(np.array(score.token_logprobs), np.array(want),
                     min(1e-4, float32_atol(depth, max(map(abs, want)))))


def test_llm_score_is_vllms_cross_encoder_scoring_and_not_supported(llm):
    with pytest.raises(NotImplementedError, match="score_candidates"):
        llm.score("a query", ["a document"])


def test_bad_prompts_raise_clear_errors(llm):
    with pytest.raises(CheckpointMarkerError, match="exactly once"):
        llm.generate(ANCHOR + CHECKPOINT_MARKER + "x = 1\n" + CHECKPOINT_MARKER + "y = 2\n", use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("x = 1\n" * 300, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_model_len"):  # the good prompt before it is not left queued
        llm.generate(["x = 1\n", "x = 1\n" * 300], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("x = 1\n", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_mtp_on_a_checkpoint_without_mtp_weights_is_a_clear_error():
    with pytest.raises(ValueError, match="no MTP weights"):
        LLM(HF_FIXTURES / "nemotron_h", skip_tokenizer_init=True, num_blocks=64, num_state_slots=16,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="only"):
        LLM(HF_FIXTURES / "qwen3_next", skip_tokenizer_init=True, num_blocks=64, num_state_slots=16,
            speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_token_prompts_without_a_tokenizer():
    llm = LLM(HF_FIXTURES / "nemotron_h", skip_tokenizer_init=True, num_blocks=64, num_state_slots=16,
              max_num_batched_tokens=64, token_buckets=(64,), row_buckets=(4,), max_num_seqs=4, max_model_len=128)
    prompt = list(range(5, 45))
    outputs = llm.generate([prompt, {"prompt_token_ids": prompt, "checkpoint_position": 32}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    expected = greedy_continuation(llm.model, tuple(prompt), 6)
    assert [o.outputs[0].token_ids for o in outputs] == [expected, expected]
    assert outputs[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("text", use_tqdm=False)
