"""vLLM's qwen3_xml tool-parser tests, ported to our qwen3_xml parser and test tokenizer (SKIPS.md: what is not)."""

import logging

import pytest

from jaxhybrid.parsers.tools.schema import convert_param_value

from .common_tool_tests import ToolParserTestConfig, ToolParserTests


class TestQwen3xmlToolParser(ToolParserTests):
    @pytest.fixture
    def test_config(self) -> ToolParserTestConfig:
        return ToolParserTestConfig(
            parser_name="qwen3_xml",
            no_tool_calls_output="This is a regular response without any tool calls.",
            single_tool_call_output=(
                "<tool_call>\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n</function>\n</tool_call>"),
            parallel_tool_calls_output=(
                "<tool_call>\n<function=get_weather>\n<parameter=city>Tokyo</parameter>\n</function>\n</tool_call>"
                "<tool_call>\n<function=get_time>\n<parameter=timezone>Asia/Tokyo</parameter>\n</function>\n"
                "</tool_call>"),
            various_data_types_output=(
                "<tool_call>\n<function=test_function>\n"
                "<parameter=string_field>hello</parameter>\n"
                "<parameter=int_field>42</parameter>\n"
                "<parameter=float_field>3.14</parameter>\n"
                "<parameter=bool_field>true</parameter>\n"
                "<parameter=null_field>null</parameter>\n"
                '<parameter=array_field>["a", "b", "c"]</parameter>\n'
                '<parameter=object_field>{"nested": "value"}</parameter>\n'
                "</function>\n</tool_call>"),
            empty_arguments_output="<tool_call>\n<function=refresh>\n</function>\n</tool_call>",
            surrounding_text_output=(
                "Let me check the weather for you.\n\n"
                "<tool_call>\n<function=get_weather>\n"
                "<parameter=city>Tokyo</parameter>\n"
                "</function>\n</tool_call>\n\n"
                "I will get that information."),
            escaped_strings_output=(
                "<tool_call>\n<function=test_function>\n"
                '<parameter=quoted>He said "hello"</parameter>\n'
                "<parameter=path>C:\\Users\\file.txt</parameter>\n"
                "<parameter=newline>line1\nline2</parameter>\n"
                "</function>\n</tool_call>"),
            malformed_input_outputs=[
                "<tool_call><function=func>",
                "<tool_call><function=></function></tool_call>",
            ],
            single_tool_call_expected_name="get_weather",
            single_tool_call_expected_args={"city": "Tokyo"},
            parallel_tool_calls_count=2,
            parallel_tool_calls_names=["get_weather", "get_time"],
            supports_typed_arguments=False,
        )


@pytest.mark.parametrize(
    "param_value,param_type",
    [
        ("not_a_number", "int"),
        ("not_a_number", "integer"),
        ("not_a_number", "uint"),
        ("not_a_number", "long"),
        ("not_a_number", "short"),
        ("not_a_number", "unsigned"),
        ("not_a_float", "num"),
        ("not_a_float", "float"),
    ],
)
def test_convert_param_value_invalid_emits_warning(param_value: str, param_type: str, caplog) -> None:
    """A value that converts to no int or float is passed on unchanged, with one warning that names the value,
    the parameter and the function."""
    with caplog.at_level(logging.WARNING, logger="jaxhybrid.parsers.tools.schema"):
        result = convert_param_value(param_value, {"type": param_type}, param_name="my_param", func_name="my_tool")

    assert result == param_value

    warning_records = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning_records) == 1, f"Expected 1 warning, got {len(warning_records)}"
    msg = warning_records[0].getMessage()
    assert param_value in msg, f"param_value '{param_value}' not found in warning: '{msg}'"
    assert "my_param" in msg, f"param_name 'my_param' not found in warning: '{msg}'"
    assert "my_tool" in msg, f"func_name 'my_tool' not found in warning: '{msg}'"
