"""DeepSeek-R1's reasoning: `<think>` ... `</think>`, where the chat template may already have put `<think>` in
the prompt."""

from __future__ import annotations

from collections.abc import Sequence

from ..messages import ParserRequest
from .base import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """Whole outputs drop what precedes `<think>`; streamed ones cannot know, while it streams, whether `<think>`
    follows, and send it as reasoning."""

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for token_id in reversed(input_ids):  # the latest marker decides
            if token_id == self.start_token_id:
                return False
            if token_id == self.end_token_id:
                return True
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.end_token_id not in input_ids[:-1]:  # no end yet, or nothing after it
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1:]

    def extract_reasoning(self, model_output: str, request: ParserRequest | None) -> tuple[str | None, str | None]:
        before, start, after = model_output.partition(self.start_token)
        text = after if start else before
        reasoning, end, content = text.partition(self.end_token)
        if not end:  # cut off while thinking: all of it is reasoning
            return text, None
        return reasoning, content or None
