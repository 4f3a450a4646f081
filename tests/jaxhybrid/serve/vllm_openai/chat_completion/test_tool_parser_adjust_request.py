"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_tool_parser_adjust_request.py: which constraint a
request with tools and a response_format runs under. vLLM's `ToolParser.adjust_request` rewrites the request;
here `ChatCompletionRequest.structured()` is the constraint the engine gets.

Not ported (SKIPS.md): test_auto_tool_choice_drops_response_format_constraint. Here tool_choice "auto" keeps a
response_format or structured_outputs (docs/serving.md: an output constrained to the model's tool-call format
is parsed as usual), where vLLM drops it."""

from __future__ import annotations

from jaxhybrid.openai.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {
    "name": "add_numbers", "description": "Adds two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


def _make_request(*, tool_choice="auto", response_format=None) -> ChatCompletionRequest:
    request = ChatCompletionRequest(model="test-model", messages=[{"role": "user", "content": "What is 42 + 58?"}],
                                    tools=TOOLS, tool_choice=tool_choice, response_format=response_format)
    request.check()
    return request


def test_required_tool_choice_keeps_forced_tool_schema():
    request = _make_request(tool_choice="required", response_format={"type": "json_object"})

    structured = request.structured()
    assert structured is not None and structured.kind == "json"
    assert structured.json["type"] == "array"  # the forced calls' schema, not json_object's {"type": "object"}
    assert [entry["properties"]["name"]["enum"] for entry in structured.json["items"]["anyOf"]] == [["add_numbers"]]


def test_tool_choice_none_keeps_response_format_constraint():
    request = _make_request(tool_choice="none", response_format={"type": "json_object"})

    assert request.response_format is not None and request.response_format["type"] == "json_object"
    assert request.structured_outputs is None
    assert request.structured().kind == "json_object"
