"""Grammars from `StructuredOutputsParams`, compiled into llguidance matchers over the checkpoint's tokenizer.

Compiling is bounded: llguidance's parser limits (its defaults) cap the lexer's and the Earley parser's work
when a grammar is built and at every mask, so a pathological schema or regex ends in an error (a 400 at the
server) instead of a hung thread. A compiled grammar is kept by its text (`cache_size` of them): a batch of
requests with one schema compiles it once, and every sequence gets its own copy of the matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance

from jaxhybrid.sample.structured_outputs import StructuredOutputsParams

ReasoningEnd = Callable[[Sequence[int]], bool]  # do these tokens end the reasoning (a reasoning parser's test)


class GrammarError(ValueError):
    """A constraint that does not compile; the message names the field."""


class GrammarCompiler:
    """The checkpoint's tokenizer as llguidance sees it, and the grammars compiled for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 64):
        # the model's vocabulary may be padded past the tokenizer's: masks cover the logits, padding disallowed
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.mask_words = (vocab_size + 31) // 32
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `params` (GrammarError naming the field if it does not compile). Releases
        the GIL while it compiles: call it off the engine's thread."""
        grammar = self.serialize(params)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise GrammarError(f"structured_outputs.{params.kind} does not compile: {_first_line(compiled)}")
        with self._lock:
            self._compiled[grammar] = compiled
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()

    @staticmethod
    def serialize(params: StructuredOutputsParams) -> str:
        """llguidance's grammar text for `params` (GrammarError naming the field for a malformed spec)."""
        kind = params.kind
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                schema = json.loads(schema) if isinstance(schema, str) else schema
                if params.disable_additional_properties:
                    schema = _closed(schema)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
            return llguidance.grammar_from(kind, params.spec)  # regex; grammar: Lark or GBNF
        except (ValueError, TypeError, KeyError) as error:
            raise GrammarError(f"structured_outputs.{kind} is not valid: {error}") from error


def _first_line(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error().strip().splitlines()[0][:500]


_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "items", "prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _closed(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object that lists properties and says nothing."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: ({name: _closed(sub) for name, sub in value.items()} if key in _SCHEMA_MAPS
                    and isinstance(value, dict) else _closed(value) if key in _SUBSCHEMAS else value)
              for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


class SequenceGrammar:
    """One sequence's matcher, after the tokens it has emitted. With a reasoning parser, the grammar starts
    once the reasoning has ended: tokens before that leave the matcher alone."""

    def __init__(self, matcher: llguidance.LLMatcher, in_reasoning: bool = False):
        self.matcher, self.in_reasoning = matcher, in_reasoning

    def accept(self, tokens: Sequence[int], reasoning_end: ReasoningEnd | None) -> bool:
        """Advance past `tokens`; False if the grammar refused one (the matcher is then in its error state)."""
        for i, token in enumerate(tokens):
            if not self.in_reasoning:
                return self._consume(tokens[i:])
            self.in_reasoning = not reasoning_end([token])
        return True

    def _consume(self, tokens: Sequence[int]) -> bool:
        if self.matcher.is_stopped():  # the grammar is complete: only eos comes after it
            return True
        return self.matcher.consume_tokens(list(tokens))

    @property
    def error(self) -> str:
        return self.matcher.get_error()
