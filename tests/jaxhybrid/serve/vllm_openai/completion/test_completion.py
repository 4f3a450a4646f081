"""Port of vLLM's tests/entrypoints/openai/completion/test_completion.py: single, batched, parallel (n > 1)
and streamed completions, logprobs limits, prompt_logprobs, stream_options, echo with logprobs and structured
outputs that do not compile (400s), on the
module's server with --enable-prompt-tokens-details, as vLLM's (vLLM's opt-125m token counts become the
reference tokenizer's counts)."""

from __future__ import annotations

import re

import openai
import pytest
from openai import BadRequestError

from tests.jaxhybrid.serve.vllm_openai.chat_completion.test_chat_completion import (
    INVALID_JSON_SCHEMA,
    INVALID_SQL_GRAMMAR,
)
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer, decode


@pytest.fixture(scope="module")
def server(session_engine):
    process = InProcessServer(session_engine, SERVER_FLAGS, prompt_tokens_details=True)
    yield process
    process.stop()


def test_single_completion(client, tokenizer) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=5,
                                           temperature=0.0)

    assert completion.id is not None
    assert completion.choices is not None and len(completion.choices) == 1

    choice = completion.choices[0]
    assert len(choice.text) >= 5
    assert choice.finish_reason == "length"
    num_prompt_tokens = len(tokenizer.encode("Hello, my name is").ids)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == num_prompt_tokens
    assert completion.usage.total_tokens == num_prompt_tokens + 5
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0

    # test using token IDs
    completion = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 1
    assert completion.choices[0].prompt_logprobs is None


def test_completion_truncation_side_controls_prompt_truncation(client) -> None:
    # vLLM's list(range(8)); ids 0-3 here are special tokens, 3 the checkpoint marker (a 400 in a prompt)
    prompt_token_ids = list(range(100, 108))

    right_completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt_token_ids, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right_completion.choices[0].prompt_token_ids == prompt_token_ids[:4]

    left_completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt_token_ids, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert left_completion.choices[0].prompt_token_ids == prompt_token_ids[-4:]


def test_no_logprobs(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=None)
    assert completion.choices[0].logprobs is None


def test_zero_logprobs(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=0)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert len(choice.logprobs.top_logprobs[0]) == 1


def test_some_logprobs(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=5)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert 5 <= len(choice.logprobs.top_logprobs[0]) <= 6


def test_too_many_completion_logprobs(client) -> None:
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        # max_logprobs is 20 by default, as vLLM's
        client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                  logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=30, stream=True)
        for _ in stream:
            pass

    # the server should still work afterwards
    completion = client.completions.create(model=MODEL_NAME, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 0


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, prompt_logprobs: int | None):
    params: dict = {"prompt": ["A robot may not injure another robot", "My name is"], "model": MODEL_NAME}
    if prompt_logprobs is not None:
        params["extra_body"] = {"prompt_logprobs": prompt_logprobs}

    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(BadRequestError):
            client.completions.create(**params)
    else:
        completion = client.completions.create(**params)
        if prompt_logprobs is not None:
            assert completion.choices[0].prompt_logprobs is not None
            assert len(completion.choices[0].prompt_logprobs) > 0
            assert completion.choices[1].prompt_logprobs is not None
            assert len(completion.choices[1].prompt_logprobs) > 0
        else:
            assert completion.choices[0].prompt_logprobs is None


def test_completion_streaming(client) -> None:
    prompt = "What is an LLM?"

    single_completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.0)
    single_output = single_completion.choices[0].text
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.0,
                                       stream=True)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text
    assert "".join(chunks) == single_output


# vLLM's "What is an LLM?" never ends a sample before 50 tokens on the embedded code model; this prompt does,
# with seed 42, so that the samples finish at different times
PARALLEL_PROMPT = "x = 1\n"


def test_parallel_no_streaming(client):
    """Parallel sampling without streaming: one request output holds a list of completions."""
    prompt = PARALLEL_PROMPT
    n = 3
    max_tokens = 50  # we want some to finish earlier than others

    # High temperature to maximize chance of unique completions.
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, n=n,
                                           temperature=1.0, stream=False, logprobs=0, seed=42)

    num_completions = len(completion.choices)
    assert num_completions == n, f"Num completions {num_completions} but expected {n}."
    completion_repeats: dict[str, int] = {}
    output_token_lengths = set()
    for idx, choice in enumerate(completion.choices):
        assert choice.index == idx, f"Index {choice.index} but expected {idx}."
        assert choice.finish_reason is not None, "None finish_reason is invalid."
        completion_repeats[choice.text] = completion_repeats.get(choice.text, 0) + 1
        output_token_lengths.add(len(choice.logprobs.tokens))
    # Assert subrequests finished at different times
    assert len(output_token_lengths) > 1
    num_unique = len(completion_repeats)
    if num_unique != n:
        repeats = {txt: num for (txt, num) in completion_repeats.items() if num > 1}
        raise AssertionError(f"Expected {n} unique completions, got {num_unique}; repeats: {repeats}.")


def test_parallel_streaming(client):
    """Streaming for parallel sampling: the samples' tokens flattened into one stream, each chunk's index
    naming its sample."""
    prompt = PARALLEL_PROMPT
    n = 3
    max_tokens = 50  # we want some to finish earlier than others

    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, n=n,
                                       temperature=1.0, stream=True, seed=42)
    chunks: list[list[str]] = [[] for _ in range(n)]
    finish_reason_count = 0
    for chunk in stream:
        index = chunk.choices[0].index
        chunks[index].append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    assert finish_reason_count == n, f"Expected {n} completions with valid indices and finish_reason."
    completion_repeats: dict[str, int] = {}
    chunk_lengths = set()
    for chunk in chunks:
        chunk_len = len(chunk)
        chunk_lengths.add(chunk_len)
        assert chunk_len <= max_tokens, f"max_tokens={max_tokens} but chunk len is {chunk_len}."
        text = "".join(chunk)
        completion_repeats[text] = completion_repeats.get(text, 0) + 1
    # Assert subrequests finished at different times
    assert len(chunk_lengths) > 1
    num_unique = len(completion_repeats)
    if num_unique != n:
        repeats = {txt: num for (txt, num) in completion_repeats.items() if num > 1}
        raise AssertionError(f"{num_unique} unique completions, expected {n}; repeats: {repeats}")


def _assert_final_usage_chunk(final_chunk) -> None:
    assert final_chunk.usage is not None
    assert final_chunk.usage.prompt_tokens > 0
    assert final_chunk.usage.completion_tokens > 0
    assert final_chunk.usage.total_tokens == final_chunk.usage.prompt_tokens + final_chunk.usage.completion_tokens
    assert final_chunk.choices == []


def test_completion_stream_options(client):
    prompt = "What is the capital of France?"
    common = dict(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.0)

    stream = client.completions.create(**common, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": False})
    for chunk in stream:
        assert chunk.usage is None

    stream = client.completions.create(**common, stream=True,
                                       stream_options={"include_usage": False, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is None

    stream = client.completions.create(**common, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": False})
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            _assert_final_usage_chunk(next(stream))

    stream = client.completions.create(**common, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    for chunk in stream:
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens > 0
        assert chunk.usage.completion_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        if chunk.choices[0].finish_reason is not None:
            _assert_final_usage_chunk(next(stream))

    stream = client.completions.create(**common, stream=True, stream_options={})
    for chunk in stream:
        assert chunk.usage is None

    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": None},
                    {"continuous_usage_stats": True}):
        with pytest.raises(BadRequestError):
            client.completions.create(**common, stream=False, stream_options=options)


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2], ids=["text", "token-ids"])
def test_batch_completions(client, prompts):
    # test simple list
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0.0)
    assert len(batch.choices) == 2
    assert batch.choices[0].text == batch.choices[1].text

    # (vLLM's n=2 use_beam_search block is not ported: beam search is out of scope, see SKIPS.md)

    # test streaming
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0.0, stream=True)
    texts = [""] * 2
    for chunk in batch:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
    assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", [0, 0, 0, 0, 0]], ids=["text", "token-ids"])
def test_echo_logprob_completion(client, tokenizer, prompt, logprobs_arg: int):
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0.0,
                                           echo=True, logprobs=logprobs_arg)

    prompt_text = decode(tokenizer, prompt) if isinstance(prompt, list) else prompt
    # vLLM's regex search for "^" + prompt_text; escaped, as this tokenizer's special tokens hold "|"
    assert re.search(r"^" + re.escape(prompt_text), completion.choices[0].text)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.text_offset) > 5
    assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
    assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
    for top_logprobs in logprobs.top_logprobs[1:]:
        assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
    assert len(logprobs.tokens) > 5


def test_invalid_json_schema(client) -> None:
    prompt = "Generate a JSON with the brand, model and car_type ofthe most iconic car from the 90's"
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL_NAME, prompt=prompt,
                                  extra_body={"structured_outputs": {"json": INVALID_JSON_SCHEMA}})


def test_invalid_regex(client):
    prompt = ("Generate an email address for Alan Turing, who works in Enigma.End in .com and new line. Example "
              "result:alan.turing@enigma.com\n")
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL_NAME, prompt=prompt,
                                  extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]})


def test_invalid_grammar(client):
    prompt = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL_NAME, prompt=prompt,
                                  extra_body={"structured_outputs": {"grammar": INVALID_SQL_GRAMMAR}})
