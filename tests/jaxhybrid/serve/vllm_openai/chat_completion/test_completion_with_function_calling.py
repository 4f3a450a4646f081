"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py, on a server
that parses tool calls (--enable-auto-tool-choice --tool-call-parser hermes; vLLM's also has --reasoning-parser
qwen3, which the embedded tokenizer cannot take: it has no `<think>` token): a named tool_choice that names no
given tool, or comes without tools, or is empty, is a 400, and tool_choice "required" cut at max_tokens=1 ends
with finish_reason "length" and no tool calls. The cases that need a real model's calls, and the named tool
choice cut at max_tokens (which behaves otherwise here), are in SKIPS.md."""

from __future__ import annotations

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer
from tests.jaxhybrid.test_struct_output_generate import SAMPLE_JSON_SCHEMA

TOOLS = [
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object", "strict": True,
            "properties": {
                "city": {"type": "string", "description": "The city to find the weather for, e.g. 'Vienna'",
                         "default": "Vienna"},
                "country": {"type": "string", "description": "The country that the city is in, e.g. 'Austria'"},
                "unit": {"type": "string", "description": "The unit to fetch the temperature in",
                         "enum": ["celsius", "fahrenheit"]},
                "options": {"$ref": "#/$defs/WeatherOptions", "description": "Optional parameters for weather query"},
            },
            "required": ["country", "unit"],
            "$defs": {"WeatherOptions": {
                "title": "WeatherOptions", "type": "object", "additionalProperties": False,
                "properties": {
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius",
                             "description": "Temperature unit", "title": "Temperature Unit"},
                    "include_forecast": {"type": "boolean", "default": False,
                                         "description": "Whether to include a 24-hour forecast",
                                         "title": "Include Forecast"},
                    "language": {"type": "string", "default": "zh-CN", "description": "Language of the response",
                                 "title": "Language", "enum": ["zh-CN", "en-US", "ja-JP"]},
                }}},
        }}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Get the weather forecast for a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city to get the forecast for, e.g. 'Vienna'",
                         "default": "Vienna"},
                "country": {"type": "string", "description": "The country that the city is in, e.g. 'Austria'"},
                "days": {"type": "integer", "description": "Number of days to get the forecast for (1-7)"},
                "unit": {"type": "string", "description": "The unit to fetch the temperature in",
                         "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["country", "days", "unit"],
        }}},
]
MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "Can you tell me what the current weather is in Berlin and the forecast for the next "
                                "5 days, in fahrenheit?"},
]


@pytest.fixture(scope="module")
def server(session_engine):
    process = InProcessServer(session_engine, SERVER_FLAGS, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield process
    process.stop()


def test_inconsistent_tool_choice_and_tools(client):
    messages = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "Give an example JSON for an employee profile that fits this schema: "
                                            f"{SAMPLE_JSON_SCHEMA}"}]
    dummy = [{"type": "function", "function": {"name": "dummy_function_name", "description": "This is a dummy function",
                                               "parameters": SAMPLE_JSON_SCHEMA}}]

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=1000,
                                       tool_choice={"type": "function", "function": {"name": "dummy_function_name"}})

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=1000, tools=dummy,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nondefined_function_name"}})

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=1000, tools=dummy,
                                       tool_choice={})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}])
def test_max_tokens_with_tool_choice_required(client, tool_choice):
    model_name = client.models.list().data[0].id

    # This combination previously crashed vLLM's engine
    chat_completion = client.chat.completions.create(messages=MESSAGES, temperature=0, max_completion_tokens=1,
                                                     model=model_name, tools=TOOLS, tool_choice=tool_choice)
    # When the tokens of the forced call exceed max_tokens, `tool_calls` is absent and `content` is empty
    # (as OpenAI's).
    choice = chat_completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
