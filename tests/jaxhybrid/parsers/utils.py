"""The streaming drivers of vLLM's parser tests, for our parsers: a stream ends with `finish_streaming`, as the
server ends one, and token ids come from `encode`."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jaxhybrid.engine.detokenize import IncrementalDetokenizer
from jaxhybrid.parsers.messages import ChatTool, DeltaMessage, ExtractedToolCallInformation, FunctionCall, ToolCall
from jaxhybrid.parsers.reasoning import ReasoningParser
from jaxhybrid.parsers.tools import ToolParser

# vLLM's request and tool types, as far as the parsers read them.
ChatCompletionToolsParam = FunctionTool = ChatTool


@dataclass
class ChatCompletionRequest:
    model: str = "test-model"
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def token_texts(tokenizer, text: str) -> list[str]:
    """Each token's text of `text`, as the server's detokenizer hands it out (special tokens kept)."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    return [detokenizer.push([token]).text for token in tokenizer.encode(text)]


# ---- reasoning ----

class StreamingReasoningReconstructor:
    def __init__(self) -> None:
        self.reasoning: str | None = None
        self.other_content: str | None = None

    def append_delta(self, delta: DeltaMessage) -> None:
        # content and the reasoning content should not be present at the same time
        assert delta.content is None or delta.reasoning is None, (
            "Both content and reasoning content are present in the delta message")
        assert delta.reasoning == delta.reasoning_content, (
            "reasoning_content should be present for backwards compatibility")
        if delta.content is not None:
            self.other_content = (self.other_content or "") + delta.content
        else:
            self.reasoning = (self.reasoning or "") + delta.reasoning


def run_reasoning_extraction(reasoning_parser: ReasoningParser, model_output: list[str],
                             request: ChatCompletionRequest | None = None,
                             streaming: bool = False) -> tuple[str | None, str | None]:
    if streaming:
        reconstructor = run_reasoning_extraction_streaming(reasoning_parser, model_output, request)
        return reconstructor.reasoning, reconstructor.other_content or None
    request = request or ChatCompletionRequest()
    return reasoning_parser.extract_reasoning(model_output="".join(model_output), request=request)


def run_reasoning_extraction_streaming(reasoning_parser: ReasoningParser, model_deltas: list[str],
                                       request: ChatCompletionRequest | None = None,
                                       ) -> StreamingReasoningReconstructor:
    reconstructor = StreamingReasoningReconstructor()
    previous_text, previous_tokens = "", []
    for delta in model_deltas:
        token_delta = reasoning_parser.model_tokenizer.encode(delta)
        current_text, current_tokens = previous_text + delta, previous_tokens + token_delta
        delta_message = reasoning_parser.extract_reasoning_streaming(
            previous_text, current_text, delta, previous_tokens, current_tokens, token_delta)
        if delta_message is not None:
            reconstructor.append_delta(delta_message)
        previous_text, previous_tokens = current_text, current_tokens
    final = reasoning_parser.finish_streaming(request)
    if final is not None:
        reconstructor.append_delta(final)
    return reconstructor


# ---- tool calls ----

class StreamingToolReconstructor:
    def __init__(self, assert_one_tool_per_delta: bool = True) -> None:
        self.tool_calls: list[ToolCall] = []
        self.other_content: str = ""
        self._assert_one_tool_per_delta = assert_one_tool_per_delta

    def append_delta(self, delta: DeltaMessage) -> None:
        if delta.content is not None:
            self.other_content += delta.content
        else:
            assert delta.tool_calls, "Streaming results should have either content or tool calls (or both)"
        if self._assert_one_tool_per_delta:
            # Not required by the API, but by clients that read one tool call per update.
            assert len(delta.tool_calls) < 2, "Streaming should include only one tool call per update."
        for call_delta in delta.tool_calls:
            self._append_call_delta(call_delta)

    def _append_call_delta(self, call_delta) -> None:
        assert call_delta.type is None or call_delta.type == "function", (
            f"Streaming tool calls should only emit function calls. Got {call_delta.type}")
        current = self.tool_calls[call_delta.index] if call_delta.index < len(self.tool_calls) else None
        if current:
            assert not call_delta.function.name, (
                f"Streaming tool calls should emit the full function name exactly once. Got "
                f"{call_delta.function.name}")
            assert not call_delta.id, f"Streaming tool calls must emit function id only once. Got {call_delta.id}"
            assert call_delta.index == len(self.tool_calls) - 1, (
                f"Incorrect index for tool delta. Got {call_delta.index}, expected {len(self.tool_calls) - 1}")
            current.function.arguments += call_delta.function.arguments
        else:
            assert call_delta.id is not None, "Streaming tool calls must have an id on first appearance"
            assert call_delta.function.name is not None, (
                "Streaming tool calls must have a function name on first appearance")
            assert call_delta.index == len(self.tool_calls), (
                f"Incorrect index for tool delta. Got {call_delta.index}, expected {len(self.tool_calls)}")
            self.tool_calls.append(ToolCall(id=call_delta.id, function=FunctionCall(
                name=call_delta.function.name, arguments=call_delta.function.arguments or "")))


def run_tool_extraction(tool_parser: ToolParser, model_output: str, request: ChatCompletionRequest | None = None,
                        streaming: bool = False,
                        assert_one_tool_per_delta: bool = True) -> tuple[str | None, list[ToolCall]]:
    if streaming:
        reconstructor = run_tool_extraction_streaming(
            tool_parser, model_output, request, assert_one_tool_per_delta=assert_one_tool_per_delta)
        return reconstructor.other_content or None, reconstructor.tool_calls
    extracted = run_tool_extraction_nonstreaming(tool_parser, model_output, request)
    assert extracted.tools_called == bool(extracted.tool_calls)
    return extracted.content, extracted.tool_calls


def run_tool_extraction_nonstreaming(tool_parser: ToolParser, model_output: str,
                                     request: ChatCompletionRequest | None = None) -> ExtractedToolCallInformation:
    return tool_parser.extract_tool_calls(model_output, request or ChatCompletionRequest())


def split_string_into_token_deltas(tokenizer, text: str) -> list[str]:
    """Each token's text, as the difference between the decoded prefixes that end before and after it."""
    token_ids = tokenizer.encode(text)
    previous, deltas = "", []
    for i in range(1, len(token_ids) + 1):
        current = tokenizer.decode(token_ids[:i], skip_special_tokens=False)
        deltas.append(current[len(previous):])
        previous = current
    return deltas


def split_string_into_token_stream(tokenizer, text: str) -> tuple[list[str], list[int]]:
    token_ids = tokenizer.encode(text)
    return split_string_into_token_deltas(tokenizer, text), token_ids


def run_tool_extraction_streaming(tool_parser: ToolParser, model_deltas: str | Iterable[str],
                                  request: ChatCompletionRequest | None = None,
                                  assert_one_tool_per_delta: bool = True) -> StreamingToolReconstructor:
    if isinstance(model_deltas, str):
        model_deltas = split_string_into_token_deltas(tool_parser.model_tokenizer, model_deltas)
    chunks = [(delta, tool_parser.model_tokenizer.encode(delta)) for delta in model_deltas]
    return _stream_tool_chunks(tool_parser, chunks, request, assert_one_tool_per_delta)


def run_tool_extraction_streaming_batched(tool_parser: ToolParser, token_texts: list[str], token_ids: list[int],
                                          lengths: list[int],
                                          assert_one_tool_per_delta: bool = True) -> StreamingToolReconstructor:
    """The token stream sent in deltas of `lengths` tokens each."""
    chunks, start = [], 0
    for length in lengths:
        chunks.append(("".join(token_texts[start:start + length]), token_ids[start:start + length]))
        start += length
    return _stream_tool_chunks(tool_parser, chunks, None, assert_one_tool_per_delta)


def _stream_tool_chunks(tool_parser: ToolParser, chunks: list[tuple[str, list[int]]],
                        request: ChatCompletionRequest | None,
                        assert_one_tool_per_delta: bool) -> StreamingToolReconstructor:
    request = request or ChatCompletionRequest()
    reconstructor = StreamingToolReconstructor(assert_one_tool_per_delta=assert_one_tool_per_delta)
    previous_text, previous_tokens = "", []
    for delta, token_delta in chunks:
        current_text, current_tokens = previous_text + delta, previous_tokens + token_delta
        delta_message = tool_parser.extract_tool_calls_streaming(
            previous_text, current_text, delta, previous_tokens, current_tokens, token_delta, request)
        if delta_message is not None:
            reconstructor.append_delta(delta_message)
        previous_text, previous_tokens = current_text, current_tokens
    final = tool_parser.finish_streaming()
    if final is not None:
        reconstructor.append_delta(final)
    return reconstructor


def two_chunk_groupings(n: int) -> list[list[int]]:
    """Every way to send n tokens in two deltas."""
    return [[k, n - k] for k in range(1, n)]


def random_groupings(n: int, count: int, seed: int, max_chunk: int = 8) -> list[list[int]]:
    """`count` random ways to send n tokens in deltas of 1 to `max_chunk` tokens."""
    rng = random.Random(seed)
    groupings = []
    for _ in range(count):
        lengths, left = [], n
        while left:
            lengths.append(rng.randint(1, min(max_chunk, left)))
            left -= lengths[-1]
        groupings.append(lengths)
    return groupings


def stream_delta_message_generator(tool_parser: ToolParser, tokenizer, model_output: str,
                                   request: ChatCompletionRequest | None = None) -> Iterator[DeltaMessage]:
    """The non-None deltas of `model_output` streamed a token at a time through the server's detokenizer."""
    all_token_ids = tokenizer.encode(model_output)
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    previous_text = ""
    for i, delta_token in enumerate(all_token_ids):
        delta_text = detokenizer.push([delta_token]).text
        current_text = previous_text + delta_text
        delta_message = tool_parser.extract_tool_calls_streaming(
            previous_text, current_text, delta_text, all_token_ids[:i], all_token_ids[:i + 1], [delta_token],
            request=request)
        if delta_message:
            yield delta_message
        previous_text = current_text
    final = tool_parser.finish_streaming()
    if final:
        yield final
