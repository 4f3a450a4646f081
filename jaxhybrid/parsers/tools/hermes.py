"""Hermes' JSON tool calls (also Qwen2.5's and Qwen3's own): `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, any number of them. Content is the text before the first call, as vLLM has it; the closing tag
may be missing at the end of the output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

from ..messages import ParserRequest
from .base import CallLog, CallMachine, ToolParser

_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"
_WHITESPACE = " \t\n\r"
_DECODER = json.JSONDecoder()
_NOT_JSON = (ValueError, RecursionError)  # RecursionError: nested deeper than Python's JSON parser goes


@dataclass
class _Member:
    key: str
    start: int  # where its value begins
    end: int | None  # where its value ends; None while it may still grow


def _skip_whitespace(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    return at


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends, once `text` shows it whole; a number only counts as whole once
    something follows it."""
    try:
        _, end = _DECODER.raw_decode(text, start)
    except _NOT_JSON:  # unfinished (or not JSON at all)
        return None
    if text[start] in "-0123456789" and (end == len(text) or text[end] not in ",}]" + _WHITESPACE):
        return None
    return end


def _object_members(text: str) -> tuple[list[_Member], bool]:
    """The members of the JSON object that `text` (maybe a prefix of it) holds as far as it goes, and whether
    the object has closed."""
    at = _skip_whitespace(text, 0)
    if not text.startswith("{", at):
        return [], False
    members: list[_Member] = []
    at += 1
    while True:
        at = _skip_whitespace(text, at)
        if text.startswith("}", at):
            return members, True
        try:
            key, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return members, False
        at = _skip_whitespace(text, at)
        if not isinstance(key, str) or not text.startswith(":", at):
            return members, False
        start = _skip_whitespace(text, at + 1)
        end = _value_end(text, start) if start < len(text) else None
        members.append(_Member(key, start, end))
        if end is None:
            return members, False
        at = _skip_whitespace(text, end)
        at += text.startswith(",", at)


def _string_arguments(literal: str) -> str:
    """Arguments the model wrote as a JSON string: one that holds a serialized object is that object (it was
    encoded once already), any other is sent as the JSON string it is."""
    value = json.loads(literal)
    try:
        if isinstance(json.loads(value), dict):
            return value
    except _NOT_JSON:
        pass
    return json.dumps(value, ensure_ascii=False)


def _arguments_so_far(body: str) -> str:
    """The arguments of a (maybe partial) call body, as far as they are known: an object or array as the model
    wrote it, growing as it streams; a string or another value once whole; `{}` for a call without them."""
    members, closed = _object_members(body)
    member = next((member for member in members if member.key == "arguments"), None)
    if member is None:
        return "{}" if closed else ""
    if member.end is None:
        return body[member.start:] if body.startswith(("{", "["), member.start) else ""
    value = body[member.start:member.end]
    return _string_arguments(value) if value.startswith('"') else value


def _name(body: str) -> str | None:
    members, _ = _object_members(body)
    literal = next((body[m.start:m.end] for m in members if m.key == "name" and m.end is not None), None)
    name = None if literal is None else json.loads(literal)
    return name if isinstance(name, str) else None


def _is_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except _NOT_JSON:
        return False
    return isinstance(call, dict) and isinstance(call.get("name"), str)


class _State(Enum):
    CONTENT = auto()  # before the first call
    CALL = auto()  # inside <tool_call>
    BETWEEN = auto()  # after a </tool_call>: the text there is dropped


class _HermesCallMachine(CallMachine):
    """A call goes out once its name is whole; its arguments as the model writes them."""

    def __init__(self, log: CallLog) -> None:
        super().__init__(log)
        self._state = _State.CONTENT
        self.bodies: list[str] = []  # the text inside each <tool_call>

    def _tags(self) -> Sequence[str]:
        return (_CALL_END,) if self._state is _State.CALL else (_CALL_START,)

    def _on_text(self, text: str) -> None:
        if self._state is _State.CONTENT:
            self.log.add_content(text)
        elif self._state is _State.CALL:
            self.bodies[-1] += text
            self._stream_call()

    def _on_tag(self, tag: str) -> None:
        self._state = _State.CALL if tag == _CALL_START else _State.BETWEEN
        if tag == _CALL_START:
            self.bodies.append("")

    def _stream_call(self) -> None:
        body = self.bodies[-1]
        if len(self.log.calls) < len(self.bodies):
            name = _name(body)
            if name is None:
                return
            self.log.start_call(name)
        sent = len(self.log.calls[-1].arguments)  # a prefix of what is known now (see _arguments_so_far)
        self.log.add_arguments(_arguments_so_far(body)[sent:])

    def well_formed(self) -> bool:
        return all(map(_is_call, self.bodies))


class HermesToolParser(ToolParser):
    """A whole output with a call that is not a JSON object with a name calls no tool: all of it is content.
    Arguments are the model's own JSON text, so a stream's argument pieces concatenate to the same string."""

    def _new_machine(self, request: ParserRequest | None) -> CallMachine:
        return _HermesCallMachine(CallLog(self.hold_blank_content))
