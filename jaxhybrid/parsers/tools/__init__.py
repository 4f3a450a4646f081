"""Tool-call parsers by the names of vLLM's `--tool-call-parser`. `qwen3_coder` and `qwen3_xml` name the same
parser, as they do in vLLM; it is also the one Nemotron-3-Nano is served with."""

from __future__ import annotations

from ..registry import lookup
from .base import ToolParser
from .hermes import HermesToolParser
from .qwen3_xml import Qwen3XMLToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser,
                                             **dict.fromkeys(("qwen3_coder", "qwen3_xml"), Qwen3XMLToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    return lookup(TOOL_PARSERS, name, "tool-call parser")


__all__ = ["TOOL_PARSERS", "ToolParser", "get_tool_parser"]
