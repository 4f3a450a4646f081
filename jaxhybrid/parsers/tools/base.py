"""The tool-call parsers' interface (vLLM's method names and semantics) and what the two formats share: a state
machine over the text records content and tool calls into a `CallLog`, and a stream hands out what the log
gained since the last delta, so a whole output and the same output streamed give the same result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..messages import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ParserRequest,
    TokenizerLike,
    ToolCall,
    ToolLike,
    make_tool_call_id,
)
from ..tags import TagMachine


@dataclass
class _Call:
    name: str
    arguments: str = ""
    id: str = field(default_factory=make_tool_call_id)


class CallLog:
    """Content and tool calls found so far, and how much of them a stream has sent. With `hold_blank_content`,
    content that is only whitespace waits for text that is not: it is sent if some follows, or if the output
    ends without a tool call (whitespace around tool calls is the template's, not the model's answer)."""

    def __init__(self, hold_blank_content: bool) -> None:
        self.content = ""
        self.calls: list[_Call] = []
        self._hold_blank = hold_blank_content
        self._has_text = False  # content holds more than whitespace
        self._sent_content = 0
        self._sent_arguments: list[int] = []  # per call whose first part went out

    def add_content(self, text: str) -> None:
        self.content += text
        self._has_text = self._has_text or not text.isspace()

    def start_call(self, name: str) -> None:
        self.calls.append(_Call(name))

    def add_arguments(self, text: str) -> None:
        self.calls[-1].arguments += text

    def delta(self, final: bool) -> DeltaMessage | None:
        """What the log gained since the last delta; `final` once the output has ended."""
        parts = [part for index in range(len(self.calls)) if (part := self._call_delta(index)) is not None]
        content = self._content_delta(final)
        if content is None and not parts:
            return None
        return DeltaMessage(content=content, tool_calls=parts)

    def extracted(self, model_output: str) -> ExtractedToolCallInformation:
        if not self.calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in self.calls]
        content = self.content if self._has_text or not self._hold_blank else ""
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)

    def _content_delta(self, final: bool) -> str | None:
        if self._hold_blank and not self._has_text and (self.calls or not final):
            return None
        text, self._sent_content = self.content[self._sent_content:], len(self.content)
        return text or None

    def _call_delta(self, index: int) -> DeltaToolCall | None:
        call = self.calls[index]
        if index == len(self._sent_arguments):  # its first part: id, type and name
            self._sent_arguments.append(len(call.arguments))
            return DeltaToolCall(index=index, id=call.id, type="function",
                                 function=DeltaFunctionCall(name=call.name, arguments=call.arguments or None))
        new = call.arguments[self._sent_arguments[index]:]
        if not new:
            return None
        self._sent_arguments[index] = len(call.arguments)
        return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new))


class CallMachine(TagMachine):
    """A tool-call format's state machine: it writes what it finds into `log`."""

    def __init__(self, log: CallLog) -> None:
        super().__init__()
        self.log = log

    def well_formed(self) -> bool:
        """Whether the calls of a whole output are all well formed; one that is not makes the output call no
        tool (it is all content)."""
        return True


class ToolParser(ABC):
    """Finds tool calls in a model's output. One instance per request: streaming keeps state from one delta to
    the next. The request's `tools` (or, without them, the ones given here) type the arguments where the format
    needs it. The streaming methods read only `delta_text`; the other arguments keep vLLM's call shape."""

    hold_blank_content = False

    def __init__(self, tokenizer: TokenizerLike, tools: Sequence[ToolLike] | None = None) -> None:
        self.model_tokenizer = tokenizer
        self.tools = list(tools or [])
        self._stream: CallMachine | None = None

    def extract_tool_calls(self, model_output: str, request: ParserRequest | None) -> ExtractedToolCallInformation:
        machine = self._new_machine(request)
        machine.feed(model_output)
        machine.finish()
        if not machine.well_formed():
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return machine.log.extracted(model_output)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int],
                                     request: ParserRequest | None) -> DeltaMessage | None:
        """What `delta_text` adds: content, a new tool call's id and name, argument text; None for nothing yet."""
        if self._stream is None:
            self._stream = self._new_machine(request)
        self._stream.feed(delta_text)
        return self._stream.log.delta(final=False)

    def finish_streaming(self) -> DeltaMessage | None:
        """The last delta of a stream: text held back while it could still have begun a tag, and the closing of
        a tool call that the output left open. The next streaming call starts a new stream."""
        stream, self._stream = self._stream, None
        if stream is None:
            return None
        stream.finish()
        return stream.log.delta(final=True)

    def _tools(self, request: ParserRequest | None) -> Sequence[ToolLike]:
        return getattr(request, "tools", None) or self.tools

    @abstractmethod
    def _new_machine(self, request: ParserRequest | None) -> CallMachine: ...
