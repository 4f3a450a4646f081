"""Incremental detokenization with stop strings, on the host, one object per request being served.

Byte-level BPE splits characters across tokens, and a token's text depends on its left neighbours, so
text is decoded over a short window that starts a few tokens back (`prefix_offset`) and only the part
past the text already emitted (`read_offset`) becomes new; a window whose text ends in U+FFFD (half
a UTF-8 character) waits for the next token (vLLM's scheme). Stop strings are searched in the new text
and the last `max(len(stop)) - 1` characters before it, and while streaming that many characters are
held back, so a client never sees the start of a stop string that then gets cut. As vLLM does, a stop
string must end in the text of an output token past the first `min_tokens`.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxhybrid.engine.tokenizer import Tokenizer

_WINDOW = 6  # prompt tokens decoded before the first output token: enough context for BPE's leading spaces
_INCOMPLETE = "\ufffd"


class TextDelta(NamedTuple):
    text: str  # new text for the client (stop strings and held-back characters excluded)
    stop: str | None  # the stop string that ended the request in this delta, if any


class IncrementalDetokenizer:
    """Text of the output tokens of one request, emitted as it becomes final."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), *,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids = list(prompt_ids[-_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop, self._keep_stop = stop, include_stop_str_in_output
        self._hold = max(map(len, stop), default=1) - 1
        self.text = ""  # the whole output text so far (held-back characters included)
        self._sent = 0  # characters of `text` already handed out
        self.stopped: str | None = None
        self._min_tokens, self._num_tokens = min_tokens, 0
        self._stop_from = 0  # a stop string must end past this many characters (the first min_tokens' text)

    def push(self, token_ids: list[int]) -> TextDelta:
        """Add a step's output tokens; returns what may be shown now. After a stop, nothing more."""
        if self.stopped is not None:
            return TextDelta("", None)
        for token in token_ids:
            self._ids.append(token)
            self.text += self._next_text()
            self._num_tokens += 1
            if self._num_tokens <= self._min_tokens:
                self._stop_from = len(self.text)
        stop = self._find_stop()
        end = len(self.text) if stop is not None else max(len(self.text) - self._hold, self._sent)
        delta = TextDelta(self.text[self._sent:end], stop)
        self._sent = end
        return delta

    def flush(self) -> str:
        """The held-back tail, once the request has ended without a stop string."""
        rest, self._sent = self.text[self._sent:], len(self.text)
        return rest

    def _next_text(self) -> str:
        decode = lambda ids: self._tok.decode(ids, skip_special_tokens=self._skip)
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_INCOMPLETE):
            return ""  # no new character yet, or half of one: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _find_stop(self) -> str | None:
        """Cut `text` at the earliest stop string that the newest characters completed."""
        start = max(self._sent - self._hold, 0)
        found = [(self.text.find(s, max(start, self._stop_from - len(s) + 1)), s) for s in self._stop]
        found = [(index, s) for index, s in found if index >= 0]
        if not found:
            return None
        index, stop = min(found)
        self.text = self.text[:index + len(stop)] if self._keep_stop else self.text[:index]
        self.stopped = stop
        return stop
