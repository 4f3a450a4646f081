"""Reasoning parsers by the names of vLLM's `--reasoning-parser`."""

from __future__ import annotations

from ..registry import lookup
from .base import ReasoningParser
from .deepseek_r1 import DeepSeekR1ReasoningParser
from .nemotron_v3 import NemotronV3ReasoningParser
from .qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "nemotron_v3": NemotronV3ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    return lookup(REASONING_PARSERS, name, "reasoning parser")


__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser"]
