"""Our parsers' own surface beyond vLLM's tests: the registries, what the server reads from token ids, the
message types, and a parser reused for a second stream."""

import re

import pytest

from jaxhybrid.parsers.messages import ChatTool, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from jaxhybrid.parsers.reasoning import REASONING_PARSERS, get_reasoning_parser
from jaxhybrid.parsers.tools import TOOL_PARSERS, get_tool_parser


@pytest.mark.parametrize(("get", "registry"), [(get_reasoning_parser, REASONING_PARSERS),
                                               (get_tool_parser, TOOL_PARSERS)])
def test_an_unknown_name_is_refused_with_the_valid_ones(get, registry):
    with pytest.raises(ValueError) as error:
        get("no_such_parser")
    assert all(name in str(error.value) for name in registry)


def test_qwen3_coder_and_qwen3_xml_are_one_parser():
    assert TOOL_PARSERS["qwen3_coder"] is TOOL_PARSERS["qwen3_xml"]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_tokenizer_without_the_think_tokens_is_refused(name):
    class NoThink:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    with pytest.raises(ValueError, match="</?think>"):
        get_reasoning_parser(name)(NoThink())


@pytest.mark.parametrize(("text", "thinking", "ended"), [
    ("<|im_start|>assistant\n<think>\n", True, False),  # the template opened the reasoning
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True, True),  # ... and closed it (thinking off)
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", True, False),  # an earlier turn's end is not ours
    ("<|im_start|>assistant\n", False, True),  # thinking off: nothing to wait for
    ("I will look it up.\n<tool_call>", True, True),  # a tool call ends it too
])
def test_qwen3_tells_from_ids_whether_the_reasoning_has_ended(tokenizer, text, thinking, ended):
    parser = get_reasoning_parser("qwen3")(tokenizer, chat_template_kwargs={"enable_thinking": thinking})
    assert parser.is_reasoning_end(tokenizer.encode(text)) is ended


@pytest.mark.parametrize(("text", "thinking", "content"), [
    ("a</think>b</think>c", True, "c"),  # after the last end
    ("a\n<tool_call>{}", True, "<tool_call>{}"),  # the tool call is content
    ("a</think>b", False, "a</think>b"),  # thinking off: all of it
])
def test_qwen3_content_ids(tokenizer, text, thinking, content):
    parser = get_reasoning_parser("qwen3")(tokenizer, chat_template_kwargs={"enable_thinking": thinking})
    assert parser.extract_content_ids(tokenizer.encode(text)) == tokenizer.encode(content)


def test_a_delta_without_tool_calls_serializes_without_the_key():
    assert DeltaMessage(content="x").model_dump() == {"role": None, "content": "x", "reasoning": None}
    part = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments="{}"))
    assert DeltaMessage(tool_calls=[part]).model_dump(exclude_none=True) == {
        "tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert DeltaMessage(reasoning="r").reasoning_content == "r"


def test_a_tool_in_the_responses_shape_reads_as_a_chat_tool():
    flat = ChatTool(type="function", name="f", description="d", parameters={"type": "object"})
    assert flat == ChatTool(type="function", function={"name": "f", "description": "d",
                                                       "parameters": {"type": "object"}})


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_a_tool_parser_streams_again_after_finishing(tokenizer, name):
    output = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>' if name == "hermes"
              else "<tool_call>\n<function=f>\n</function>\n</tool_call>")
    parser = get_tool_parser(name)(tokenizer)
    for _ in range(2):
        first = parser.extract_tool_calls_streaming("", output, output, [], [], [], None)
        parser.finish_streaming()
        (part,) = first.tool_calls
        assert (part.index, part.function.name, part.function.arguments) == (0, "f", "{}")
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", part.id)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_a_reasoning_parser_streams_again_after_finishing(tokenizer, name):
    parser = get_reasoning_parser(name)(tokenizer)
    for _ in range(2):
        delta = parser.extract_reasoning_streaming("", "", "a</think>b", [], [], [])
        assert parser.finish_streaming() is None
        assert (delta.reasoning, delta.content) == ("a", "b")
