"""vLLM's nemotron_v3 reasoning-parser tests, ported to our nemotron_v3 parser (SKIPS.md: what changed)."""

import re
from typing import TypedDict

import pytest

from jaxhybrid.parsers.reasoning import ReasoningParser, get_reasoning_parser

from .utils import ChatCompletionRequest, run_reasoning_extraction

parser_name = "nemotron_v3"


class ReasoningCase(TypedDict):
    output: str
    reasoning: str | None
    content: str | None


class FakeNemotronTokenizer:
    def __init__(self):
        self._vocab = {
            "<think>": 1,
            "</think>": 2,
        }
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._pattern = re.compile(r"(<think>|</think>)")

    def get_vocab(self) -> dict[str, int]:
        return self._vocab

    def tokenize(self, text: str) -> list[str]:
        return [part for part in self._pattern.split(text) if part]

    def encode(self, text: str) -> list[int]:
        """The think markers' ids; other text has none (the streaming driver reads ids through this)."""
        return [self._vocab[token] for token in self.tokenize(text) if token in self._vocab]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def decode(self, token_ids: list[int]) -> str:
        return "".join(self._inv_vocab.get(tid, f"<unk:{tid}>") for tid in token_ids)


@pytest.fixture
def tokenizer():
    return FakeNemotronTokenizer()


@pytest.mark.parametrize(
    "streaming,param_dict",
    [
        pytest.param(streaming, {
            "output": start + "This is a reasoning section</think>This is the rest",
            "reasoning": "This is a reasoning section",
            "content": "This is the rest",
        }, id=name + ("_streaming" if streaming else ""))
        for name, start in (("without_start_token", ""), ("with_start_token", "<think>"))
        for streaming in (False, True)
    ],
)
def test_nemotron_v3_reasoning(tokenizer: FakeNemotronTokenizer, streaming: bool, param_dict: ReasoningCase):
    output = tokenizer.tokenize(param_dict["output"])
    model_output = [tokenizer.convert_tokens_to_string([token]) for token in output]
    parser: ReasoningParser = get_reasoning_parser(parser_name)(tokenizer)

    reasoning, content = run_reasoning_extraction(parser, model_output, streaming=streaming)

    assert reasoning == param_dict["reasoning"]
    assert content == param_dict["content"]


@pytest.mark.parametrize(("chat_template_kwargs", "output", "expected_reasoning", "expected_content"), [
    # No real content followed the reasoning, so the trace is moved into content (reasoning left empty).
    pytest.param({"enable_thinking": False}, "This is plain content", None, "This is plain content",
                 id="without_thinking_moves_into_content"),
    pytest.param({"force_nonempty_content": True}, "<think>This is plain content", None, "This is plain content",
                 id="force_nonempty_content_moves_into_content"),
    # When real content follows the closing tag nothing is promoted: the content after </think> is returned
    # as-is and reasoning stays separate.
    pytest.param({"force_nonempty_content": True}, "<think>reasoning here</think>real answer", "reasoning here",
                 "real answer", id="force_nonempty_keeps_real_content"),
    pytest.param({"enable_thinking": True}, "This is truncated reasoning", "This is truncated reasoning", None,
                 id="with_thinking_keeps_truncated_reasoning"),
])
def test_nemotron_v3_request_kwargs(tokenizer: FakeNemotronTokenizer, chat_template_kwargs, output,
                                    expected_reasoning, expected_content):
    parser = get_reasoning_parser(parser_name)(tokenizer)
    request = ChatCompletionRequest(model="test-model", messages=[], chat_template_kwargs=chat_template_kwargs)

    reasoning, content = run_reasoning_extraction(parser, [output], request=request, streaming=False)

    assert reasoning == expected_reasoning
    assert content == expected_content


def _run_parse_delta(parser, tokenizer, text, request):
    """Stream `text` a token at a time, then end the stream, as the server does; (reasoning, content)."""
    reasoning_parts: list[str] = []
    content_parts: list[str] = []
    deltas = [parser.extract_reasoning_streaming("", "", token, [], [], tokenizer.encode(token))
              for token in tokenizer.tokenize(text)]
    for delta in [*deltas, parser.finish_streaming(request)]:
        if delta is None:
            continue
        if delta.reasoning:
            reasoning_parts.append(delta.reasoning)
        if delta.content:
            content_parts.append(delta.content)
    return "".join(reasoning_parts), "".join(content_parts)


@pytest.mark.parametrize(("chat_template_kwargs", "text", "expected_reasoning", "expected_content"), [
    # Model never closes <think>: reasoning streams normally AND is duplicated into content on the last delta.
    pytest.param({"force_nonempty_content": True}, "<think>4", "4", "4", id="promotes_reasoning_to_content"),
    # Real content followed </think>, so nothing is duplicated.
    pytest.param({"force_nonempty_content": True}, "<think>reason</think>real answer", "reason", "real answer",
                 id="no_promotion_with_real_content"),
    # Without enable_thinking=False / force_nonempty_content the fallback stays off: reasoning only.
    pytest.param(None, "<think>4", "4", "", id="no_promotion_without_opt_in"),
])
def test_nemotron_v3_streaming(tokenizer: FakeNemotronTokenizer, chat_template_kwargs, text, expected_reasoning,
                               expected_content):
    request = ChatCompletionRequest(model="test-model", messages=[], chat_template_kwargs=chat_template_kwargs)
    parser = get_reasoning_parser(parser_name)(tokenizer)

    reasoning, content = _run_parse_delta(parser, tokenizer, text, request)

    assert reasoning == expected_reasoning
    assert content == expected_content
