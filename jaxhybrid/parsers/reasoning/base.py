"""The reasoning parsers' interface (vLLM's method names and semantics) and the `<think>` ... `</think>` family's
shared splitting of text into reasoning and content."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from ..messages import DeltaMessage, ParserRequest, TokenizerLike
from ..tags import TagMachine


class ReasoningParser(ABC):
    """Splits a model's output into reasoning and content. One instance per request: the streaming methods keep
    state from one delta to the next. `chat_template_kwargs` are the request's (`enable_thinking`, ...)."""

    def __init__(self, tokenizer: TokenizerLike, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended by the last of `input_ids` (a structured-output grammar starts there)."""

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids of `input_ids` that are content, past the reasoning."""

    @abstractmethod
    def extract_reasoning(self, model_output: str, request: ParserRequest | None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""

    @abstractmethod
    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        """What `delta_text` adds to the reasoning and the content; None when it adds nothing yet."""

    def finish_streaming(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        """The last delta of a stream, after its last `extract_reasoning_streaming`: text held back while it
        could still have begun a marker; None when there is none. The next streaming call starts a new stream."""
        return None


class ThinkSplitter(TagMachine):
    """Reasoning and content of text streamed through it: reasoning until the end marker (or an implicit end
    marker, which begins the content), content after it. Start markers inside the reasoning are dropped, and so
    are `dropped_in_content` markers after it."""

    def __init__(self, parser: ThinkReasoningParser, in_reasoning: bool) -> None:
        super().__init__()
        self._parser = parser
        self.in_reasoning = in_reasoning
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def take(self) -> tuple[str, str]:
        """(reasoning, content) found since the last take."""
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return reasoning, content

    def _tags(self) -> Sequence[str]:
        parser = self._parser
        if self.in_reasoning:
            return (parser.start_token, parser.end_token, *parser.implicit_end_tokens)
        return parser.dropped_in_content

    def _on_text(self, text: str) -> None:
        (self._reasoning if self.in_reasoning else self._content).append(text)

    def _on_tag(self, tag: str) -> None:
        if not self.in_reasoning or tag == self._parser.start_token:
            return
        self.in_reasoning = False
        if tag != self._parser.end_token:
            self._content.append(tag)


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between `<think>` and `</think>`, streamed by text, so the markers may arrive inside larger
    deltas or even cut across deltas. Output that starts without `<think>` (the chat template put it in the
    prompt) is reasoning until `</think>`."""

    start_token = "<think>"
    end_token = "</think>"
    implicit_end_tokens: tuple[str, ...] = ()  # markers that end the reasoning and begin the content
    dropped_in_content: tuple[str, ...] = ()  # markers that are dropped when they follow the reasoning
    strip_trailing_reasoning_whitespace = False

    def __init__(self, tokenizer: TokenizerLike, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self.start_token_id = self._token_id(self.start_token)
        self.end_token_id = self._token_id(self.end_token)
        self._splitter = self._new_splitter()
        self._held_whitespace = ""  # trailing reasoning whitespace, sent only if more reasoning follows

    def _token_id(self, token: str) -> int:
        token_id = self.vocab.get(token)
        if token_id is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer with a {token!r} token")
        return token_id

    def _new_splitter(self) -> ThinkSplitter:
        return ThinkSplitter(self, in_reasoning=True)

    def _split(self, model_output: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output, as streaming it would give them."""
        splitter = self._new_splitter()
        splitter.feed(model_output)
        splitter.finish()
        reasoning, content = splitter.take()
        return reasoning.rstrip() if self.strip_trailing_reasoning_whitespace else reasoning, content

    def extract_reasoning_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                    previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                    delta_token_ids: Sequence[int]) -> DeltaMessage | None:
        self._splitter.feed(delta_text)
        return self._delta(final=False)

    def finish_streaming(self, request: ParserRequest | None = None) -> DeltaMessage | None:
        self._splitter.finish()
        delta = self._delta(final=True)
        self._splitter = self._new_splitter()
        return delta

    def _delta(self, final: bool) -> DeltaMessage | None:
        reasoning, content = self._splitter.take()
        if self.strip_trailing_reasoning_whitespace:
            reasoning = self._hold_trailing_whitespace(reasoning, self._splitter.in_reasoning and not final)
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning=reasoning or None, content=content or None)

    def _hold_trailing_whitespace(self, reasoning: str, more_may_follow: bool) -> str:
        """`reasoning` without its trailing whitespace, which is held back while more reasoning may follow it
        and dropped once none can (the whole output's reasoning is stripped the same way)."""
        text = self._held_whitespace + reasoning
        kept = text.rstrip()
        self._held_whitespace = text[len(kept):] if more_may_follow else ""
        return kept
