"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_tool_choice_null.py: an explicit
`"tool_choice": null` means what an absent key means. vLLM resolves it in the request model (`tool_choice`
itself becomes "auto"); here the model keeps what was sent and `tool_mode` resolves it, so the asserts read
`tool_mode` on a server that parses tool calls (`auto_tools=True`). On a server without a tool-call parser the
two differ on purpose (docs/serving.md): an absent tool_choice with tools is "auto" (a 400 there), an explicit
null is "none". vLLM's pydantic ValidationError is our BadRequest from `check()`, which the server answers with
a 400 naming tool_choice."""

from __future__ import annotations

import pytest

from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


def validated(payload: dict) -> ChatCompletionRequest:
    request = ChatCompletionRequest.model_validate(payload)
    request.check()
    return request


def test_null_tool_choice_defaults_to_auto_like_an_absent_one():
    omitted = validated({"model": "m", "messages": MESSAGES, "tools": TOOLS})
    explicit_null = validated({"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": None})

    assert omitted.tool_mode(auto_tools=True) == "auto"
    assert explicit_null.tool_mode(auto_tools=True) == omitted.tool_mode(auto_tools=True)


def test_null_tool_choice_without_tools_matches_an_absent_one():
    omitted = validated({"model": "m", "messages": MESSAGES})
    explicit_null = validated({"model": "m", "messages": MESSAGES, "tool_choice": None})

    for auto_tools in (True, False):
        assert explicit_null.tool_mode(auto_tools) == omitted.tool_mode(auto_tools) == "none"


def test_null_tool_choice_does_not_conflict_with_structured_outputs():
    """The conflict check reads tool_choice: a null must not count as a tool request."""
    request = validated({"model": "m", "messages": MESSAGES, "structured_outputs": {"json": {"type": "object"}},
                         "tool_choice": None})

    assert request.structured_outputs is not None
    assert request.structured() is not None and request.structured().kind == "json"


@pytest.mark.parametrize(("tool_choice", "tools"), [("bogus", TOOLS), ("auto", None)])
def test_invalid_tool_choice_is_still_rejected(tool_choice, tools):
    payload = {"model": "m", "messages": MESSAGES, "tool_choice": tool_choice}
    if tools is not None:
        payload["tools"] = tools

    with pytest.raises(BadRequest) as error:
        validated(payload)
    assert error.value.param == "tool_choice"


def test_explicit_none_tool_choice_is_untouched():
    request = validated({"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})

    assert request.tool_choice == "none"
    assert request.tool_mode(auto_tools=True) == "none"
