"""Reasoning and tool-call parsing of chat output (the server's and the batch job's), with vLLM's flags and rules.

`ChatParsers` is what the flags built (`--reasoning-parser`; `--enable-auto-tool-choice` with
`--tool-call-parser`); it refuses, with vLLM's 400s, a tool_choice no parser can serve. A `ChoiceParser` per
choice runs the reasoning parser (unless the prompt already ended the reasoning), then hands the content to the
stage of the request's tool_choice: "none" keeps it, "auto" runs the tool-call parser, "required" and a named
function read the JSON that their schema forced (`tool_choice.py`). It works on a whole output or delta by
delta, the last delta adding what the parsers held back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jaxhybrid.engine.args import ParserSetupError
from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import ChatCompletionRequest
from jaxhybrid.openai.tool_choice import call_spans, required_calls
from jaxhybrid.parsers.messages import (
    ChatTool,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    TokenizerLike,
    ToolCall,
    make_tool_call_id,
)
from jaxhybrid.parsers.reasoning import ReasoningParser, get_reasoning_parser
from jaxhybrid.parsers.tools import ToolParser, get_tool_parser
from jaxhybrid.sample.params import SamplingParams

FORCED = ("required", "named")  # the tool choices whose schema forces calls


@dataclass(frozen=True)
class ChatParsers:
    """The parser classes the server's flags name; `tools` only with --enable-auto-tool-choice."""

    tokenizer: TokenizerLike | None = None
    reasoning: type[ReasoningParser] | None = None
    tools: type[ToolParser] | None = None

    @classmethod
    def from_flags(cls, tokenizer: TokenizerLike | None, reasoning_parser: str | None = None,
                   tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> ChatParsers:
        """The parsers, each tried on `tokenizer` once: one that cannot work with it (a marker token it lacks)
        is a ParserSetupError naming the flag, at start-up rather than on the first request."""
        reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        tools = get_tool_parser(tool_call_parser) if enable_auto_tool_choice and tool_call_parser else None
        for flag, name, parser in (("--reasoning-parser", reasoning_parser, reasoning),
                                   ("--tool-call-parser", tool_call_parser, tools)):
            if parser is None:
                continue
            if tokenizer is None:
                raise ParserSetupError(f"{flag} {name} needs the model's tokenizer (skip_tokenizer_init is set)")
            try:
                parser(tokenizer)
            except ValueError as error:
                raise ParserSetupError(f"{flag} {name} cannot be used with this tokenizer: {error}") from error
        return cls(tokenizer, reasoning, tools)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def tool_mode(self, body: ChatCompletionRequest) -> str:
        return body.tool_mode(auto_tools=self.tools is not None)

    def check(self, body: ChatCompletionRequest) -> None:
        """vLLM's 400s for a tool_choice that needs a tool-call parser the server was not started with."""
        mode = self.tool_mode(body)
        if mode == "none" or self.tools is not None:
            return
        if mode == "auto":
            raise BadRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                             "set", "tool_choice")
        choice = body.resolved_tool_choice
        described = f'function "{choice["function"]["name"]}"' if mode == "named" else f'"{choice}"'
        raise BadRequest(f"tool_choice={described} requires --tool-call-parser to be set", "tool_choice")

    def adjust(self, body: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """Output text keeps special tokens while a parser reads it: some models' markers are special tokens
        (vLLM's parsers' adjust_request)."""
        if self.reasoning is None and self.tool_mode(body) == "none":
            return params
        return dataclasses.replace(params, skip_special_tokens=False)

    def hides_metadata(self, body: ChatCompletionRequest) -> bool:
        """vLLM's include_reasoning=false: with a parser, no logprobs or token ids, which would show the
        reasoning's tokens."""
        return self.active and not body.include_reasoning

    def choice_parser(self, body: ChatCompletionRequest, prompt_token_ids: Sequence[int]) -> ChoiceParser | None:
        """A parser for one choice of `body`; None when the server parses nothing."""
        return ChoiceParser(self, body, prompt_token_ids) if self.active else None


@dataclass
class _ParserRequest:
    """What the parsers read of a request: its tools, and its chat template's variables as rendered."""

    tools: list[ChatTool] | None
    chat_template_kwargs: Mapping[str, Any]


class _Stage(Protocol):
    """The tool-call stage of a tool_choice, after the reasoning parser."""

    def whole(self, content: str | None) -> tuple[str | None, list[ToolCall]]: ...

    def stream(self, content: str) -> DeltaMessage | None: ...

    def finish(self) -> DeltaMessage | None: ...


class _NoTools:
    def whole(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        return content, []

    def stream(self, content: str) -> DeltaMessage | None:
        return DeltaMessage(content=content)

    def finish(self) -> DeltaMessage | None:
        return None


class _AutoTools:
    """The tool-call parser: calls where the model wrote them, the rest is content."""

    def __init__(self, parser: ToolParser, request: _ParserRequest) -> None:
        self._parser, self._request, self._text = parser, request, ""

    def whole(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        found = self._parser.extract_tool_calls(content or "", self._request)
        if not found.tools_called:
            return content, []
        return (found.content if found.content and found.content.strip() else None), found.tool_calls

    def stream(self, content: str) -> DeltaMessage | None:
        previous, self._text = self._text, self._text + content
        return self._parser.extract_tool_calls_streaming(previous, self._text, content, (), (), (), self._request)

    def finish(self) -> DeltaMessage | None:
        return self._parser.finish_streaming()


class _NamedTool:
    """A named function: all of the content is its arguments."""

    def __init__(self, name: str) -> None:
        self._name, self._id = name, None

    def whole(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        """No call unless the arguments are whole JSON: cut at max_tokens, the reply has no tool_calls (vLLM,
        OpenAI)."""
        try:
            json.loads(content or "")
        except (ValueError, RecursionError):
            return None, []
        return None, [ToolCall(function=FunctionCall(name=self._name, arguments=content))]

    def stream(self, content: str) -> DeltaMessage | None:
        """The first piece announces the call (id, type, name), the others only add to its arguments."""
        if self._id is not None:
            return DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=content))])
        self._id = make_tool_call_id()
        call = DeltaToolCall(index=0, id=self._id, type="function",
                             function=DeltaFunctionCall(name=self._name, arguments=content))
        return DeltaMessage(tool_calls=[call])

    def finish(self) -> DeltaMessage | None:
        return None


class _RequiredTools:
    """"required": the content is a JSON array of calls; a call goes out once its name is whole, then its
    parameters' text as it grows."""

    def __init__(self) -> None:
        self._text = ""
        self._sent: list[int] = []  # per announced call: the characters of its arguments sent

    def whole(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall(function=FunctionCall(name=name, arguments=arguments))
                      for name, arguments in required_calls(content)]

    def stream(self, content: str) -> DeltaMessage | None:
        self._text += content
        calls = []
        for index, span in enumerate(call_spans(self._text)):
            if not span.ready:  # calls come in order: none after this one is ready either
                break
            arguments = span.arguments(self._text)
            if index == len(self._sent):
                calls.append(DeltaToolCall(index=index, id=make_tool_call_id(), type="function",
                                           function=DeltaFunctionCall(name=span.name, arguments=arguments)))
            elif len(arguments) > self._sent[index]:
                calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=arguments[self._sent[index]:])))
            else:
                continue
            self._sent[index:index + 1] = [len(arguments)]
        return DeltaMessage(tool_calls=calls) if calls else None

    def finish(self) -> DeltaMessage | None:
        return None


class ChoiceParser:
    """One choice's output as reasoning, content and tool calls. Build one per choice: the streaming methods
    keep state from one delta to the next."""

    def __init__(self, parsers: ChatParsers, body: ChatCompletionRequest, prompt_token_ids: Sequence[int]) -> None:
        self._request = _ParserRequest(body.tools, body.template_kwargs())
        self._reasoning = self._reasoning_parser(parsers, prompt_token_ids)
        self.mode = parsers.tool_mode(body)
        self._stage = self._new_stage(parsers, body)
        self._include_reasoning = body.include_reasoning
        self._parallel = body.parallel_tool_calls is not False
        self.streamed_calls = False  # a delta has carried a tool call
        self._text, self._token_ids = "", []

    def _reasoning_parser(self, parsers: ChatParsers, prompt_token_ids: Sequence[int]) -> ReasoningParser | None:
        """None when there is none, or when the prompt already ended the reasoning (the template closed it, or
        the request turned thinking off): the output is then all content, as the engine's grammar takes it."""
        if parsers.reasoning is None:
            return None
        parser = parsers.reasoning(parsers.tokenizer, chat_template_kwargs=self._request.chat_template_kwargs)
        return None if parser.is_reasoning_end(list(prompt_token_ids)) else parser

    def _new_stage(self, parsers: ChatParsers, body: ChatCompletionRequest) -> _Stage:
        if self.mode == "auto":
            return _AutoTools(parsers.tools(parsers.tokenizer, tools=body.tools), self._request)
        if self.mode == "named":
            return _NamedTool(body.resolved_tool_choice["function"]["name"])
        return _RequiredTools() if self.mode == "required" else _NoTools()

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a whole output."""
        reasoning, content = (None, text) if self._reasoning is None else self._reasoning.extract_reasoning(
            text, self._request)
        content, calls = self._stage.whole(content)
        if self.mode in FORCED:
            content = content or ""  # vLLM's message for a forced call
        return reasoning if self._include_reasoning else None, content, calls if self._parallel else calls[:1]

    def delta(self, text: str, token_ids: Sequence[int] = (), last: bool = False) -> DeltaMessage | None:
        """What `text`, the output's next piece, adds; with `last` (the output has ended) also what the parsers
        held back while it could still have begun a marker. None when nothing can go out."""
        reasoning, content = self._split(text, token_ids)
        parts = [self._stage.stream(content) if content else None]
        if last:
            held = self._reasoning.finish_streaming(self._request) if self._reasoning is not None else None
            if held is not None:
                reasoning = (reasoning or "") + (held.reasoning or "")
                parts.append(self._stage.stream(held.content) if held.content else None)
            parts.append(self._stage.finish())
        return self._combine(reasoning, *parts)

    def _split(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """(reasoning, content) of the next piece, by the reasoning parser."""
        previous, previous_ids = self._text, list(self._token_ids)
        self._text += text
        self._token_ids.extend(token_ids)
        if self._reasoning is None or not text:
            return None, text or None
        split = self._reasoning.extract_reasoning_streaming(previous, self._text, text, previous_ids,
                                                            self._token_ids, token_ids)
        return (None, None) if split is None else (split.reasoning, split.content)

    def _combine(self, reasoning: str | None, *parts: DeltaMessage | None) -> DeltaMessage | None:
        content = "".join(part.content for part in parts if part is not None and part.content) or None
        calls = [call for part in parts if part is not None for call in part.tool_calls
                 if self._parallel or call.index == 0]
        self.streamed_calls = self.streamed_calls or bool(calls)
        reasoning = reasoning if self._include_reasoning else None
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content, tool_calls=calls)

    def finish_reason(self, reason: str | None, calls: list[ToolCall] | None = None) -> str | None:
        """vLLM's finish_reason: "tool_calls" for an output that called tools (a whole output: `calls` found in
        "auto", any "required" one that stopped; a stream: any call streamed, unless the function was named)."""
        if calls is None:
            called = self.streamed_calls and self.mode != "named" and reason == "stop"
        else:
            called = (self.mode == "auto" and bool(calls)) or (self.mode == "required" and reason == "stop")
        return "tool_calls" if called else reason
