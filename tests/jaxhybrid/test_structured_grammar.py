"""Structured outputs below the engine: the params' rules, grammars compiled by llguidance (errors name the
field, pathological specs end in an error or a bounded time), the host's masks along a verify row's drafts
against a one-token-at-a-time walk of the grammar, and the device's bit unpacking against numpy."""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.sample.rows import allowed_tokens
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams
from jaxhybrid.structured_output import GrammarCompiler, GrammarError, MaskRow, SequenceGrammar, fill_token_masks
from tests.jaxhybrid.engine_helpers import default_tokenizer

CAR = {"type": "object", "properties": {"brand": {"type": "string"}, "model": {"type": "string"},
                                        "car_type": {"type": "string", "enum": ["sedan", "SUV", "Truck", "Coupe"]}},
       "required": ["brand", "model", "car_type"]}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = default_tokenizer()
    return GrammarCompiler(tokenizer.to_json(), 4096, [tokenizer.eos_token_id])


def allowed(matcher: llguidance.LLMatcher) -> set[int]:
    words = np.frombuffer(matcher.compute_bitmask(), np.uint8)
    return set(np.flatnonzero(np.unpackbits(words, bitorder="little")).tolist())


@pytest.mark.parametrize(("fields", "named"), [
    ({}, "exactly one"), ({"json": CAR, "regex": "a+"}, "exactly one"), ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"), ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"), ({"grammar": "  "}, "structured_outputs.grammar"),
])
def test_params_name_what_is_wrong(fields, named):
    with pytest.raises(ValueError, match=named):
        StructuredOutputsParams(**fields)


def test_unknown_and_unsupported_fields_are_refused():
    with pytest.raises(ValueError, match="unknown fields: bogus"):
        StructuredOutputsParams.from_dict({"regex": "a", "bogus": 1})
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams.from_dict({"structural_tag": "{}"})
    assert StructuredOutputsParams.from_dict({"choice": ["x"], "json_object": False}).kind == "choice"


@pytest.mark.parametrize(("fields", "field"), [
    ({"regex": "(a"}, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json"),
])
def test_a_grammar_that_does_not_compile_names_its_field(compiler, fields, field):
    with pytest.raises(GrammarError, match=field):
        compiler.compile(StructuredOutputsParams(**fields))


def test_each_kind_constrains_the_first_token(compiler):
    tokenizer = default_tokenizer()
    first = lambda text: tokenizer.encode(text)[0]
    choice = compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    assert {first("yes"), first("no")} <= allowed(choice)
    assert first("maybe") not in allowed(choice) or tokenizer.decode([first("maybe")]) in ("yes", "no")
    regex = compiler.compile(StructuredOutputsParams(regex="[0-9]+"))
    assert all(tokenizer.decode([t]).isdigit() for t in allowed(regex))
    obj = compiler.compile(StructuredOutputsParams(json_object=True))
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed(obj))
    lark = compiler.compile(StructuredOutputsParams(grammar='start: "ab" | "cd"'))
    assert all(tokenizer.decode([t]) in ("a", "ab", "c", "cd") for t in allowed(lark))


def test_closed_schemas_refuse_other_properties(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tokenizer = default_tokenizer()
    extra = tokenizer.encode('{"a":1,"b":2}')
    open_matcher = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    closed = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                                      disable_additional_properties=True))
    assert open_matcher.validate_tokens(extra) == len(extra)
    assert closed.validate_tokens(extra) < len(extra)


def test_pathological_specs_end_in_an_error_or_a_bounded_time(compiler):
    nested = {"type": "object", "properties": {}}
    inner = nested
    for _ in range(300):
        inner["properties"]["x"] = {"type": "object", "properties": {}}
        inner = inner["properties"]["x"]
    specs = [StructuredOutputsParams(json=nested),
             StructuredOutputsParams(json={"enum": [f"value-{i}" for i in range(10_000)]}),
             StructuredOutputsParams(regex="(a+)+$" * 50), StructuredOutputsParams(regex="(x|y|xy)*" * 200 + "z")]
    for params in specs:
        start = time.perf_counter()
        try:
            matcher = compiler.compile(params)
            allowed(matcher)  # the first mask too
        except GrammarError:
            pass
        # llguidance's default limits: about 20 ms of lexer fuel to build, 15 ms of fuel per mask; far below this
        assert time.perf_counter() - start < 10, params.kind


@st.composite
def drafts_along(draw):
    """A JSON text the grammar accepts, a cut in it, and drafts after the cut: some the text's own tokens,
    maybe followed by one the grammar refuses."""
    tokenizer = default_tokenizer()
    value = {"brand": draw(st.text("abcxyz ", max_size=6)), "model": draw(st.text("0123abc", max_size=6)),
             "car_type": draw(st.sampled_from(["sedan", "SUV", "Truck", "Coupe"]))}
    tokens = tokenizer.encode(json.dumps(value, separators=(",", ":")))
    cut = draw(st.integers(0, len(tokens) - 1))
    drafts = tokens[cut:cut + draw(st.integers(1, 3))]
    if draw(st.booleans()):
        drafts = [*drafts, draw(st.integers(0, 4095))]
    return tokens[:cut], drafts


@settings(max_examples=25, deadline=None)
@given(drafts_along())
def test_masks_along_drafts_match_a_token_by_token_walk(compiler, case):
    """Entry j's mask is the grammar's after the first j drafts (llguidance validates and rolls back); past a
    draft it refuses, the entries allow everything; the matcher itself does not move."""
    emitted, drafts = case
    matcher = compiler.compile(StructuredOutputsParams(json=CAR, disable_any_whitespace=True))
    assert matcher.consume_tokens(emitted)
    masks = np.full((8, compiler.mask_words), -1, np.int32)
    fill_token_masks(llguidance.LLExecutor(), [MaskRow(SequenceGrammar(matcher), 2, drafts)], masks, None)
    walk = matcher.deep_copy()
    refused = False
    for j in range(len(drafts) + 1):
        bits = set(np.flatnonzero(np.unpackbits(masks[2 + j].view(np.uint8), bitorder="little")).tolist())
        assert bits == (set(range(4096)) if refused else allowed(walk)), j
        if j < len(drafts) and not refused:
            refused = not walk.consume_token(drafts[j])
    for row in (0, 1, *range(3 + len(drafts), 8)):
        assert (masks[row] == -1).all()
    untouched = compiler.compile(StructuredOutputsParams(json=CAR, disable_any_whitespace=True))
    untouched.consume_tokens(emitted)
    assert allowed(matcher) == allowed(untouched)


def test_a_reasoning_row_is_free_until_the_draft_that_ends_it(compiler):
    end = 7  # a token standing for `</think>`
    reasoning_end = lambda tokens: end in tokens
    grammar = SequenceGrammar(compiler.compile(StructuredOutputsParams(choice=("yes",))), in_reasoning=True)
    masks = np.full((4, compiler.mask_words), -1, np.int32)
    fill_token_masks(llguidance.LLExecutor(), [MaskRow(grammar, 0, [11, end, 12])], masks, reasoning_end)
    assert (masks[0] == -1).all() and (masks[1] == -1).all()  # before and at the end token: free
    assert allowed(grammar.matcher) == set(np.flatnonzero(np.unpackbits(masks[2].view(np.uint8),
                                                                        bitorder="little")).tolist())
    assert grammar.accept([11, end], reasoning_end) and not grammar.in_reasoning
    assert grammar.matcher.validate_tokens([11]) == 0  # the grammar has taken nothing yet


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([1, 31, 32, 33, 100]), st.data())
def test_device_unpacks_the_host_bits(vocab, data):
    words = (vocab + 31) // 32
    masks = np.array(data.draw(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), min_size=words, max_size=words),
                                        min_size=1, max_size=3)), np.int32)
    expected = np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(masks), vocab)), expected)
