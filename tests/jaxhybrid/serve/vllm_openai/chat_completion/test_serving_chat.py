"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_serving_chat.py (the cases whose behaviour this
server has): the response names the first served model name whichever alias (or none) the request gave,
truncation_side picks which end of a rendered chat truncate_prompt_tokens keeps, tool_choice "required" or a
named function without a tool-call parser is a 400, n > 1 streamed choices parse their tool calls each with its
own parser, and the logprobs of tokens a parser holds back still stream. vLLM drives a mocked
`OpenAIServingChat`; here the requests go to an in-process server on the session engine (one for the module:
a second engine loop on the same engine would step it too), with max_tokens=1 where vLLM's mocked engine
returns at once, and a regex structured output where vLLM's mocked engine returns a tool call's text (the model
writes that text, in tokens of its own choosing). The cases left out are in SKIPS.md."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer

MODEL_NAME_SHORT = "jaxhybrid"  # vLLM's second served name ("gpt2" beside "openai-community/gpt2")


@pytest.fixture(scope="module")
def server(session_engine):
    """Both served names, and tool calls parsed (--enable-auto-tool-choice --tool-call-parser hermes)."""
    process = InProcessServer(session_engine, SERVER_FLAGS, model_names=(MODEL_NAME, MODEL_NAME_SHORT),
                              enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield process
    process.stop()


def _chat(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "what is 1+1?"}], "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_serving_chat_returns_correct_model_name(server):
    # Test that full name is returned when short name is requested
    assert _chat(server, model=MODEL_NAME_SHORT)["model"] == MODEL_NAME

    # Test that full name is returned when empty string is specified
    assert _chat(server, model="")["model"] == MODEL_NAME

    # Test that full name is returned when no model is specified
    assert _chat(server)["model"] == MODEL_NAME


def _render_chat_prompt_token_ids(server, messages: list[dict], truncate_prompt_tokens: int | None = None,
                                  truncation_side: str | None = None) -> list[int]:
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0.0, "return_token_ids": True,
            "truncate_prompt_tokens": truncate_prompt_tokens, "truncation_side": truncation_side}
    prompt_token_ids = _chat(server, **{k: v for k, v in body.items() if v is not None})["prompt_token_ids"]
    assert prompt_token_ids is not None
    return prompt_token_ids


def test_serving_chat_truncation_side_controls_prompt_truncation(server):
    messages = [{"role": "user", "content": "Summarize how prompt truncation works in one sentence."}]

    full_token_ids = _render_chat_prompt_token_ids(server, messages)
    assert len(full_token_ids) > 4

    right_token_ids = _render_chat_prompt_token_ids(server, messages, truncate_prompt_tokens=4,
                                                    truncation_side="right")
    assert right_token_ids == full_token_ids[:4]

    left_token_ids = _render_chat_prompt_token_ids(server, messages, truncate_prompt_tokens=4,
                                                   truncation_side="left")
    assert left_token_ids == full_token_ids[-4:]


@pytest.fixture
def parserless_server(session_engine):
    """A server without a tool-call parser. It only refuses requests, so its engine loop never steps the
    engine beside the module's."""
    process = InProcessServer(session_engine, SERVER_FLAGS)
    yield process
    process.stop()


def test_tool_choice_validation_without_parser(parserless_server):
    """tool_choice="required" or a named tool without a tool parser is a 400 saying so."""
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather in a given location",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}}]
    messages = [{"role": "user", "content": "What's the weather?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = httpx.post(f"{parserless_server.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": messages, "tools": tools, "tool_choice": tool_choice})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "tool_choice" in message
        assert "--tool-call-parser" in message
        if isinstance(tool_choice, dict):  # the name, readably (no pydantic repr of the choice)
            assert "get_weather" in message
            assert "ChatCompletionNamedFunction" not in message
            assert "ChatCompletionNamedToolChoiceParam" not in message


CITY_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'


def _stream(server, body: dict) -> list[dict]:
    """The chunks of a streamed chat reply."""
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _forced(text: str, **body) -> dict:
    """A greedy request whose output is `text` (a regex of it), with CITY_TOOLS and tool_choice "auto"."""
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "test"}], "tools": CITY_TOOLS,
            "tool_choice": "auto", "temperature": 0, "max_tokens": 100,
            "structured_outputs": {"regex": re.escape(text)}, **body}


@pytest.mark.parametrize(("engine_finish_reason", "expected_finish_reason"), [("stop", "tool_calls"),
                                                                                ("length", "length")])
def test_streaming_n_gt1_independent_tool_parsers(server, engine_finish_reason, expected_finish_reason):
    """n > 1 streaming uses a parser and a token history per choice. vLLM's engine finishes "length" right after
    the call's text: here max_tokens is the number of tokens the model writes it in (eos not counted)."""
    num_choices = 2
    body = _forced(TOOL_CALL_TEXT, n=num_choices)
    if engine_finish_reason == "length":
        whole = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                           json={**body, "n": 1, "return_token_ids": True}).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls"
        body["max_tokens"] = len(whole["token_ids"]) - 1  # the output ends with eos, which the grammar forces

    tc_deltas_by_choice: dict[int, list[dict]] = {i: [] for i in range(num_choices)}
    finish_reasons_by_choice: dict[int, list[str]] = {i: [] for i in range(num_choices)}
    for data in _stream(server, body):
        for choice in data.get("choices", []):
            idx = choice["index"]
            delta = choice.get("delta", {})
            if delta.get("tool_calls"):
                tc_deltas_by_choice[idx].extend(delta["tool_calls"])
            if choice.get("finish_reason") is not None:
                finish_reasons_by_choice[idx].append(choice["finish_reason"])

    for choice_idx in range(num_choices):
        deltas = tc_deltas_by_choice[choice_idx]
        assert len(deltas) > 0, f"Choice {choice_idx}: expected tool-call deltas but got none"
        name = None
        args_buf = ""
        for tc in deltas:
            fn = tc.get("function", {})
            if fn.get("name"):
                name = fn["name"]
            if fn.get("arguments"):
                args_buf += fn["arguments"]
        assert name == "get_weather", f"Choice {choice_idx}: expected 'get_weather', got {name!r}"
        assert json.loads(args_buf) == {"city": "Tokyo"}, args_buf
        reasons = finish_reasons_by_choice[choice_idx]
        assert reasons == [expected_finish_reason], f"Choice {choice_idx}: {reasons}"


@pytest.mark.parametrize("include_reasoning", [True, False])
def test_streaming_logprobs_kept_when_parser_suppresses_delta(server, include_reasoning):
    """The logprobs of tokens the parser swallows (the pieces of <tool_call>, held back while they could begin
    the marker) still stream, unless per-token metadata is hidden with the reasoning (include_reasoning false
    with a parser on). vLLM's mocked parser swallows one token; here the stream's logprobs are all of the whole
    reply's, and some chunk carries logprobs with nothing in its delta."""
    body = _forced("Sure. " + TOOL_CALL_TEXT, logprobs=True, include_reasoning=include_reasoning)
    whole = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json=body).json()["choices"][0]
    chunks = _stream(server, body)
    streamed = [choice for chunk in chunks for choice in chunk["choices"]]
    streamed_tokens = [entry["token"] for choice in streamed if choice.get("logprobs")
                       for entry in choice["logprobs"]["content"]]
    if include_reasoning:
        assert streamed_tokens == [entry["token"] for entry in whole["logprobs"]["content"]]
        assert any(choice.get("logprobs") and not choice["delta"].get("content")
                   and not choice["delta"].get("tool_calls") for choice in streamed)
    else:
        assert whole["logprobs"] is None
        assert streamed_tokens == []
