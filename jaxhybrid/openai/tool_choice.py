"""vLLM's forced tool choices: `tool_choice: "required"` and a named function are enforced by a JSON schema on the
output (structured outputs), and that output, valid JSON by construction, becomes the tool calls directly rather
than through a tool-call parser.

"required" asks for a JSON array of `{"name": ..., "parameters": {...}}` objects, at least one (exactly one when
`parallel_tool_calls` is false), each one of the tools; a named function asks for that function's arguments
object. A call's `arguments` are the model's own JSON text of its parameters, streamed or not, so the pieces of
a stream concatenate to what the whole output gives.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.parsers.messages import ChatTool

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def _parameters_or_empty(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function without parameters still takes a JSON object (vLLM)."""
    return parameters if parameters else {"type": "object", "properties": {}}


def forced_schema(tools: Sequence[ChatTool] | None, tool_choice: Any, parallel_tool_calls: bool | None
                  ) -> dict[str, Any] | None:
    """The JSON schema a forced tool choice puts on the output; None for "none", "auto" or no tools. A named
    function that is not in `tools` is a 400 naming tool_choice."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        tool = next((tool for tool in tools if tool.function.name == name), None)
        if tool is None:
            raise BadRequest(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
        return _parameters_or_empty(tool.function.parameters)
    return _required_schema(tools, parallel_tool_calls)


def _required_schema(tools: Sequence[ChatTool], parallel_tool_calls: bool | None) -> dict[str, Any]:
    parameters = [copy.deepcopy(tool.function.parameters) for tool in tools]  # their $defs move to the top
    definitions = _shared_definitions(tools, parameters)
    calls = [{"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                             "parameters": _parameters_or_empty(params)},
              "required": ["name", "parameters"]} for tool, params in zip(tools, parameters, strict=True)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if parallel_tool_calls is False:  # only an explicit false: unset means parallel calls are fine
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _shared_definitions(tools: Sequence[ChatTool], parameters: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Every tool's `$defs`, taken out of its parameters into one table (the references point to the schema's
    root, which is now the array); a name two tools define differently is a 400 naming tools."""
    shared: dict[str, Any] = {}
    for tool, params in zip(tools, parameters, strict=True):
        definitions = params.pop("$defs", {}) if isinstance(params, dict) else {}
        if not isinstance(definitions, dict):
            raise BadRequest(f"`$defs` in the parameters of tool '{tool.function.name}' must be an object, got "
                             f"{type(definitions).__name__}.", "tools")
        for name, definition in definitions.items():
            if shared.setdefault(name, definition) != definition:
                raise BadRequest(f"Tool definition '{name}' has multiple schemas, which is not supported.", "tools")
    return shared


@dataclass
class CallSpan:
    """One element of a "required" output's array as far as the text shows it: its name once its string is
    whole, and where its parameters' JSON begins and (once known) ends."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None

    @property
    def ready(self) -> bool:
        """Its name is whole and its parameters have begun: the call can be announced."""
        return self.name is not None and self.arguments_start is not None

    def arguments(self, text: str) -> str:
        """Its parameters' text so far (all of it once they have ended)."""
        end = len(text) if self.arguments_end is None else self.arguments_end
        return text[self.arguments_start:end]


def _skip_whitespace(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def _decode(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value at `at` and where it ends; None while the text does not hold it whole yet."""
    try:
        return _DECODER.raw_decode(text, at)
    except (ValueError, RecursionError):
        return None


def call_spans(text: str) -> list[CallSpan]:
    """The calls of a (maybe partial) "required" array. What a prefix of the text shows of a call only ever
    grows as the text does, so a stream can send the difference."""
    at = _skip_whitespace(text, 0)
    if not text.startswith("[", at):
        return []
    spans: list[CallSpan] = []
    at += 1
    while True:
        at = _skip_whitespace(text, at)
        at = _skip_whitespace(text, at + 1) if text.startswith(",", at) else at
        if not text.startswith("{", at):
            return spans
        span, end = _call_span(text, at + 1)
        spans.append(span)
        if end is None:
            return spans
        at = end


def _call_span(text: str, at: int) -> tuple[CallSpan, int | None]:
    """The members of the object whose `{` is just before `at`, and where it ends (None: not yet)."""
    span = CallSpan()
    while True:
        at = _skip_whitespace(text, at)
        at = _skip_whitespace(text, at + 1) if text.startswith(",", at) else at
        if text.startswith("}", at):
            return span, at + 1
        key = _decode(text, at)
        if key is None:
            return span, None
        at = _skip_whitespace(text, key[1])
        if not text.startswith(":", at):
            return span, None
        at = _skip_whitespace(text, at + 1)
        if at == len(text):
            return span, None
        if key[0] == "parameters":
            span.arguments_start = at
        value = _decode(text, at)
        if value is None:
            return span, None
        if key[0] == "name" and isinstance(value[0], str):
            span.name = value[0]
        elif key[0] == "parameters":
            span.arguments_end = value[1]
        at = value[1]


def required_calls(text: str | None) -> list[tuple[str, str]]:
    """(name, arguments) of each call of a whole "required" output; none unless it is a JSON array of objects
    with a string name and object (or null) parameters, as vLLM reads it."""
    try:
        calls = json.loads(text or "")
    except (ValueError, RecursionError):
        return []
    if not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("parameters"), dict | None) for call in calls):
        return []
    spans = call_spans(text)
    return [(span.name, span.arguments(text) if span.arguments_start is not None else "null")
            for span in spans if span.name is not None]
