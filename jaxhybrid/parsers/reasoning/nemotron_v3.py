"""Nemotron 3's reasoning: Qwen3's markers, trailing whitespace trimmed off the reasoning, and a request that
asks for content (`enable_thinking=False` or `force_nonempty_content=True` in `chat_template_kwargs`) gets the
reasoning as content when the model wrote no content."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..messages import DeltaMessage, ParserRequest, TokenizerLike
from .qwen3 import Qwen3ReasoningParser


def _wants_content(request: ParserRequest | None) -> bool:
    kwargs = getattr(request, "chat_template_kwargs", None) or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("force_nonempty_content") is True


class NemotronV3ReasoningParser(Qwen3ReasoningParser):
    strip_trailing_reasoning_whitespace = True

    def __init__(self, tokenizer: TokenizerLike, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._sent_reasoning = ""
        self._sent_content = ""

    def extract_reasoning(self, model_output: str, request: ParserRequest | None) -> tuple[str | None, str | None]:
        reasoning, content = super().extract_reasoning(model_output, request)
        if _wants_content(request) and not (content or "").strip():
            return content, reasoning
        return reasoning, content

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        return self._record(super().extract_reasoning_streaming(
            previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids))

    def finish_streaming(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        """Also: the reasoning, again as content, when the request wants content and the stream sent none (the
        reasoning went out already and cannot be taken back)."""
        delta = self._record(super().finish_streaming(request))
        reasoning, content = self._sent_reasoning, self._sent_content
        self._sent_reasoning = self._sent_content = ""
        if not _wants_content(request) or content.strip() or not reasoning:
            return delta
        delta = delta or DeltaMessage()
        delta.content = (delta.content or "") + reasoning
        return delta

    def _record(self, delta: DeltaMessage | None) -> DeltaMessage | None:
        if delta is not None:
            self._sent_reasoning += delta.reasoning or ""
            self._sent_content += delta.content or ""
        return delta
