"""The protocol types the parsers produce (OpenAI's and vLLM's field names) and what they read from a tokenizer
and a request."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, model_serializer, model_validator


def make_tool_call_id() -> str:
    """A fresh tool-call id in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text, as the OpenAI API sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One tool call's part of a streamed chunk: `id`, `type` and the name come with its first part only; the
    `arguments` of all its parts concatenate to its JSON arguments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)

    @property
    def reasoning_content(self) -> str | None:
        """The older name of `reasoning`, which some clients (and vLLM's tests) still read."""
        return self.reasoning

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        """A chunk without tool calls carries no `tool_calls` key, as in vLLM's chunks."""
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        return data


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; its `properties` type the XML parsers' arguments


class ChatTool(BaseModel):
    """One entry of a request's `tools`, in the Chat Completions shape `{"type": "function", "function": {...}}`;
    the Responses API's flat shape (`name` and `parameters` beside `type`) is read into the same fields."""
    type: Literal["function"] = "function"
    function: FunctionDefinition

    @model_validator(mode="before")
    @classmethod
    def _lift_flat_shape(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "function" not in data and "name" in data:
            fields = {key: data[key] for key in ("name", "description", "parameters") if key in data}
            return {"type": data.get("type", "function"), "function": fields}
        return data


class FunctionLike(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def parameters(self) -> Mapping[str, Any] | None: ...


class ToolLike(Protocol):
    """What the parsers read of a tool: `ChatTool` has it, and so may the server's own request models."""
    @property
    def function(self) -> FunctionLike: ...


class ParserRequest(Protocol):
    """What the parsers read of a chat request; either attribute may be missing, and a request may be None."""
    @property
    def tools(self) -> Sequence[ToolLike] | None: ...

    @property
    def chat_template_kwargs(self) -> Mapping[str, Any] | None: ...


class TokenizerLike(Protocol):
    """All the parsers ask of a tokenizer: its vocabulary, to find the ids of their marker tokens."""
    def get_vocab(self) -> dict[str, int]: ...
