"""vLLM's qwen3 reasoning-parser tests, ported to our qwen3 parser and test tokenizer (SKIPS.md: what is not)."""

import pytest

from jaxhybrid.parsers.reasoning import ReasoningParser, get_reasoning_parser

from .utils import (
    ChatCompletionRequest,
    StreamingReasoningReconstructor,
    run_reasoning_extraction,
    run_reasoning_extraction_streaming,
    token_texts,
)

PARSER_NAMES = ["qwen3"]
start_token = "<think>"
end_token = "</think>"


@pytest.fixture
def qwen3_tokenizer(tokenizer):
    return tokenizer


# --- <think> in prompt, only </think> in output (typical) ---

WITHOUT_START_TOKEN = {
    "output": "This is a reasoning section</think>This is the rest",
    "reasoning": "This is a reasoning section",
    "content": "This is the rest",
}
WITHOUT_START_TOKEN_STREAM = {
    "output": "This is a reasoning section</think>This is the rest",
    "reasoning": "This is a reasoning section",
    "content": "This is the rest",
}
WITHOUT_START_TOKEN_COMPLETE_REASONING = {
    "output": "This is a reasoning section</think>",
    "reasoning": "This is a reasoning section",
    "content": None,
}

# --- <think> present in output (old template / edge case) ---

WITH_THINK = {
    "output": "<think>This is a reasoning section</think>This is the rest",
    "reasoning": "This is a reasoning section",
    "content": "This is the rest",
}
WITH_THINK_STREAM = {
    "output": "<think>This is a reasoning section</think>This is the rest",
    "reasoning": "This is a reasoning section",
    "content": "This is the rest",
}

# --- No think tokens at all (thinking enabled, truncated) ---

# With thinking enabled (default), no think tokens means the output was cut off before </think>: it is all
# reasoning.
WITHOUT_THINK = {
    "output": "This is the rest",
    "reasoning": "This is the rest",
    "content": None,
}
# Streaming cannot tell "thinking disabled" from "reasoning in progress" before a think token: it assumes
# reasoning. The server handles "thinking disabled" by checking the prompt's ids (is_reasoning_end) first.
WITHOUT_THINK_STREAM = {
    "output": "This is the rest",
    "reasoning": "This is the rest",
    "content": None,
}

# --- <tool_call> without </think> (implicit reasoning end) ---

TOOL_CALL_BODY = (
    "<tool_call>\n<function=bash>\n<parameter=command>"
    "\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
)

TOOL_CALL_NO_THINK_END = {
    "output": "I need to read the file.\n\n" + TOOL_CALL_BODY,
    "reasoning": "I need to read the file.\n\n",
    "content": TOOL_CALL_BODY,
}

TOOL_CALL_WITH_THINK_NO_END = {
    "output": "<think>I need to read the file.\n\n" + TOOL_CALL_BODY,
    "reasoning": "I need to read the file.\n\n",
    "content": TOOL_CALL_BODY,
}

# --- Edge cases ---

COMPLETE_REASONING = {
    "output": "<think>This is a reasoning section</think>",
    "reasoning": "This is a reasoning section",
    "content": None,
}
MULTILINE_REASONING = {
    "output": "<think>This is a reasoning\nsection</think>This is the rest\nThat",
    "reasoning": "This is a reasoning\nsection",
    "content": "This is the rest\nThat",
}
# Truncated output: <think> present but no </think> (thinking enabled): all of it is reasoning.
ONLY_OPEN_TAG = {
    "output": "<think>This is a reasoning section",
    "reasoning": "This is a reasoning section",
    "content": None,
}

ONLY_OPEN_TAG_STREAM = {
    "output": "<think>This is a reasoning section",
    "reasoning": "This is a reasoning section",
    "content": None,
}

# Truncated output without <think> (Qwen3.5 style, <think> in the prompt): no </think> means cut off.
TRUNCATED_NO_START_TOKEN = {
    "output": "This is a reasoning section",
    "reasoning": "This is a reasoning section",
    "content": None,
}

TRUNCATED_NO_START_TOKEN_STREAM = {
    "output": "This is a reasoning section",
    "reasoning": "This is a reasoning section",
    "content": None,
}

# (id, the whole output's case, the streamed output's case): each runs both ways, the second with id + "_stream".
CASES = [
    ("without_start_token", WITHOUT_START_TOKEN, WITHOUT_START_TOKEN_STREAM),
    ("without_start_token_complete_reasoning", WITHOUT_START_TOKEN_COMPLETE_REASONING,
     WITHOUT_START_TOKEN_COMPLETE_REASONING),
    ("with_think", WITH_THINK, WITH_THINK_STREAM),
    ("without_think", WITHOUT_THINK, WITHOUT_THINK_STREAM),
    ("complete_reasoning", COMPLETE_REASONING, COMPLETE_REASONING),
    ("multiline_reasoning", MULTILINE_REASONING, MULTILINE_REASONING),
    ("only_open_tag", ONLY_OPEN_TAG, ONLY_OPEN_TAG_STREAM),
    ("truncated_no_start_token", TRUNCATED_NO_START_TOKEN, TRUNCATED_NO_START_TOKEN_STREAM),
    ("tool_call_no_think_end", TOOL_CALL_NO_THINK_END, TOOL_CALL_NO_THINK_END),
    ("tool_call_with_think_no_end", TOOL_CALL_WITH_THINK_NO_END, TOOL_CALL_WITH_THINK_NO_END),
]
TEST_CASES = [pytest.param(streaming, case, id=name + ("_stream" if streaming else ""))
              for name, whole, streamed in CASES for streaming, case in ((False, whole), (True, streamed))]


@pytest.mark.parametrize("streaming, param_dict", TEST_CASES)
@pytest.mark.parametrize("parser_name", PARSER_NAMES)
def test_reasoning(streaming: bool, param_dict: dict, parser_name: str, qwen3_tokenizer):
    output_tokens: list[str] = token_texts(qwen3_tokenizer, param_dict["output"])
    parser: ReasoningParser = get_reasoning_parser(parser_name)(qwen3_tokenizer)

    reasoning, content = run_reasoning_extraction(parser, output_tokens, streaming=streaming)

    assert reasoning == param_dict["reasoning"]
    assert content == param_dict["content"]


# Multi-token deltas, as when one delta carries several tokens (speculative decoding).
MULTI_TOKEN_DELTA_CASES = [
    pytest.param(
        # <think> grouped with following text in one delta
        ["<think>This is a reasoning section", "</think>", "This is the rest"],
        "This is a reasoning section",
        "This is the rest",
        id="start_token_grouped_with_text",
    ),
    pytest.param(
        # </think> grouped with following content in one delta
        ["reasoning section", "</think>This is the rest"],
        "reasoning section",
        "This is the rest",
        id="end_token_grouped_with_content",
    ),
    pytest.param(
        # <think> and </think> in the same delta, no content after
        ["<think>reasoning</think>"],
        "reasoning",
        None,
        id="start_and_end_in_one_delta_no_content",
    ),
    pytest.param(
        # No start token, end grouped with content (Qwen3.5 style)
        ["reasoning section", "</think>content"],
        "reasoning section",
        "content",
        id="no_start_end_grouped_with_content",
    ),
    pytest.param(
        # <tool_call> arrives in a separate delta after reasoning text
        ["I need to read the file.\n\n", "<tool_call>\n<function=bash>"],
        "I need to read the file.\n\n",
        "<tool_call>\n<function=bash>",
        id="tool_call_implicit_reasoning_end",
    ),
]


@pytest.mark.parametrize("deltas, expected_reasoning, expected_content", MULTI_TOKEN_DELTA_CASES)
@pytest.mark.parametrize("parser_name", PARSER_NAMES)
def test_reasoning_streaming_multi_token_deltas(deltas: list[str], expected_reasoning: str | None,
                                                expected_content: str | None, parser_name: str, qwen3_tokenizer):
    """Multi-token deltas don't leak <think> into the reasoning."""
    parser: ReasoningParser = get_reasoning_parser(parser_name)(qwen3_tokenizer)

    reconstructor: StreamingReasoningReconstructor = run_reasoning_extraction_streaming(parser, deltas)

    assert reconstructor.reasoning == expected_reasoning
    assert (reconstructor.other_content or None) == expected_content


# --- enable_thinking=False (thinking explicitly disabled) ---

THINKING_DISABLED_CASES = [
    pytest.param("This is plain content", None, "This is plain content", id="thinking_disabled_plain_content"),
    pytest.param("Some output without think tokens", None, "Some output without think tokens",
                 id="thinking_disabled_no_think_tokens"),
    pytest.param("I need to read the file.\n\n" + TOOL_CALL_BODY, None, "I need to read the file.\n\n" + TOOL_CALL_BODY,
                 id="thinking_disabled_with_tool_call"),
]


@pytest.mark.parametrize("output, expected_reasoning, expected_content", THINKING_DISABLED_CASES)
@pytest.mark.parametrize("parser_name", PARSER_NAMES)
def test_reasoning_thinking_disabled(output: str, expected_reasoning: str | None, expected_content: str | None,
                                     parser_name: str, qwen3_tokenizer):
    """When enable_thinking=False, output without </think> is all content."""
    parser: ReasoningParser = get_reasoning_parser(parser_name)(
        qwen3_tokenizer, chat_template_kwargs={"enable_thinking": False})

    reasoning, content = parser.extract_reasoning(model_output=output, request=ChatCompletionRequest())

    assert reasoning == expected_reasoning
    assert content == expected_content
