"""`StructuredOutputsParams` with vLLM's names: one constraint on a request's output (a JSON schema, any JSON
object, a regex, a choice of strings, or a Lark/EBNF grammar), checked once. The grammar is compiled and
matched by `jaxhybrid.structured_output`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (the output is one of
    these strings), `grammar` (Lark, or GBNF/EBNF) and `json_object` (any JSON object) is set.

    disable_any_whitespace: JSON without whitespace between tokens; disable_additional_properties: a schema's
    objects take only the properties it lists (`additionalProperties: false` where it says nothing);
    whitespace_pattern: a regex for the whitespace JSON may hold between tokens."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is False:  # vLLM counts only a true json_object as a constraint
            object.__setattr__(self, "json_object", None)
        for problem in self._problems():
            raise ValueError(problem)

    def _problems(self) -> list[str]:
        chosen = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(chosen) != 1:
            found = ", ".join(chosen) or "none"
            return [f"structured_outputs must set exactly one of {', '.join(KINDS)}; found {found}"]
        checks = [
            ("json", self.json is None or isinstance(self.json, dict) or (isinstance(self.json, str) and _is_object(
                self.json)), "a JSON schema: an object, or its JSON text"),
            ("regex", self.regex is None or (isinstance(self.regex, str) and self.regex), "a non-empty string"),
            ("choice", self.choice is None or (isinstance(self.choice, tuple) and self.choice and all(
                isinstance(c, str) for c in self.choice)), "a non-empty list of strings"),
            ("grammar", self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip()),
             "a non-empty Lark or EBNF grammar"),
            ("json_object", self.json_object in (None, True), "a bool"),
            ("whitespace_pattern", self.whitespace_pattern is None or isinstance(self.whitespace_pattern, str),
             "a regex or None"),
        ]
        return [f"structured_outputs.{name} must be {rule}" for name, ok, rule in checks if not ok]

    @property
    def kind(self) -> str:
        """The constraint set: one of `KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object; unknown keys are a ValueError naming them."""
        known = set(KINDS) | {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
        unknown = sorted(set(fields) - known - {"structural_tag", "disable_fallback"})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields: {', '.join(unknown)}")
        if fields.get("structural_tag") is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        return cls(**{key: value for key, value in fields.items() if key in known})


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
