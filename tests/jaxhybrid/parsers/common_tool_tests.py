"""vLLM's common tool-parser tests: the suite every tool parser's test file runs with its own
outputs, on our parsers (by registry name) and test tokenizer."""

import json
from dataclasses import dataclass, field
from types import NoneType
from typing import Any

import pytest

from jaxhybrid.parsers.tools import get_tool_parser

from .utils import (
    random_groupings,
    run_tool_extraction,
    run_tool_extraction_streaming_batched,
    split_string_into_token_stream,
    two_chunk_groupings,
)

RANDOM_GROUPING_COUNT = 100
RANDOM_GROUPING_SEED = 20260902


@dataclass
class ToolParserTestConfig:
    """A parser's outputs for the common tests and what they should give."""

    parser_name: str

    no_tool_calls_output: str
    single_tool_call_output: str
    parallel_tool_calls_output: str
    various_data_types_output: str
    empty_arguments_output: str
    surrounding_text_output: str
    escaped_strings_output: str
    malformed_input_outputs: list[str]

    single_tool_call_expected_name: str = "get_weather"
    single_tool_call_expected_args: dict[str, Any] = field(default_factory=lambda: {"city": "Tokyo"})
    parallel_tool_calls_count: int = 2
    parallel_tool_calls_names: list[str] = field(default_factory=lambda: ["get_weather", "get_time"])

    single_tool_call_expected_content: str | None = None

    allow_empty_or_json_empty_args: bool = True  # "{}" or "" for empty args
    supports_typed_arguments: bool = True


class ToolParserTests:
    """Mixin: a test file provides a `test_config` fixture and inherits the tests."""

    @pytest.fixture
    def test_config(self) -> ToolParserTestConfig:
        raise NotImplementedError("Subclass must provide test_config fixture returning ToolParserTestConfig")

    @pytest.fixture
    def tool_parser(self, test_config: ToolParserTestConfig, tokenizer):
        return get_tool_parser(test_config.parser_name)(tokenizer)

    @pytest.fixture(params=[True, False])
    def streaming(self, request: pytest.FixtureRequest) -> bool:
        return request.param

    def test_no_tool_calls(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser handles plain text without tool syntax."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.no_tool_calls_output, streaming=streaming)
        assert content == test_config.no_tool_calls_output, f"Expected content to match input, got {content}"
        assert len(tool_calls) == 0, f"Expected no tool calls, got {len(tool_calls)}"

    def test_single_tool_call_simple_args(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser extracts one tool with simple arguments."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.single_tool_call_output,
                                                  streaming=streaming)

        if test_config.single_tool_call_expected_content is not None:
            assert content == test_config.single_tool_call_expected_content

        assert len(tool_calls) == 1, f"Expected 1 tool call, got {len(tool_calls)}"
        assert tool_calls[0].type == "function"
        assert tool_calls[0].function.name == test_config.single_tool_call_expected_name

        args = json.loads(tool_calls[0].function.arguments)
        for key, value in test_config.single_tool_call_expected_args.items():
            assert args.get(key) == value, f"Expected {key}={value}, got {args.get(key)}"

    def test_parallel_tool_calls(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser handles multiple tools in one response."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.parallel_tool_calls_output,
                                                  streaming=streaming)

        assert len(tool_calls) == test_config.parallel_tool_calls_count, (
            f"Expected {test_config.parallel_tool_calls_count} tool calls, got {len(tool_calls)}")

        for i, expected_name in enumerate(test_config.parallel_tool_calls_names):
            assert tool_calls[i].type == "function"
            assert tool_calls[i].function.name == expected_name

        ids = [tc.id for tc in tool_calls]
        assert len(ids) == len(set(ids)), "Tool call IDs should be unique"

    def test_various_data_types(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser handles all JSON types in arguments."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.various_data_types_output,
                                                  streaming=streaming)
        assert len(tool_calls) == 1, f"Expected 1 tool call, got {len(tool_calls)}"

        args = json.loads(tool_calls[0].function.arguments)
        required_fields_types = {
            "string_field": str,
            "int_field": int,
            "float_field": float,
            "bool_field": bool,
            "null_field": NoneType,
            "array_field": list,
            "object_field": dict,
        }
        for required_field, expected_type in required_fields_types.items():
            assert required_field in args, f"Expected field '{required_field}' in arguments"
            if test_config.supports_typed_arguments:
                found_type = type(args[required_field])
                assert found_type is expected_type, (
                    f"Expected field '{required_field}' to have type {expected_type}, got {found_type}")

    def test_empty_arguments(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser handles parameterless tool calls."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.empty_arguments_output,
                                                  streaming=streaming)
        assert len(tool_calls) == 1, f"Expected 1 tool call, got {len(tool_calls)}"

        args = tool_calls[0].function.arguments
        if test_config.allow_empty_or_json_empty_args:
            assert args in ["{}", ""], f"Expected empty args, got {args}"
        else:
            assert args == "{}", f"Expected {{}}, got {args}"

    def test_surrounding_text(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser extracts tools from mixed content."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.surrounding_text_output,
                                                  streaming=streaming)
        assert len(tool_calls) >= 1, f"Expected at least 1 tool call, got {len(tool_calls)}"

    def test_escaped_strings(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser handles escaped characters in arguments."""
        content, tool_calls = run_tool_extraction(tool_parser, test_config.escaped_strings_output,
                                                  streaming=streaming)
        assert len(tool_calls) == 1, f"Expected 1 tool call, got {len(tool_calls)}"

        args = json.loads(tool_calls[0].function.arguments)
        # Exact escaping behavior varies by parser
        assert len(args) > 0, "Expected some arguments with escaped strings"

    def test_malformed_input(self, tool_parser, test_config: ToolParserTestConfig, streaming: bool):
        """Verify parser gracefully handles invalid syntax."""
        for malformed_input in test_config.malformed_input_outputs:
            # Should not raise exception
            run_tool_extraction(tool_parser, malformed_input, streaming=streaming)

    def test_streaming_reconstruction(self, tool_parser, test_config: ToolParserTestConfig):
        """Verify streaming produces same result as non-streaming."""
        test_output = test_config.single_tool_call_output

        content_non, tools_non = run_tool_extraction(tool_parser, test_output, streaming=False)
        content_stream, tools_stream = run_tool_extraction(tool_parser, test_output, streaming=True)

        assert content_non == content_stream, "Content should match between modes"
        assert len(tools_non) == len(tools_stream), "Tool count should match"
        if len(tools_non) > 0:
            assert tools_non[0].function.name == tools_stream[0].function.name
            assert tools_non[0].function.arguments == tools_stream[0].function.arguments

    @pytest.mark.parametrize("label", ["single", "parallel"])
    def test_streaming_split_invariance(self, tool_parser, test_config: ToolParserTestConfig, label: str):
        """The streamed result does not depend on how many tokens each delta carries: a tag mishandled only
        when it straddles one particular delta boundary would not show one token at a time. The baseline is
        the one-token-per-delta stream."""
        output = test_config.single_tool_call_output if label == "single" else test_config.parallel_tool_calls_output
        token_texts, token_ids = split_string_into_token_stream(tool_parser.model_tokenizer, output)
        baseline = self.stream_with_batching(test_config, tool_parser.model_tokenizer, token_texts, token_ids,
                                             [1] * len(token_texts))
        # The whole stream in one delta is a partition of its own, which neither generator makes for long streams.
        batchings = ([[len(token_texts)]] + two_chunk_groupings(len(token_texts))
                     + random_groupings(len(token_texts), count=RANDOM_GROUPING_COUNT, seed=RANDOM_GROUPING_SEED))
        failures: list[tuple[list[int], str]] = []
        for lengths in batchings:
            try:
                actual = self.stream_with_batching(test_config, tool_parser.model_tokenizer, token_texts,
                                                   token_ids, lengths)
                assert actual == baseline, f"expected {baseline}, got {actual}"
            except AssertionError as exc:
                failures.append((lengths, str(exc)))

        if failures:
            lengths, err = min(failures, key=lambda item: len(item[0]))
            raise AssertionError(
                f"{len(failures)}/{len(batchings)} token batchings changed the {label} tool-call parse for "
                f"{test_config.parser_name!r}. Minimal failing batching (tokens per delta) {lengths}:\n{err}")

    @staticmethod
    def stream_with_batching(test_config: ToolParserTestConfig, tokenizer, token_texts: list[str],
                             token_ids: list[int], lengths: list[int],
                             ) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """The token sequence streamed in deltas of `lengths` tokens, through a fresh parser (a parser keeps
        streaming state)."""
        parser = get_tool_parser(test_config.parser_name)(tokenizer)
        reconstructor = run_tool_extraction_streaming_batched(parser, token_texts, token_ids, lengths,
                                                              assert_one_tool_per_delta=False)
        return (reconstructor.other_content or None,
                tuple((tc.function.name, tc.function.arguments or "") for tc in reconstructor.tool_calls))
