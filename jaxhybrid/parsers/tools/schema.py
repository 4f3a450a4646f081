"""Typing a tool argument that the model wrote as text (the XML formats) by the tool's JSON schema."""

from __future__ import annotations

import ast
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..messages import ToolLike

logger = logging.getLogger(__name__)

# Type names that schemas written by hand (and models) use for the JSON ones.
_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
    "num": "number", "float": "number", "float32": "number", "float64": "number", "double": "number",
    "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array",
}
_ENUM_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def function_properties(tools: Sequence[ToolLike], name: str) -> Mapping[str, Any] | None:
    """The `properties` of the schema of the tool called `name`; None when it has none."""
    for tool in tools:
        if tool.function.name == name:
            parameters = tool.function.parameters
            properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
            return properties if isinstance(properties, Mapping) else None
    return None


def _declared_types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    declared = schema.get("type")
    names = [declared] if isinstance(declared, str) else declared if isinstance(declared, list) else []
    types = {_ALIASES.get(name.strip().lower(), name.strip().lower()) for name in names if isinstance(name, str)}
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        types.add(next((kind for cls, kind in _ENUM_TYPES if isinstance(value, cls)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else []:
            types |= _declared_types(choice)
    return types


def schema_types(schema: Any) -> set[str]:
    """The JSON types that `schema` allows (`type`, `enum` values, `anyOf`/`oneOf`/`allOf`); a string when it
    says nothing."""
    return _declared_types(schema) or {"string"}


def _as_null(text: str) -> tuple[bool, Any]:
    return text.strip().lower() == "null", None


def _as_integer(text: str) -> tuple[bool, Any]:
    try:
        return True, int(text)
    except ValueError:
        return False, None


def _as_number(text: str) -> tuple[bool, Any]:
    try:
        value = float(text)
    except ValueError:
        return False, None
    if not math.isfinite(value):  # JSON has no inf or nan
        return False, None
    return True, int(value) if value.is_integer() else value


def _as_boolean(text: str) -> tuple[bool, Any]:
    word = text.strip().lower()
    return word in ("true", "1", "false", "0"), word in ("true", "1")


def _as_container(kind: type) -> Callable[[str], tuple[bool, Any]]:
    def parse(text: str) -> tuple[bool, Any]:
        for load in (json.loads, ast.literal_eval):  # models also write Python's repr: {'key': 'value'}
            try:
                value = load(text.strip())
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(value, kind):
                return True, value
        return False, None
    return parse


# Tried in this order: the first type the text reads as wins.
_READERS: tuple[tuple[str, Callable[[str], tuple[bool, Any]]], ...] = (
    ("null", _as_null), ("integer", _as_integer), ("number", _as_number), ("boolean", _as_boolean),
    ("object", _as_container(dict)), ("array", _as_container(list)), ("string", lambda text: (True, text)),
)


def convert_param_value(text: str, schema: Any, param_name: str, func_name: str) -> Any:
    """The value of argument text `text` under `schema`: the first allowed type it reads as; the text itself,
    with a warning, when it reads as none of them."""
    types = schema_types(schema)
    for kind, read in _READERS:
        if kind in types:
            ok, value = read(text)
            if ok:
                return value
    logger.warning("tool %s: argument %s is %.200r, not a %s; it is passed on as a string", func_name, param_name,
                   text, " or ".join(sorted(types)))
    return text
