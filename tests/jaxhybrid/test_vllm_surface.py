"""What a vLLM user of `LLM` relies on, on the embedded model: logprob ranks in the whole vocabulary,
64-bit seeds, a prompt's cache_salt, stop tokens' text, eos ids from generation_config.json (and
ignore_eos over all of them), stop_reason, token-id checks, dtype="auto" and the checkpoint's sampling
defaults."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid import LLM, SamplingParams
from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR
from tests.tolerances import float32_atol, model_depth

PROMPT = "def read_config(path):\n"
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, num_blocks=96, num_state_slots=24,
             mamba_block_size=16, token_buckets=(64,), row_buckets=(4,))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


def _checkpoint(tmp_path, config: dict | None = None, generation: dict | None = None):
    """The embedded checkpoint with its config.json / generation_config.json fields overridden."""
    directory = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, directory)
    for name, changes in (("config.json", config), ("generation_config.json", generation)):
        path = directory / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **(changes or {})}))
    return directory


def test_logprob_ranks_count_the_whole_vocabulary(llm):
    """vLLM's rank: the tokens at least as likely as the one reported (1 = the most likely)."""
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=0), use_tqdm=False)[0]
    assert [list(p) for p in greedy.outputs[0].logprobs] == [[t] for t in greedy.outputs[0].token_ids]
    assert all(p[t].rank == 1 for p, t in zip(greedy.outputs[0].logprobs, greedy.outputs[0].token_ids, strict=True))

    scored = llm.generate(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=2), use_tqdm=False)[0]
    ids = scored.prompt_token_ids
    logits = np.asarray(llm.model(np.array([ids])))[0]
    reference = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    atol = float32_atol(model_depth(llm.model.config, len(ids)), float(np.abs(logits).max()))
    outside_top = 0
    for p in range(1, len(ids)):
        value = reference[p - 1, ids[p]]
        rank = scored.prompt_logprobs[p][ids[p]].rank
        assert (reference[p - 1] > value + 2 * atol).sum() + 1 <= rank <= (reference[p - 1] >= value - 2 * atol).sum()
        outside_top += rank > 20
    assert outside_top  # some prompt tokens rank beyond the reported top-20: the old cap of 21 is gone


def test_seeds_keep_all_64_bits(llm):
    params = lambda seed: SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed)
    tokens = [llm.generate(PROMPT, params(seed), use_tqdm=False)[0].outputs[0].token_ids
              for seed in (7, 7 + 2**32, 7, -1)]
    assert tokens[0] == tokens[2] and tokens[0] != tokens[1]
    assert len(tokens[3]) == 8  # vLLM takes any int64 seed, -1 included
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        SamplingParams(seed=2**64)


def test_a_prompt_dicts_cache_salt_is_honoured_and_unknown_keys_refused(llm):
    prompt = PROMPT * 12  # longer than one 64-token chunk: a state is cached where that chunk ends
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.reset_prefix_cache()
    first = llm.generate({"prompt": prompt, "cache_salt": "a"}, params, use_tqdm=False)[0]
    other = llm.generate({"prompt": prompt, "cache_salt": "b"}, params, use_tqdm=False)[0]
    same = llm.generate({"prompt": prompt, "cache_salt": "a"}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0 and same.num_cached_tokens >= 16
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": prompt, "multi_modal_data": {}}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_token_ends_the_text_before_it(llm):
    free = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_token = free.token_ids[3]
    cut = dataclasses.replace(GREEDY, stop_token_ids=(stop_token,))
    stopped = llm.generate(PROMPT, cut, use_tqdm=False)[0].outputs[0]
    end = free.token_ids.index(stop_token) + 1
    assert stopped.token_ids == free.token_ids[:end] and stopped.stop_reason == stop_token
    assert stopped.text == llm.tokenizer.decode(free.token_ids[:end - 1])
    kept = dataclasses.replace(cut, include_stop_str_in_output=True)
    assert llm.generate(PROMPT, kept, use_tqdm=False)[0].outputs[0].text == llm.tokenizer.decode(
        free.token_ids[:end])


def test_generation_config_eos_ids_stop_unless_eos_is_ignored(llm, tmp_path):
    free = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    extra_eos = free.token_ids[2]
    eos_llm = LLM(_checkpoint(tmp_path, generation={"eos_token_id": [0, extra_eos]}), **SMALL)
    end = free.token_ids.index(extra_eos) + 1
    stops = eos_llm.generate(PROMPT, dataclasses.replace(GREEDY, ignore_eos=False), use_tqdm=False)[0].outputs[0]
    assert stops.token_ids == free.token_ids[:end] and stops.finish_reason == "stop"
    assert stops.stop_reason == extra_eos  # vLLM: generation_config's other eos ids are stop token ids
    ignored = eos_llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
    # an eos id that is also a stop token id stops under ignore_eos, and names itself
    asked = eos_llm.generate(PROMPT, dataclasses.replace(GREEDY, stop_token_ids=(extra_eos,)), use_tqdm=False)[0]
    assert asked.outputs[0].token_ids == free.token_ids[:end] and asked.outputs[0].stop_reason == extra_eos


def test_token_ids_are_checked_before_the_marker_is_looked_for(llm):
    marker = llm.tokenizer.token_id(CHECKPOINT_MARKER)
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
        llm.generate([5, 6, 7, float(marker), 8, 9], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="got True"):
        llm.generate({"prompt_token_ids": [1, True, 3]}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_dtype_auto_is_the_checkpoints(llm, tmp_path):
    assert llm.model.dtype == jnp.float32  # the embedded checkpoint is float32; "auto" is the default
    assert LLM(_checkpoint(tmp_path, config={"dtype": "bfloat16"}), **SMALL).model.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LLM(dtype="float64", **SMALL)


def test_the_checkpoints_sampling_defaults_give_text_that_does_not_loop(llm):
    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == 1.2  # the embedded model's generation_config.json
    greedy = dataclasses.replace(defaults, temperature=0, max_tokens=32)
    for prompt in (PROMPT, "import os\n"):
        tokens = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
        plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
        assert len(set(tokens)) >= len(tokens) // 2 > len(set(plain.token_ids)), (tokens, plain.token_ids)


def test_chat_takes_vllms_template_options(llm):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def read"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    carried = llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True,
                       use_tqdm=False)[0]
    assert llm.tokenizer.decode(carried.prompt_token_ids, skip_special_tokens=False).endswith("def read")
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    own = llm.chat(messages[:1], params, chat_template=template, chat_template_kwargs={"greeting": "Dear"},
                   use_tqdm=False)[0]
    assert own.prompt == "Dear hi\n"
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(messages, params, continue_final_message=True, use_tqdm=False)


def test_vllm_names_for_the_engine_and_the_prefix_cache(llm):
    engine = llm.llm_engine
    engine.add_request("held", llm.parse_prompt(PROMPT), GREEDY)
    assert llm.reset_prefix_cache() is False  # a request runs: nothing is forgotten
    engine.abort_request(["held"])  # vLLM's LLMEngine.abort_request
    assert engine.abort("held") is None  # gone already
    for _ in range(4):  # bounded: a step in flight finishes the abort
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert llm.reset_prefix_cache() is True
