"""Port of vLLM's tests/entrypoints/openai/basic/test_return_token_ids.py: return_token_ids adds the prompt's and
the completion's token ids to completions and chat, plain and streamed, and they agree with the text, the
logprobs (return_tokens_as_token_ids) and the reference tokenizer. vLLM's server for its tool-use case parses
tool calls, so the module's server runs with --enable-auto-tool-choice --tool-call-parser hermes (requests
without tools are as before); whether the random model writes a tool call is its own affair, as in vLLM, where
the asserts on a call hold only if one was made."""

from __future__ import annotations

import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer, decode

EMOJI_PROMPT = "Complete this sentence with emojis: I love coding 🚀"


@pytest.fixture(scope="module")
def server(session_engine):
    """The module's server, parsing tool calls (the one server of the module: one engine loop on the engine)."""
    process = InProcessServer(session_engine, SERVER_FLAGS, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield process
    process.stop()


def test_basic_completion_with_emoji(client, tokenizer):
    completion = client.completions.create(model=MODEL_NAME, prompt=EMOJI_PROMPT, max_tokens=10, temperature=0,
                                           logprobs=1, extra_body={"return_token_ids": True})
    completion_dict = completion.model_dump()

    assert "prompt_token_ids" in completion_dict["choices"][0]
    assert isinstance(completion.choices[0].prompt_token_ids, list)

    # the encoded prompt is a run of prompt_token_ids
    encoded_tokens = tokenizer.encode(EMOJI_PROMPT).ids
    prompt_ids = completion.choices[0].prompt_token_ids
    assert any(prompt_ids[i:i + len(encoded_tokens)] == encoded_tokens
               for i in range(len(prompt_ids) - len(encoded_tokens) + 1))

    assert completion.choices[0].token_ids is not None
    assert isinstance(completion.choices[0].token_ids, list)
    assert len(completion.choices[0].token_ids) > 0

    decoded_text = decode(tokenizer, completion.choices[0].token_ids)
    assert decoded_text.startswith(completion.choices[0].text)

    # without return_token_ids: none
    completion_without = client.completions.create(model=MODEL_NAME, prompt=EMOJI_PROMPT, max_tokens=10,
                                                   temperature=0, logprobs=1, extra_body={"return_token_ids": False})
    completion_without_dict = completion_without.model_dump()
    assert completion_without_dict["choices"][0].get("token_ids") is None
    assert completion_without_dict.get("prompt_token_ids") is None


def test_comparison_with_prompt_logprobs_and_logprobs(client, tokenizer):
    """token_ids agree with prompt_logprobs and logprobs when return_tokens_as_token_ids is on."""
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Hello, world! How are you today?", max_tokens=20, temperature=0, echo=True,
        logprobs=1, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1})

    assert completion.choices[0].token_ids is not None
    assert completion.choices[0].prompt_token_ids is not None
    assert completion.choices[0].prompt_logprobs is not None
    assert completion.choices[0].logprobs is not None

    logprobs_token_ids = [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens
                          if token.startswith("token_id:")]

    # with echo, the logprobs cover the prompt and the response; token_ids is their response suffix
    assert len(completion.choices[0].token_ids) < len(logprobs_token_ids)
    response_token_ids_length = len(completion.choices[0].token_ids)
    assert logprobs_token_ids[-response_token_ids_length:] == completion.choices[0].token_ids

    if completion.choices[0].prompt_token_ids:
        assert "Hello, world" in decode(tokenizer, completion.choices[0].prompt_token_ids)
    if completion.choices[0].token_ids:
        assert completion.choices[0].text.endswith(decode(tokenizer, completion.choices[0].token_ids))

    # streaming
    stream = client.completions.create(model=MODEL_NAME, prompt="Tell me a short fact about Python:", max_tokens=30,
                                       temperature=0, stream=True, echo=False, logprobs=1,
                                       extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    streamed_prompt_token_ids = []
    streamed_token_ids = []
    streamed_logprob_token_ids = []
    first_chunk = True
    for chunk in stream:
        for token_str in chunk.choices[0].logprobs.tokens:
            if token_str.startswith("token_id:"):
                streamed_logprob_token_ids.append(int(token_str.removeprefix("token_id:")))
        if first_chunk:
            streamed_prompt_token_ids = chunk.choices[0].prompt_token_ids
            first_chunk = False
        streamed_token_ids += chunk.choices[0].token_ids

    assert len(streamed_prompt_token_ids) > 0
    assert streamed_token_ids == streamed_logprob_token_ids


def test_chat_completion_with_emoji_and_token_ids(client, tokenizer):
    chat_messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                     {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=50, temperature=0,
                                              logprobs=True, extra_body={"return_token_ids": True})

    response_dict = response.model_dump()
    assert response.choices[0].token_ids is not None
    assert "prompt_token_ids" in response_dict
    assert response.choices[0].message.content is not None

    decoded_prompt = decode(tokenizer, response.prompt_token_ids)
    assert "You like to use emojis in your responses" in decoded_prompt
    assert "I love cats 🐱" in decoded_prompt

    decoded_response = decode(tokenizer, response.choices[0].token_ids)
    assert len(decoded_response) > 0

    # streaming
    stream = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=50, temperature=0,
                                            stream=True, extra_body={"return_token_ids": True})
    collected_content = ""
    collected_token_ids = []
    first_chunk = True
    for chunk in stream:
        if first_chunk:
            assert chunk.prompt_token_ids is not None
            assert isinstance(chunk.prompt_token_ids, list)
            assert decode(tokenizer, chunk.prompt_token_ids) == decoded_prompt
            first_chunk = False
        else:
            assert "prompt_token_ids" not in chunk.model_dump(), "Subsequent chunks should not have prompt_token_ids"
        if chunk.choices:
            if chunk.choices[0].delta.content:
                collected_content += chunk.choices[0].delta.content
            # token_ids may not be in every chunk
            if "token_ids" in chunk.choices[0].model_dump():
                collected_token_ids.extend(chunk.choices[0].token_ids)

    assert len(collected_content) > 0
    assert len(collected_token_ids) > 0
    assert len(decode(tokenizer, collected_token_ids)) > 0


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "The unit of temperature"}},
        "required": ["location"]}}}]
WEATHER_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What's the weather like in Paris?"}]


def test_chat_completion_with_tool_use(client, tokenizer):
    response = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER_MESSAGES, tools=WEATHER_TOOLS,
                                              tool_choice="auto", max_tokens=100, temperature=0, logprobs=True,
                                              extra_body={"return_token_ids": True})

    assert response.choices[0].token_ids is not None
    assert isinstance(response.choices[0].token_ids, list)
    assert response.prompt_token_ids is not None
    assert isinstance(response.prompt_token_ids, list)

    prompt_text = decode(tokenizer, response.prompt_token_ids)
    assert "You are a helpful assistant" in prompt_text
    assert "What's the weather like in Paris?" in prompt_text

    response_text = decode(tokenizer, response.choices[0].token_ids)
    assert len(response_text) > 0
    assert response.choices[0].message.content is not None

    if response.choices[0].message.tool_calls:
        assert len(response.choices[0].message.tool_calls) > 0
        assert response.choices[0].message.tool_calls[0].function.name == "get_weather"

    response_without = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER_MESSAGES,
                                                      tools=WEATHER_TOOLS, tool_choice="auto", max_tokens=100,
                                                      temperature=0, logprobs=True,
                                                      extra_body={"return_token_ids": False})
    assert response_without.choices[0].token_ids is None
    assert response_without.prompt_token_ids is None
