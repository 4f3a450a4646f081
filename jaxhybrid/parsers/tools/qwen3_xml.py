"""Qwen3-Coder's XML tool calls (also Qwen3.5's and Nemotron 3's):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Dallas
    </parameter>
    </function>
    </tool_call>

A value loses one newline at each end; the tool's schema types it (without one, every value is a string).
Lenient as the models need: `<function=` without `<tool_call>`, a `</parameter>` left out (the next tag ends the
value), a call the output leaves open (closed at its end). A `<function=` or `<parameter=` whose name runs into
a newline or another tag is malformed: that call or argument is skipped."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum, auto
from typing import Any

from ..messages import ParserRequest, ToolLike
from .base import CallLog, CallMachine, ToolParser
from .schema import convert_param_value, function_properties, schema_types

_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"
_FUNCTION_START, _FUNCTION_END = "<function=", "</function>"
_PARAM_START, _PARAM_END = "<parameter=", "</parameter>"
_NAME_ENDS = (">", "\n", "<")  # `>` closes a name; a newline or another tag first makes it malformed


class _State(Enum):
    CONTENT = auto()
    CALL = auto()  # after <tool_call>
    NAME = auto()  # after <function=
    SKIP = auto()  # inside a malformed call
    ARGS = auto()  # inside a function, between its parameters
    PARAM_NAME = auto()  # after <parameter=
    VALUE = auto()  # inside a parameter
    AFTER = auto()  # after </function>


_TAGS = {
    _State.CONTENT: (_CALL_START, _FUNCTION_START),
    _State.CALL: (_FUNCTION_START, _CALL_END),
    _State.NAME: _NAME_ENDS,
    _State.SKIP: (_FUNCTION_END, _CALL_END),
    _State.ARGS: (_PARAM_START, _FUNCTION_END, _CALL_END),
    _State.PARAM_NAME: _NAME_ENDS,
    _State.VALUE: (_PARAM_END, _PARAM_START, _FUNCTION_END, _CALL_END),
    _State.AFTER: (_CALL_END, _CALL_START, _FUNCTION_START),
}
_STATE_AFTER_TAG = {_CALL_START: _State.CALL, _CALL_END: _State.CONTENT, _FUNCTION_START: _State.NAME,
                    _FUNCTION_END: _State.AFTER, _PARAM_START: _State.PARAM_NAME, _PARAM_END: _State.ARGS}


def _json_string_body(text: str) -> str:
    """`text` escaped as inside a JSON string; escaping goes character by character, so pieces concatenate."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _value_span(raw: str) -> tuple[int, int]:
    """Where the value lies in the raw text between the tags: one newline off each end. While the value still
    grows, the trailing newline this leaves out is held back, as it may be the one that gets cut: what goes out
    for a prefix of the text is a prefix of what goes out for all of it."""
    start = int(raw.startswith("\n"))
    return start, max(start, len(raw) - raw.endswith("\n"))


class _XmlCallMachine(CallMachine):
    """Arguments go out as a JSON object one parameter at a time; a string parameter's value streams as it is
    written, a typed one goes out whole once its value has ended (it cannot be typed before)."""

    def __init__(self, log: CallLog, tools: Sequence[ToolLike]) -> None:
        super().__init__(log)
        self._tools = tools
        self._state = _State.CONTENT
        self._name = ""  # the function or parameter name being read
        self._function = ""
        self._properties: Mapping[str, Any] | None = None
        self._param_count = 0
        self._param, self._param_schema, self._streams_value = "", None, False
        self._raw_value, self._value_sent = "", 0

    def finish(self) -> None:
        super().finish()
        if self._state is _State.VALUE:
            self._close_param()
        if self._state in (_State.ARGS, _State.PARAM_NAME, _State.VALUE):
            self._close_call()

    def _tags(self) -> Sequence[str]:
        return _TAGS[self._state]

    def _on_text(self, text: str) -> None:
        if self._state is _State.CONTENT:
            self.log.add_content(text)
        elif self._state in (_State.NAME, _State.PARAM_NAME):
            self._name += text
        elif self._state is _State.VALUE:
            self._raw_value += text
            if self._streams_value:
                self._send_value()

    def _on_tag(self, tag: str) -> None:
        if self._state in (_State.NAME, _State.PARAM_NAME):
            self._end_name(tag)
            return
        if self._state is _State.VALUE:
            self._close_param()
        if tag in (_FUNCTION_END, _CALL_END) and self._state in (_State.ARGS, _State.VALUE):
            self._close_call()
        self._state = _STATE_AFTER_TAG[tag]

    def _end_name(self, tag: str) -> None:
        """A function or parameter name has ended at `tag`: open the call or parameter, or skip it."""
        name, self._name = self._name.strip(), ""
        well_formed = tag == ">" and bool(name)
        if self._state is _State.NAME:
            self._state = _State.ARGS if well_formed else _State.SKIP
            if well_formed:
                self._open_call(name)
        else:
            self._state = _State.VALUE if well_formed else _State.ARGS
            if well_formed:
                self._open_param(name)

    def _open_call(self, name: str) -> None:
        self._function, self._properties, self._param_count = name, function_properties(self._tools, name), 0
        self.log.start_call(name)

    def _close_call(self) -> None:
        self.log.add_arguments("}" if self._param_count else "{}")

    def _open_param(self, name: str) -> None:
        self._param, self._param_schema = name, (self._properties or {}).get(name)
        self._streams_value = schema_types(self._param_schema) == {"string"}
        self._raw_value, self._value_sent = "", 0
        if self._streams_value:
            self.log.add_arguments(self._key_prefix() + '"')

    def _close_param(self) -> None:
        if self._streams_value:
            self._send_value()
            self.log.add_arguments('"')
            return
        start, end = _value_span(self._raw_value)
        value = convert_param_value(self._raw_value[start:end], self._param_schema, self._param, self._function)
        self.log.add_arguments(self._key_prefix() + json.dumps(value, ensure_ascii=False))

    def _key_prefix(self) -> str:
        """`{"key": ` for the first parameter, `, "key": ` for the others."""
        self._param_count += 1
        return ("{" if self._param_count == 1 else ", ") + json.dumps(self._param, ensure_ascii=False) + ": "

    def _send_value(self) -> None:
        start, end = _value_span(self._raw_value)
        self.log.add_arguments(_json_string_body(self._raw_value[start + self._value_sent:end]))
        self._value_sent = end - start


class Qwen3XMLToolParser(ToolParser):
    """Content is all text outside the tool calls; when the output calls a tool, content that is only
    whitespace (the newlines between calls) is none."""

    hold_blank_content = True

    def _new_machine(self, request: ParserRequest | None) -> CallMachine:
        return _XmlCallMachine(CallLog(self.hold_blank_content), self._tools(request))
