"""vLLM's qwen3_coder tool-parser tests, ported to our qwen3_coder parser (vLLM's coder and engine
parsers are both it: qwen3_coder and qwen3_xml name it) and test tokenizer."""

import json

import pytest

from jaxhybrid.parsers.messages import FunctionCall, ToolCall
from jaxhybrid.parsers.tools import get_tool_parser

from .utils import (
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    FunctionTool,
    run_tool_extraction_streaming,
    stream_delta_message_generator,
)

MODEL = "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"
Qwen3CoderToolParser = get_tool_parser("qwen3_coder")


@pytest.fixture
def qwen3_tokenizer(tokenizer):
    return tokenizer


@pytest.fixture
def qwen3_tool_parser(qwen3_tokenizer, sample_tools):
    return Qwen3CoderToolParser(qwen3_tokenizer, tools=sample_tools)


@pytest.fixture
def qwen3_engine_tool_parser(qwen3_tokenizer, sample_tools):
    return get_tool_parser("qwen3_xml")(qwen3_tokenizer, tools=sample_tools)


@pytest.fixture(params=["coder", "engine"])
def qwen3_tool_parser_parametrized(qwen3_tool_parser, qwen3_engine_tool_parser, request):
    return qwen3_tool_parser if request.param == "coder" else qwen3_engine_tool_parser


WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city name"},
        "state": {"type": "string", "description": "The state code"},
        "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]},
    },
    "required": ["city", "state"],
}

AREA_PARAMS = {
    "type": "object",
    "properties": {
        "shape": {"type": "string"},
        "dimensions": {"type": "object"},
        "precision": {"type": "integer"},
    },
}


@pytest.fixture(params=["chat_completion", "responses_api"])
def sample_tools(request):
    if request.param == "chat_completion":
        return [
            ChatCompletionToolsParam(type="function", function={
                "name": "get_current_weather", "description": "Get the current weather", "parameters": WEATHER_PARAMS}),
            ChatCompletionToolsParam(type="function", function={
                "name": "calculate_area", "description": "Calculate area of a shape", "parameters": AREA_PARAMS}),
        ]
    return [
        FunctionTool(type="function", name="get_current_weather", description="Get the current weather",
                     parameters=WEATHER_PARAMS),
        FunctionTool(type="function", name="calculate_area", description="Calculate area of a shape",
                     parameters=AREA_PARAMS),
    ]


def assert_tool_calls(actual_tool_calls: list[ToolCall], expected_tool_calls: list[ToolCall]):
    assert len(actual_tool_calls) == len(expected_tool_calls)

    for actual_tool_call, expected_tool_call in zip(actual_tool_calls, expected_tool_calls, strict=True):
        assert actual_tool_call.type == "function"
        assert actual_tool_call.function.name == expected_tool_call.function.name
        assert json.loads(actual_tool_call.function.arguments) == json.loads(expected_tool_call.function.arguments)


def _weather(city: str, state: str, unit: str) -> ToolCall:
    return ToolCall(function=FunctionCall(name="get_current_weather",
                                          arguments=json.dumps({"city": city, "state": state, "unit": unit})))


def _area(shape: str, dimensions: dict, precision: int) -> ToolCall:
    return ToolCall(function=FunctionCall(name="calculate_area", arguments=json.dumps(
        {"shape": shape, "dimensions": dimensions, "precision": precision})))


def _tools(name: str, properties: dict) -> list:
    return [ChatCompletionToolsParam(type="function", function={"name": name, "parameters": {
        "type": "object", "properties": properties}})]


def _call(function: str, parameters: str) -> str:
    return f"<tool_call>\n<function={function}>\n{parameters}</function>\n</tool_call>"


def _wrapped_parameters(values: dict[str, str]) -> str:
    """Parameters as the model writes them, each value on lines of its own."""
    return "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())


def _only_call_arguments(parser, model_output: str, tools: list) -> str:
    """The arguments of the one call in `model_output`, extracted for a request with `tools`."""
    request = ChatCompletionRequest(model=MODEL, messages=[], tools=tools)
    result = parser.extract_tool_calls(model_output, request=request)

    assert result.tools_called
    assert len(result.tool_calls) == 1
    return result.tool_calls[0].function.arguments


WEATHER_DALLAS = _call("get_current_weather", _wrapped_parameters({"city": "Dallas", "state": "TX",
                                                                  "unit": "fahrenheit"}))
AREA_RECTANGLE = _call("calculate_area", _wrapped_parameters({"shape": "rectangle",
                                                              "dimensions": '{"width": 10, \n "height": 20}',
                                                              "precision": "2"}))
AREA_CIRCLE = "Let me calculate that area for you." + _call("calculate_area", _wrapped_parameters(
    {"shape": "circle", "dimensions": '{"radius": 15.5}', "precision": "3"}))


def _weather_orlando(unit: str) -> str:
    return WEATHER_DALLAS.replace("Dallas", "Orlando").replace("TX", "FL").replace("fahrenheit", unit)


def _extract_cases(orlando_unit: str) -> list:
    """(model_output, expected_tool_calls, expected_content) cases; the second of the parallel calls asks for
    Orlando's weather in `orlando_unit`."""
    dallas = _weather("Dallas", "TX", "fahrenheit")
    return [
        pytest.param(WEATHER_DALLAS, [dallas], None, id="single_tool"),
        pytest.param("Sure! Let me check the weather for you." + WEATHER_DALLAS, [dallas],
                     "Sure! Let me check the weather for you.", id="single_tool_with_content"),
        pytest.param(AREA_RECTANGLE, [_area("rectangle", {"width": 10, "height": 20}, 2)], None,
                     id="single_tool_multiline_param"),
        pytest.param(WEATHER_DALLAS + "\n" + _weather_orlando(orlando_unit),
                     [dallas, _weather("Orlando", "FL", orlando_unit)], None, id="parallel_tools"),
        pytest.param(AREA_CIRCLE, [_area("circle", {"radius": 15.5}, 3)], "Let me calculate that area for you.",
                     id="tool_with_typed_params"),
    ]


def test_extract_tool_calls_no_tools(qwen3_tool_parser_parametrized):
    model_output = "This is a test response without any tool calls"
    extracted_tool_calls = qwen3_tool_parser_parametrized.extract_tool_calls(model_output, request=None)
    assert not extracted_tool_calls.tools_called
    assert extracted_tool_calls.tool_calls == []
    assert extracted_tool_calls.content == model_output


@pytest.mark.parametrize(["model_output", "expected_tool_calls", "expected_content"], _extract_cases("fahrenheit"))
def test_extract_tool_calls(qwen3_tool_parser_parametrized, model_output, expected_tool_calls, expected_content):
    request = ChatCompletionRequest(model=MODEL, messages=[])
    extracted_tool_calls = qwen3_tool_parser_parametrized.extract_tool_calls(model_output, request=request)
    assert extracted_tool_calls.tools_called

    assert_tool_calls(extracted_tool_calls.tool_calls, expected_tool_calls)

    assert extracted_tool_calls.content == expected_content


def test_extract_tool_calls_fallback_no_tags(qwen3_tool_parser_parametrized):
    """Test fallback parsing when XML tags are missing"""
    model_output = """<function=get_current_weather>
<parameter=city>
Dallas
</parameter>
<parameter=state>
TX
</parameter>
</function>"""

    request = ChatCompletionRequest(model=MODEL, messages=[])
    extracted_tool_calls = qwen3_tool_parser_parametrized.extract_tool_calls(model_output, request=request)

    assert extracted_tool_calls.tools_called
    assert len(extracted_tool_calls.tool_calls) == 1
    assert extracted_tool_calls.tool_calls[0].function.name == "get_current_weather"


def test_extract_tool_calls_type_conversion(qwen3_tokenizer):
    """Test parameter type conversion based on tool schema"""
    tools = _tools("test_types", {
        "int_param": {"type": "integer"},
        "float_param": {"type": "float"},
        "bool_param": {"type": "boolean"},
        "str_param": {"type": "string"},
        "obj_param": {"type": "object"},
    })
    model_output = _call("test_types", _wrapped_parameters({
        "int_param": "42", "float_param": "3.14", "bool_param": "true", "str_param": "hello world",
        "obj_param": '{"key": "value"}'}))

    parser = Qwen3CoderToolParser(qwen3_tokenizer, tools=tools)
    args = json.loads(_only_call_arguments(parser, model_output, tools))
    assert args["int_param"] == 42
    assert args["float_param"] == 3.14
    assert args["bool_param"] is True
    assert args["str_param"] == "hello world"
    assert args["obj_param"] == {"key": "value"}


def test_extract_tool_calls_anyof_type_conversion(qwen3_tokenizer):
    """anyOf/oneOf nullable schemas (Pydantic v2 writes Optional[int] as anyOf [integer, null]): the non-null
    type is the one the value converts to, not a raw string."""
    tools = _tools("test_anyof", {
        "anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
        "anyof_str": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "type_as_array": {"type": ["integer", "null"]},
        "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    })
    model_output = _call("test_anyof", _wrapped_parameters({
        "anyof_int": "5", "anyof_str": "hello", "anyof_array": '["a", "b", "c"]', "anyof_obj": '{"key": "value"}',
        "type_as_array": "42", "multi_non_null": "some text"}))

    parser = Qwen3CoderToolParser(qwen3_tokenizer, tools=tools)
    args = json.loads(_only_call_arguments(parser, model_output, tools))
    assert args["anyof_int"] == 5
    assert isinstance(args["anyof_int"], int)
    assert args["anyof_str"] == "hello"
    assert isinstance(args["anyof_str"], str)
    assert args["anyof_array"] == ["a", "b", "c"]
    assert isinstance(args["anyof_array"], list)
    assert args["anyof_obj"] == {"key": "value"}
    assert isinstance(args["anyof_obj"], dict)
    assert args["type_as_array"] == 42
    assert isinstance(args["type_as_array"], int)
    # Multi non-null: anyOf[string, integer, null] -> "some text" reads as no integer, so it is a string
    assert args["multi_non_null"] == "some text"
    assert isinstance(args["multi_non_null"], str)


def _accumulate(delta_messages) -> tuple[str, dict]:
    """The content and per-index tool states ({id, name, arguments, type}) of a stream's deltas."""
    other_content, tool_states = "", {}
    for delta_message in delta_messages:
        if delta_message.content:
            other_content += delta_message.content
        for tool_call in delta_message.tool_calls or []:
            state = tool_states.setdefault(tool_call.index, {"id": None, "name": None, "arguments": "", "type": None})
            if tool_call.id:
                state["id"] = tool_call.id
            if tool_call.type:
                assert tool_call.type == "function"
                state["type"] = tool_call.type
            if tool_call.function:
                if tool_call.function.name:
                    # Should only be set once
                    assert state["name"] is None
                    state["name"] = tool_call.function.name
                if tool_call.function.arguments is not None:
                    state["arguments"] += tool_call.function.arguments
    return other_content, tool_states


def test_extract_tool_calls_anyof_type_conversion_streaming(qwen3_tokenizer):
    """The streaming pipeline (tokenize, detokenize incrementally, extract_tool_calls_streaming) types values by
    anyOf schemas too and produces valid JSON."""
    tools = _tools("search_web", {
        "query": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "count": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
        "verbose": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    })
    model_output = _call("search_web", _wrapped_parameters({"query": "vllm tool parser", "count": "10",
                                                            "verbose": "true"}))

    parser = Qwen3CoderToolParser(qwen3_tokenizer, tools=tools)
    request = ChatCompletionRequest(model=MODEL, messages=[], tools=tools)

    _, tool_states = _accumulate(stream_delta_message_generator(parser, qwen3_tokenizer, model_output, request))

    assert len(tool_states) == 1
    assert tool_states[0]["name"] == "search_web"
    assert tool_states[0]["arguments"] is not None
    args = json.loads(tool_states[0]["arguments"])
    assert args["query"] == "vllm tool parser"
    assert isinstance(args["query"], str)
    assert args["count"] == 10
    assert isinstance(args["count"], int)
    assert args["verbose"] is True
    assert isinstance(args["verbose"], bool)


@pytest.mark.parametrize(["model_output", "expected_tool_calls", "expected_content"], [
    pytest.param("This is a test without tools", [], "This is a test without tools", id="no_tools"),
    *_extract_cases("celsius"),
])
def test_extract_tool_calls_streaming(qwen3_tool_parser_parametrized, qwen3_tokenizer, model_output,
                                      expected_tool_calls, expected_content):
    """Test incremental streaming behavior including typed parameters"""
    request = ChatCompletionRequest(model=MODEL, messages=[])

    deltas = list(stream_delta_message_generator(qwen3_tool_parser_parametrized, qwen3_tokenizer, model_output,
                                                 request))
    for delta_message in deltas:
        # role should never be streamed from tool parser
        assert not delta_message.role
    other_content, tool_states = _accumulate(deltas)

    assert other_content == (expected_content or "")
    assert len(tool_states) == len(expected_tool_calls)

    for idx, expected_tool in enumerate(expected_tool_calls):
        state = tool_states[idx]
        assert state["id"] is not None
        assert state["type"] == "function"
        assert state["name"] == expected_tool.function.name

        arguments_str = state["arguments"]
        assert arguments_str is not None
        assert json.loads(arguments_str) == json.loads(expected_tool.function.arguments)


def _assert_streamed_dallas_weather(tool_states: dict) -> None:
    """The stream held one call: Dallas' weather in fahrenheit."""
    assert len(tool_states) == 1

    state = tool_states[0]
    assert state["id"] is not None
    assert state["type"] == "function"
    assert state["name"] == "get_current_weather"

    assert state["arguments"] is not None
    args = json.loads(state["arguments"])
    assert args["city"] == "Dallas"
    assert args["state"] == "TX"
    assert args["unit"] == "fahrenheit"


MISSING_CLOSING_PARAMETER = """Let me check the weather for you:
<tool_call>
<function=get_current_weather>
<parameter=city>
Dallas
<parameter=state>
TX
</parameter>
<parameter=unit>
fahrenheit
</parameter>
</function>
</tool_call>"""


def test_extract_tool_calls_missing_closing_parameter_tag(qwen3_tool_parser_parametrized):
    """Test handling of missing closing </parameter> tag"""
    request = ChatCompletionRequest(model=MODEL, messages=[])
    extracted_tool_calls = qwen3_tool_parser_parametrized.extract_tool_calls(MISSING_CLOSING_PARAMETER,
                                                                             request=request)

    assert extracted_tool_calls.tools_called
    assert len(extracted_tool_calls.tool_calls) == 1
    assert extracted_tool_calls.tool_calls[0].function.name == "get_current_weather"

    args = json.loads(extracted_tool_calls.tool_calls[0].function.arguments)
    assert "city" in args
    assert args["city"] == "Dallas"
    assert args["state"] == "TX"
    assert args["unit"] == "fahrenheit"

    # Check that content before the tool call is preserved
    assert "Let me check the weather for you:" in extracted_tool_calls.content


def test_extract_tool_calls_streaming_missing_closing_tag(qwen3_tool_parser_parametrized, qwen3_tokenizer):
    """Test streaming with missing closing </parameter> tag"""
    request = ChatCompletionRequest(model=MODEL, messages=[])
    other_content, tool_states = _accumulate(stream_delta_message_generator(
        qwen3_tool_parser_parametrized, qwen3_tokenizer, MISSING_CLOSING_PARAMETER, request))

    assert "Let me check the weather for you:" in other_content
    _assert_streamed_dallas_weather(tool_states)


def test_extract_tool_calls_streaming_incremental(qwen3_tool_parser_parametrized, qwen3_tokenizer):
    """Test that streaming is truly incremental"""
    model_output = """I'll check the weather.<tool_call>
<function=get_current_weather>
<parameter=city>
Dallas
</parameter>
<parameter=state>
TX
</parameter>
</function>
</tool_call>"""

    request = ChatCompletionRequest(model=MODEL, messages=[])
    chunks = list(stream_delta_message_generator(qwen3_tool_parser_parametrized, qwen3_tokenizer, model_output,
                                                 request))

    assert len(chunks) > 3

    # First chunk(s) should be content
    assert chunks[0].content is not None
    assert chunks[0].tool_calls is None or chunks[0].tool_calls == []

    # Should have a chunk with tool header (id, name, type)
    header = next(chunk for chunk in chunks if chunk.tool_calls and chunk.tool_calls[0].id)
    assert header.tool_calls[0].function.name == "get_current_weather"
    assert header.tool_calls[0].type == "function"

    arg_chunks = [chunk.tool_calls[0].function.arguments for chunk in chunks
                  if chunk.tool_calls and chunk.tool_calls[0].function and chunk.tool_calls[0].function.arguments]
    assert len(arg_chunks) >= 1

    parsed_args = json.loads("".join(arg_chunks))
    assert parsed_args["city"] == "Dallas"
    assert parsed_args["state"] == "TX"


def test_extract_tool_calls_streaming_missing_opening_tag(qwen3_engine_tool_parser, qwen3_tokenizer):
    """A tool call that starts directly with <function=...> streams too."""
    model_output = "I'll check the weather for you.\n\n" + WEATHER_DALLAS.removeprefix("<tool_call>\n")

    request = ChatCompletionRequest(model=MODEL, messages=[])
    other_content, tool_states = _accumulate(stream_delta_message_generator(
        qwen3_engine_tool_parser, qwen3_tokenizer, model_output, request))

    assert "I'll check the weather for you." in other_content
    _assert_streamed_dallas_weather(tool_states)


def test_malformed_xml_no_gt_delimiter(qwen3_tool_parser):
    """Regression: malformed XML without '>' must not crash (PR #36774)."""
    model_output = ("<tool_call>\n<function=get_current_weather\n"
                    "<parameter=city>Dallas</parameter>\n</function>\n</tool_call>")

    request = ChatCompletionRequest(model=MODEL, messages=[])
    result = qwen3_tool_parser.extract_tool_calls(model_output, request=request)
    assert result is not None
    assert isinstance(result.tool_calls, list)
    assert all(tc is not None for tc in result.tool_calls)


def test_none_tool_calls_filtered(qwen3_tool_parser):
    """Regression: None tool calls filtered from output (PR #36774)."""
    model_output = ("<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n" + _call(
        "get_current_weather", "<parameter=city>Dallas</parameter>\n<parameter=state>TX</parameter>\n"))

    request = ChatCompletionRequest(model=MODEL, messages=[])
    result = qwen3_tool_parser.extract_tool_calls(model_output, request=request)
    assert all(tc is not None for tc in result.tool_calls)
    assert result.tools_called
    valid = [tc for tc in result.tool_calls if tc.function.name == "get_current_weather"]
    assert len(valid) == 1
    args = json.loads(valid[0].function.arguments)
    assert args["city"] == "Dallas"
    assert args["state"] == "TX"


def test_anyof_parameter_not_double_encoded(qwen3_tokenizer):
    """Regression: anyOf parameters must not be double-encoded (PR #36032)."""
    tools = _tools("update_record", {"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}})

    parser = Qwen3CoderToolParser(qwen3_tokenizer, tools=tools)

    model_output = _call("update_record", '<parameter=data>{"key": "value", "count": 42}</parameter>\n')

    args = json.loads(_only_call_arguments(parser, model_output, tools))
    assert isinstance(args["data"], dict)
    assert args["data"] == {"key": "value", "count": 42}


def test_streaming_multi_param_single_chunk(qwen3_tool_parser):
    """Regression: speculative decode delivering multiple params at once (PR #35615)."""
    request = ChatCompletionRequest(model=MODEL, messages=[])

    deltas = [
        "<tool_call>",
        "\n<function=get_current_weather>",
        "\n",
        # This single delta delivers all three parameters at once
        "<parameter=city>\nDallas\n</parameter>"
        "\n<parameter=state>\nTX\n</parameter>"
        "\n<parameter=unit>\nfahrenheit\n</parameter>",
        "\n</function>",
        "\n</tool_call>",
    ]

    reconstructor = run_tool_extraction_streaming(qwen3_tool_parser, deltas, request,
                                                  assert_one_tool_per_delta=False)

    assert len(reconstructor.tool_calls) == 1
    args = json.loads(reconstructor.tool_calls[0].function.arguments)
    assert args["city"] == "Dallas"
    assert args["state"] == "TX"
    assert args["unit"] == "fahrenheit"


def test_no_double_serialization_string_args(qwen3_tool_parser):
    """Regression: string arguments must not be double-serialized (PR #35615)."""
    tools = _tools("greet", {"message": {"type": "string"}})

    model_output = _call("greet", "<parameter=message>hello world</parameter>\n")

    raw_arguments = _only_call_arguments(qwen3_tool_parser, model_output, tools)
    args = json.loads(raw_arguments)
    assert args["message"] == "hello world"
    assert '\\"hello world\\"' not in raw_arguments
