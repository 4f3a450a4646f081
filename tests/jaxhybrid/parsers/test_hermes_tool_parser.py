"""vLLM's hermes tool-parser tests, ported to our hermes parser and test tokenizer (SKIPS.md: what is not)."""

import json

import pytest

from jaxhybrid.parsers.tools import ToolParser, get_tool_parser

from .utils import ChatCompletionRequest

Hermes2ProToolParser = get_tool_parser("hermes")


@pytest.fixture
def qwen_tokenizer(tokenizer):
    return tokenizer


@pytest.fixture
def hermes_parser(qwen_tokenizer) -> ToolParser:
    return Hermes2ProToolParser(qwen_tokenizer)


@pytest.fixture
def any_chat_request() -> ChatCompletionRequest:
    return ChatCompletionRequest(model="Qwen/Qwen3-32B", messages=[])


def _each_token(tokenizer, parser: ToolParser, request: ChatCompletionRequest, text: str) -> list:
    """The parser's answer to each token of `text`, decoded on its own and sent without ids."""
    previous_text = ""
    delta_messages = []
    for token in tokenizer.encode(text):
        delta_text = tokenizer.decode([token])
        current_text = previous_text + delta_text
        delta_messages.append(parser.extract_tool_calls_streaming(
            previous_text=previous_text, current_text=current_text, delta_text=delta_text, previous_token_ids=[],
            current_token_ids=[], delta_token_ids=[], request=request))
        previous_text = current_text
    return delta_messages


def test_hermes_parser_streaming_just_forward_text(qwen_tokenizer, hermes_parser, any_chat_request) -> None:
    text = """This is some prior text that has nothing to do with tool calling."""
    delta_messages = _each_token(qwen_tokenizer, hermes_parser, any_chat_request, text)

    for delta in delta_messages:
        assert delta is not None
        assert not delta.tool_calls

    assert "".join([delta.content for delta in delta_messages]) == text


def test_hermes_parser_streaming_failure_case_bug_19056(qwen_tokenizer, hermes_parser, any_chat_request) -> None:
    text = """<tool_call>
{"name": "final_answer", "arguments": {"trigger": true}}
</tool_call>"""
    delta_messages = [d for d in _each_token(qwen_tokenizer, hermes_parser, any_chat_request, text) if d is not None]

    assert delta_messages[0].tool_calls[0].function.name == "final_answer"
    tool_call_args = "".join(delta.tool_calls[0].function.arguments or "" for delta in delta_messages)
    assert tool_call_args == '{"trigger": true}'


def test_hermes_parser_streaming(qwen_tokenizer, hermes_parser, any_chat_request) -> None:
    text = '<tool_call>\
{"name": "get_current_temperature",\
"arguments": {"location":\
"San Francisco, California, United States", "unit": "celsius"}}\
</tool_call>'

    delta_messages = [d for d in _each_token(qwen_tokenizer, hermes_parser, any_chat_request, text) if d is not None]
    assert delta_messages[0].tool_calls[0].function.name == "get_current_temperature"
    # load to normalize whitespace
    tool_call_args = json.loads("".join(delta.tool_calls[0].function.arguments or "" for delta in delta_messages))
    assert tool_call_args == {"location": "San Francisco, California, United States", "unit": "celsius"}


def _simulate_streaming(tokenizer, parser: ToolParser, request: ChatCompletionRequest, text: str,
                        stream_interval: int = 1) -> list:
    """Tokens batched into chunks of `stream_interval` tokens, as the output processor delivers them; the
    non-None deltas (the stream's last one included)."""
    tokens = tokenizer.encode(text)
    previous_text = ""
    delta_messages = []
    for i in range(0, len(tokens), stream_interval):
        chunk_ids = tokens[i:i + stream_interval]
        delta_text = tokenizer.decode(chunk_ids)
        current_text = previous_text + delta_text
        delta = parser.extract_tool_calls_streaming(
            previous_text=previous_text, current_text=current_text, delta_text=delta_text, previous_token_ids=[],
            current_token_ids=[], delta_token_ids=chunk_ids, request=request)
        previous_text = current_text
        if delta is not None:
            delta_messages.append(delta)
    final = parser.finish_streaming()
    if final is not None:
        delta_messages.append(final)
    return delta_messages


def _streamed_calls(tokenizer, request: ChatCompletionRequest, text: str, stream_interval: int) -> list:
    """Every tool-call part of `text` streamed through a new parser."""
    deltas = _simulate_streaming(tokenizer, Hermes2ProToolParser(tokenizer), request, text, stream_interval)
    return [tc for d in deltas if d.tool_calls for tc in d.tool_calls]


def _joined_arguments(tool_calls: list) -> str:
    return "".join(tc.function.arguments or "" for tc in tool_calls)


@pytest.mark.parametrize("stream_interval", [2, 3, 5, 8])
def test_hermes_streaming_tool_call_with_stream_interval(qwen_tokenizer, any_chat_request, stream_interval) -> None:
    """Tool call streaming must produce correct name + args at any interval."""
    text = ('<tool_call>{"name": "get_current_temperature", '
            '"arguments": {"location": "San Francisco", "unit": "celsius"}}'
            "</tool_call>")
    parser = Hermes2ProToolParser(qwen_tokenizer)
    deltas = _simulate_streaming(qwen_tokenizer, parser, any_chat_request, text, stream_interval)

    tool_deltas = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]
    assert tool_deltas, "Expected at least one tool call delta"
    assert tool_deltas[0].function.name == "get_current_temperature"

    args_str = "".join(tc.function.arguments or "" for tc in tool_deltas)
    assert json.loads(args_str) == {"location": "San Francisco", "unit": "celsius"}


@pytest.mark.parametrize("stream_interval", [2, 3, 5, 8])
def test_hermes_streaming_content_then_tool_call_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                                      stream_interval) -> None:
    """Content before a tool call must be fully streamed, then tool call."""
    text = ("Sure, let me check the weather."
            '<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "NYC"}}</tool_call>')
    parser = Hermes2ProToolParser(qwen_tokenizer)
    deltas = _simulate_streaming(qwen_tokenizer, parser, any_chat_request, text, stream_interval)

    content_deltas = [d for d in deltas if d.content]
    tool_deltas = [d for d in deltas if d.tool_calls]

    content_str = "".join(d.content for d in content_deltas)
    assert content_str == "Sure, let me check the weather."

    tool_calls = [tc for d in tool_deltas for tc in d.tool_calls]
    assert tool_calls[0].function.name == "get_weather"
    args_str = _joined_arguments(tool_calls)
    assert json.loads(args_str) == {"city": "NYC"}


@pytest.mark.parametrize("stream_interval", [1, 2, 4])
def test_hermes_streaming_multiple_tool_calls_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                                   stream_interval) -> None:
    """Multiple sequential tool calls must each be streamed correctly."""
    text = ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>')
    parser = Hermes2ProToolParser(qwen_tokenizer)
    deltas = _simulate_streaming(qwen_tokenizer, parser, any_chat_request, text, stream_interval)

    all_tool_calls = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]

    tool0 = [tc for tc in all_tool_calls if tc.index == 0]
    tool1 = [tc for tc in all_tool_calls if tc.index == 1]

    assert tool0[0].function.name == "search"
    args0 = "".join(tc.function.arguments or "" for tc in tool0)
    assert json.loads(args0) == {"q": "cats"}

    assert tool1[0].function.name == "search"
    args1 = "".join(tc.function.arguments or "" for tc in tool1)
    assert json.loads(args1) == {"q": "dogs"}


@pytest.mark.parametrize("stream_interval", [2, 5])
def test_hermes_streaming_boolean_args_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                            stream_interval) -> None:
    """Regression test for bug #19056 with stream_interval > 1."""
    text = ("<tool_call>\n"
            '{"name": "final_answer", "arguments": {"trigger": true}}\n'
            "</tool_call>")
    tool_calls = _streamed_calls(qwen_tokenizer, any_chat_request, text, stream_interval)
    assert tool_calls[0].function.name == "final_answer"
    args_str = _joined_arguments(tool_calls)
    assert json.loads(args_str) == {"trigger": True}


@pytest.mark.parametrize("stream_interval", [2, 3, 5])
def test_hermes_streaming_just_forward_text_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                                 stream_interval) -> None:
    """Plain text with no tool calls must be fully forwarded."""
    text = "This is plain text with no tool calling involved."
    parser = Hermes2ProToolParser(qwen_tokenizer)
    deltas = _simulate_streaming(qwen_tokenizer, parser, any_chat_request, text, stream_interval)

    for d in deltas:
        assert not d.tool_calls
    assert "".join(d.content for d in deltas) == text


def test_hermes_parser_non_streaming_no_tool_call(hermes_parser, any_chat_request) -> None:
    text = """This is not a tool call."""
    tool_call = hermes_parser.extract_tool_calls(model_output=text, request=any_chat_request)

    assert tool_call is not None
    assert not tool_call.tools_called


@pytest.mark.parametrize("text", [
    pytest.param('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
                 id="between_tags"),
    pytest.param('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}', id="until_eos"),
])
def test_hermes_parser_non_streaming_tool_call(hermes_parser, any_chat_request, text) -> None:
    tool_call = hermes_parser.extract_tool_calls(model_output=text, request=any_chat_request)

    assert tool_call is not None
    assert tool_call.tools_called
    assert tool_call.tool_calls[0].function.name == "final_answer"
    assert tool_call.tool_calls[0].function.arguments == '{"trigger": true}'


def test_hermes_parser_non_streaming_tool_call_invalid_json(hermes_parser, any_chat_request) -> None:
    # Missing closing brace to trigger exception
    text = """<tool_call>
{"name": "final_answer", "arguments": {"trigger": true}"""
    tool_call = hermes_parser.extract_tool_calls(model_output=text, request=any_chat_request)

    assert tool_call is not None
    assert not tool_call.tools_called


def test_hermes_parser_non_streaming_serialized_arguments(hermes_parser, any_chat_request) -> None:
    """Arguments the model already serialized must not be encoded twice: a JSON string that decodes to another
    string is no mapping a chat template can render."""
    text = ("<tool_call>\n"
            '{"name": "get_db_config", '
            '"arguments": "{\\"param\\": \\"max_connections\\"}"}\n'
            "</tool_call>")
    tool_call = hermes_parser.extract_tool_calls(model_output=text, request=any_chat_request)

    assert tool_call is not None
    assert tool_call.tools_called
    assert tool_call.tool_calls[0].function.name == "get_db_config"
    # Decoding once must yield the object, not another string.
    assert json.loads(tool_call.tool_calls[0].function.arguments) == {"param": "max_connections"}


def test_hermes_parser_non_streaming_bare_string_arguments(hermes_parser, any_chat_request) -> None:
    """Only serialized objects are passed through: a string that holds no JSON is still serialized, or the
    client would receive something that is not JSON at all."""
    text = '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'
    tool_call = hermes_parser.extract_tool_calls(model_output=text, request=any_chat_request)

    assert tool_call is not None
    assert tool_call.tools_called
    assert json.loads(tool_call.tool_calls[0].function.arguments) == "hello"


@pytest.mark.parametrize("stream_interval", [1, 2, 3, 5])
def test_hermes_streaming_serialized_arguments_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                                    stream_interval) -> None:
    """Serialized arguments must stream back single-encoded at any interval."""
    text = ('<tool_call>{"name": "get_db_config", '
            '"arguments": "{\\"param\\": \\"max_connections\\"}"}</tool_call>')
    tool_calls = _streamed_calls(qwen_tokenizer, any_chat_request, text, stream_interval)
    assert tool_calls[0].function.name == "get_db_config"
    args_str = _joined_arguments(tool_calls)
    assert json.loads(args_str) == {"param": "max_connections"}


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_hermes_streaming_bare_string_arguments_with_stream_interval(qwen_tokenizer, any_chat_request,
                                                                     stream_interval) -> None:
    """A non-JSON string argument must still stream back as valid JSON."""
    text = '<tool_call>{"name": "do_thing", "arguments": "hello"}</tool_call>'
    tool_calls = _streamed_calls(qwen_tokenizer, any_chat_request, text, stream_interval)
    args_str = _joined_arguments(tool_calls)
    assert json.loads(args_str) == "hello"


@pytest.mark.parametrize(
    "args_value",
    [
        '{"param": "max_connections"}',
        "hello",
        # A string that only looks structured: unwrapping it would hand the client something that is not JSON.
        "{hello world}",
        "[oops",
        '{"a": 1} tail text',
    ],
)
@pytest.mark.parametrize("stream_interval", [1, 3])
def test_hermes_streaming_string_arguments_match_non_streaming(qwen_tokenizer, any_chat_request, args_value,
                                                               stream_interval) -> None:
    """Both paths must return the same arguments for a string-valued argument: whether the string holds
    serialized arguments cannot be judged from a prefix, so streaming waits for the literal to close."""
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": args_value}) + "</tool_call>"
    non_streaming = Hermes2ProToolParser(qwen_tokenizer).extract_tool_calls(model_output=text,
                                                                            request=any_chat_request)
    expected = non_streaming.tool_calls[0].function.arguments

    deltas = _simulate_streaming(qwen_tokenizer, Hermes2ProToolParser(qwen_tokenizer), any_chat_request, text,
                                 stream_interval)
    tool_calls = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]
    args_str = _joined_arguments(tool_calls)

    assert args_str == expected
    # Valid JSON whatever the model emitted, which is what the API promises.
    json.loads(args_str)


def test_hermes_streaming_content_and_tool_call_in_single_chunk(qwen_tokenizer, any_chat_request) -> None:
    """Content + complete tool call in one chunk must both be emitted."""
    text = 'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    parser = Hermes2ProToolParser(qwen_tokenizer)
    deltas = _simulate_streaming(qwen_tokenizer, parser, any_chat_request, text, stream_interval=9999)

    content_parts = [d.content for d in deltas if d.content]
    tool_parts = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]

    assert "".join(content_parts) == "Hi!"
    assert tool_parts[0].function.name == "f"
    args_str = "".join(tc.function.arguments or "" for tc in tool_parts)
    assert json.loads(args_str) == {"x": 1}
