"""Qwen3's reasoning: `<think>` ... `</think>`, with `<think>` in the prompt or in the output; a `<tool_call>`
also ends it, and `chat_template_kwargs.enable_thinking=False` means there is none."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..messages import ParserRequest, TokenizerLike
from .base import ThinkReasoningParser, ThinkSplitter

_TOOL_CALL_START = "<tool_call>"
_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")  # ChatML: the id scans stop at the current turn's start


class Qwen3ReasoningParser(ThinkReasoningParser):
    """Output without any marker is reasoning cut off before its end (thinking is on unless the request turns it
    off). The `<tool_call>` that ends the reasoning implicitly stays in the content, for the tool parser; a
    repeated `</think>` after the reasoning is dropped."""

    implicit_end_tokens = (_TOOL_CALL_START,)
    dropped_in_content = ("</think>",)

    def __init__(self, tokenizer: TokenizerLike, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        implicit_ends = (self.vocab.get(token) for token in self.implicit_end_tokens)
        self._end_ids = {self.end_token_id, *(token_id for token_id in implicit_ends if token_id is not None)}
        self._turn_boundary_ids = {self.vocab[token] for token in _TURN_BOUNDARIES if token in self.vocab}

    @property
    def thinking_enabled(self) -> bool:
        return bool(self.chat_template_kwargs.get("enable_thinking", True))

    def _new_splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self, in_reasoning=self.thinking_enabled)

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Read backwards to the current turn's start: an end marker means ended, `<think>` means not yet; with
        neither, the reasoning has ended only if thinking is off. On a prompt's ids this tells whether the chat
        template already closed the reasoning."""
        for token_id in reversed(input_ids):
            if token_id in self._end_ids:
                return True
            if token_id == self.start_token_id:
                return False
            if token_id in self._turn_boundary_ids:
                break
        return not self.thinking_enabled

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """After the last `</think>`; else from the turn's first `<tool_call>` on (it is content); all of them
        when thinking is off or the reasoning has not ended."""
        if not self.thinking_enabled:
            return input_ids
        if self.end_token_id in input_ids:
            last_end = len(input_ids) - 1 - input_ids[::-1].index(self.end_token_id)
            return input_ids[last_end + 1:]
        turn_start = next((i + 1 for i in range(len(input_ids) - 1, -1, -1)
                           if input_ids[i] in self._turn_boundary_ids), 0)
        implicit_end = next((i for i in range(turn_start, len(input_ids)) if input_ids[i] in self._end_ids), 0)
        return input_ids[implicit_end:]

    def extract_reasoning(self, model_output: str, request: ParserRequest | None) -> tuple[str | None, str | None]:
        reasoning, content = self._split(model_output)
        return reasoning or None, content or None
