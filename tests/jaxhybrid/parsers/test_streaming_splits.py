"""Property: an output streamed in deltas cut anywhere (a marker split across deltas included) gives what the
same output gives whole: the streamed reasoning, content and each tool call's argument pieces concatenate to
the non-streamed strings, for every parser."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.parsers.messages import ChatTool, DeltaMessage
from jaxhybrid.parsers.reasoning import get_reasoning_parser
from jaxhybrid.parsers.tools import get_tool_parser

from .utils import ChatCompletionRequest

MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=",
           "</parameter>")
# Texts made of the markers' own characters, so that partial markers turn up, but never a whole one.
TEXT = st.text(alphabet="ab <>/=_{}\"\\\n", max_size=12).filter(lambda text: not any(m in text for m in MARKERS))


def _deltas(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _stream_reasoning(parser, deltas: list[str]) -> tuple[str, str]:
    messages = [parser.extract_reasoning_streaming("", "", delta, [], [], []) for delta in deltas]
    messages.append(parser.finish_streaming(None))
    messages = [m for m in messages if m is not None]
    return "".join(m.reasoning or "" for m in messages), "".join(m.content or "" for m in messages)


@pytest.mark.parametrize("name", ["deepseek_r1", "nemotron_v3", "qwen3"])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streamed_reasoning_is_the_whole_outputs(tokenizer, name: str, data: st.DataObject):
    ends = ["", "</think>"] + (["<tool_call>"] if name != "deepseek_r1" else [])
    output = (data.draw(st.sampled_from(["", "<think>"])) + data.draw(TEXT) + data.draw(st.sampled_from(ends))
              + data.draw(TEXT))
    reasoning, content = get_reasoning_parser(name)(tokenizer).extract_reasoning(output, None)

    streamed = _stream_reasoning(get_reasoning_parser(name)(tokenizer), _deltas(data, output))

    assert streamed == (reasoning or "", content or "")


def _stream_tool_calls(parser, deltas: list[str], request) -> tuple[str, list[tuple[str, str]]]:
    messages: list[DeltaMessage | None] = [
        parser.extract_tool_calls_streaming("", "", delta, [], [], [], request) for delta in deltas]
    messages.append(parser.finish_streaming())
    content, calls = "", {}
    for message in filter(None, messages):
        content += message.content or ""
        for part in message.tool_calls:
            name, arguments = calls.get(part.index, ("", ""))
            calls[part.index] = (name + (part.function.name or ""), arguments + (part.function.arguments or ""))
    return content, [calls[index] for index in sorted(calls)]


def _assert_streams_as_whole(parser_name: str, tokenizer, output: str, data: st.DataObject, request=None):
    whole = get_tool_parser(parser_name)(tokenizer).extract_tool_calls(output, request)
    streamed = _stream_tool_calls(get_tool_parser(parser_name)(tokenizer), _deltas(data, output), request)
    calls = [(call.function.name, call.function.arguments) for call in whole.tool_calls]
    assert streamed == ((whole.content or "") if whole.tools_called else output, calls)
    for _, arguments in calls:
        json.loads(arguments)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=6)


@st.composite
def _hermes_call(draw: st.DrawFn) -> str:
    arguments = draw(st.dictionaries(TEXT, JSON_VALUES, max_size=3))
    if draw(st.booleans()):  # some models serialize the arguments themselves
        arguments = json.dumps(arguments)
    call = {"name": draw(st.sampled_from(["get_weather", "f"])), "arguments": arguments}
    separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    body = json.dumps(call, separators=separators, indent=draw(st.sampled_from([None, 2])), ensure_ascii=False)
    return "<tool_call>" + draw(st.sampled_from(["", "\n"])) + body + draw(st.sampled_from(["", "\n"])) + "</tool_call>"


@settings(max_examples=200, deadline=None)
@given(data=st.data(), before=TEXT, calls=st.lists(_hermes_call(), max_size=3), between=st.sampled_from(["", "\n"]))
def test_streamed_hermes_calls_are_the_whole_outputs(tokenizer, data, before: str, calls: list[str], between: str):
    _assert_streams_as_whole("hermes", tokenizer, before + between.join(calls), data)


XML_TOOLS = [ChatTool(type="function", function={"name": "typed", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "flag": {"type": "boolean"},
    "obj": {"type": "object"}, "s": {"type": "string"}}}})]
XML_VALUES = {"n": st.integers(-99, 99).map(str), "x": st.sampled_from(["1.5", "null", "2", "oops"]),
              "flag": st.sampled_from(["true", "false", "maybe"]),
              "obj": st.dictionaries(TEXT, st.integers(0, 9), max_size=2).map(json.dumps), "s": TEXT, "untyped": TEXT}


@st.composite
def _xml_call(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(["typed", "other"]))
    keys = draw(st.lists(st.sampled_from(sorted(XML_VALUES)), max_size=4))
    newline = st.sampled_from(["", "\n"])
    params = "".join(f"<parameter={key}>{draw(newline)}{draw(XML_VALUES[key])}{draw(newline)}</parameter>\n"
                     for key in keys)
    call = f"<function={name}>\n{params}</function>"
    return call if draw(st.booleans()) else f"<tool_call>\n{call}\n</tool_call>"


@pytest.mark.parametrize("with_tools", [False, True])
@settings(max_examples=200, deadline=None)
@given(data=st.data(), texts=st.lists(TEXT, min_size=3, max_size=3), calls=st.lists(_xml_call(), max_size=3))
def test_streamed_xml_calls_are_the_whole_outputs(tokenizer, with_tools: bool, data, texts: list[str],
                                                  calls: list[str]):
    before, between, after = texts
    request = ChatCompletionRequest(tools=XML_TOOLS if with_tools else None)
    _assert_streams_as_whole("qwen3_xml", tokenizer, before + between.join(calls) + after, data, request)
