"""Splitting streamed text at marker tags (`<think>`, `<tool_call>`, `<parameter=`, ...) that may arrive cut
across deltas: text that could still grow into a tag is held back until the next delta tells."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


def partial_tag_start(text: str, tags: Sequence[str]) -> int:
    """Where the longest suffix of `text` that is a proper prefix of one of `tags` begins (len(text) if none)."""
    longest = max(map(len, tags), default=1)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        suffix = text[start:]
        if any(len(suffix) < len(tag) and tag.startswith(suffix) for tag in tags):
            return start
    return len(text)


def _earliest_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """(position, tag) of the tag that begins first in `text` (the longer where two begin at once)."""
    found = [(at, -len(tag), tag) for tag in tags if (at := text.find(tag)) >= 0]
    if not found:
        return None
    at, _, tag = min(found)
    return at, tag


class TagScanner:
    """Text fed in pieces, handed out as (text, tag) steps. The caller names the tags to look for at each step,
    so a parser's state decides which markers mean something where it is."""

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> None:
        self._pending += text

    def next(self, tags: Sequence[str], final: bool = False) -> tuple[str, str | None]:
        """The text before the next whole tag, and that tag; or, when no tag is whole yet, the text that can no
        longer begin one and None (the rest waits for more text, unless `final`: the stream has ended)."""
        found = _earliest_tag(self._pending, tags)
        if found is not None:
            at, tag = found
            text, self._pending = self._pending[:at], self._pending[at + len(tag):]
            return text, tag
        cut = len(self._pending) if final else partial_tag_start(self._pending, tags)
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, None


class TagMachine(ABC):
    """A parser's state machine over streamed text: each step hands the text before a tag, then the tag, to the
    current state; which tags count is the state's choice."""

    def __init__(self) -> None:
        self._scanner = TagScanner()

    def feed(self, text: str) -> None:
        self._scanner.feed(text)
        self._run(final=False)

    def finish(self) -> None:
        """The stream has ended: the held-back text is text after all."""
        self._run(final=True)

    def _run(self, final: bool) -> None:
        while True:
            text, tag = self._scanner.next(self._tags(), final)
            if text:
                self._on_text(text)
            if tag is None:
                return
            self._on_tag(tag)

    @abstractmethod
    def _tags(self) -> Sequence[str]:
        """The tags that mean something in the current state."""

    @abstractmethod
    def _on_text(self, text: str) -> None: ...

    @abstractmethod
    def _on_tag(self, tag: str) -> None: ...
