"""Port of vLLM's tests/v1/entrypoints/llm/test_struct_output_generate.py: structured outputs through `LLM.generate` on
the embedded model, one LLM per setting for the module. vLLM's backend x model x speculative matrix becomes K = 0
here (the MTP head drafting K = 3, where vLLM runs ngram or EAGLE drafts, is the `llm` fixture's note); our one
backend is llguidance (vLLM's "guidance", with the `disable_any_whitespace` vLLM turns on for it). Cases about other
backends, structural tags and Mistral tokenizers are listed in tests/jaxhybrid/STRUCT_OUTPUT_SKIPS.md.

The embedded model's text is random by design, so every assert about the constraint is kept (json.loads and
jsonschema, re.fullmatch, choice membership, the SQL grammars' sixteen sentences enumerated here since `lark` is not
installed) and what only a real model's judgement gives is not asserted: the SQL grammars allow col_1 or col_2,
table_1 or table_2, 1 or 2, so "the SQL is SELECT col_1 from table_1 where col_1 = 1" is dropped (the output is one
of the sentences), and so are "12,742" (a fact about the Earth) and John Smith's name and age. JSON that only a
model that ends its strings would finish is bounded: the employee and the xgrammar-unsupported schemas get lengths,
counts and number ranges (a narrowing of vLLM's schema: outputs are validated against both), objects are closed
(vLLM's `disable_additional_properties`), a JSON object of any shape gets a logit_bias toward closing its strings
and braces (tests/jaxhybrid/serve/test_agents.py), and every sampled request is seeded, so each case is the same on
every run and ends with finish_reason "stop".
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import re
from enum import StrEnum
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.llm import LLM
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.sample.structured_outputs import StructuredOutputsParams
from jaxhybrid.structured_output import GrammarCompiler
from tests.jaxhybrid.engine_helpers import greedy_continuation
from tests.jaxhybrid.serve.test_agents import END_OF_THINKING, marker_tokenizer

# max_model_len 512 holds vLLM's employee prompt with its schema (334 tokens) and the bounded reply
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, num_blocks=8 * 33, num_state_slots=48,
             mamba_block_size=16, token_buckets=(64,), row_buckets=(8,))


@functools.cache
def make_llm(k: int, tokenizer: str | None = None, reasoning_parser: str | None = None) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLM(speculative_config=spec, tokenizer=tokenizer, reasoning_parser=reasoning_parser, **SMALL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """vLLM's test_structured_output matrix runs each case with and without speculative decoding; here the cases
    run without drafts (the suite's time), and the same constraints with the MTP head drafting 3 run in
    tests/jaxhybrid/test_structured_outputs.py (greedy output equal to K = 0, sampled outputs valid) and in the
    reasoning matrix below."""
    return make_llm(0)


# vLLM's fixtures (tests/conftest.py there), by their names
@pytest.fixture
def sample_regex() -> str:
    return r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


SAMPLE_JSON_SCHEMA = {  # vLLM's sample_json_schema fixture
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "grade": {"type": "string", "pattern": "^[A-D]$"},
        "email": {"type": "string", "pattern": "^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$"},
        "work_history": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"company": {"type": "string"},
                               "duration": {"type": "number", "minimum": 0.0, "maximum": 100.0},
                               "position": {"type": "string"}},
                "required": ["company", "duration", "position"],
                "additionalProperties": False,
            },
            "minItems": 0,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "skills", "grade", "email", "work_history"],
    "additionalProperties": False,
}


@pytest.fixture
def sample_json_schema() -> dict[str, Any]:
    return copy.deepcopy(SAMPLE_JSON_SCHEMA)


@pytest.fixture
def unsupported_json_schema() -> dict[str, Any]:
    """A schema xgrammar refuses (multipleOf, string lengths); llguidance compiles it."""
    return {
        "type": "object",
        "properties": {"score": {"type": "integer", "multipleOf": 5},
                       "tags": {"type": "array", "items": {"type": "string", "minLength": 10, "maxLength": 20}}},
        "required": ["score", "tags"],
        "additionalProperties": False,
    }


@pytest.fixture
def sample_structured_outputs_choices() -> list[str]:
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


@pytest.fixture
def sample_sql_ebnf() -> str:
    return """
root ::= select_statement
select_statement ::= "SELECT" column "from" table "where" condition
column ::= "col_1" | "col_2"
table ::= "table_1" | "table_2"
condition ::= column "=" number
number ::= "1" | "2"
"""


@pytest.fixture
def sample_sql_lark() -> str:
    return """
start: select_statement
select_statement: "SELECT" column "from" table "where" condition
column: "col_1" | "col_2"
table: "table_1" | "table_2"
condition: column "=" number
number: "1" | "2"
"""


# Every sentence of the two SQL grammars (neither lets whitespace in), written out independently of them.
SQL_SENTENCES = {f"SELECT{column}from{table}where{condition}={number}" for column, table, condition, number
                 in itertools.product(("col_1", "col_2"), ("table_1", "table_2"), ("col_1", "col_2"), ("1", "2"))}
SQL_PROMPT = "Generate a sql statement that selects col_1 from table_1 where it is equal to 1. " \
             "Make the response as short as possible."


def bounded_employee(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's sample_json_schema narrowed to replies with an end: string lengths, an age range, at most three
    skills, and whole-number durations (a number's fraction has no end)."""
    bounded = copy.deepcopy(schema)
    properties = bounded["properties"]
    properties["name"]["maxLength"] = 10
    properties["age"].update(minimum=0, maximum=99)
    properties["skills"].update(maxItems=3)
    properties["skills"]["items"]["maxLength"] = 10
    properties["email"]["maxLength"] = 20
    job = properties["work_history"]["items"]["properties"]
    job["company"]["maxLength"] = job["position"]["maxLength"] = 10
    job["duration"]["type"] = "integer"
    return bounded


def bounded_unsupported(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's unsupported_json_schema with a score range (a multiple of 5 has no end of digits) and at most two
    tags; its multipleOf and tag lengths stay."""
    bounded = copy.deepcopy(schema)
    bounded["properties"]["score"].update(minimum=0, maximum=100)
    bounded["properties"]["tags"].update(maxItems=2)
    return bounded


def texts(outputs: list[RequestOutput]) -> list[str]:
    """Every completion's text; each ended on its own (eos), not at max_tokens."""
    completions = [completion for output in outputs for completion in output.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [(c.finish_reason, c.text) for c in completions]
    return [completion.text for completion in completions]


def seeded(params: SamplingParams, count: int, first: int = 0) -> list[SamplingParams]:
    """`count` copies of params with seeds first, first + 1, ...: vLLM's `[prompt] * 2` with one unseeded
    SamplingParams, made the same on every run."""
    return [dataclasses.replace(params, seed=first + i) for i in range(count)]


def test_json_schema(llm, sample_json_schema):
    """vLLM's test 1: an employee profile for the schema in the prompt, twice."""
    schema = bounded_employee(sample_json_schema)
    params = SamplingParams(temperature=1.0, max_tokens=160, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    prompt = ("Give an example JSON for an employee profile that fits this schema. Make the response as short as "
              f"possible. Schema: {sample_json_schema}")
    outputs = llm.generate([prompt] * 2, seeded(params, 2), use_tqdm=False)
    for output, generated_text in zip(outputs, texts(outputs), strict=True):
        assert isinstance(output, RequestOutput) and output.prompt == prompt
        assert "\n" not in generated_text
        output_json = json.loads(generated_text)
        jsonschema.validate(instance=output_json, schema=schema)
        jsonschema.validate(instance=output_json, schema=sample_json_schema)


def test_json_object(llm):
    """vLLM's test 2: any JSON object, two samples. Keys and strings have no end for a random model, so a
    logit_bias favours the tokens that close strings and braces (not whitespace: disable_any_whitespace)."""
    params = SamplingParams(temperature=1.0, max_tokens=100, n=2, seed=0, logit_bias=closing_bias(llm, 4.0),
                            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    outputs = llm.generate("Generate a JSON object with curly braces for a person with name and age fields for "
                           "John Smith who is 31 years old. Make the response as short as possible.", params,
                           use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0].outputs) == 2
    for generated_text in texts(outputs):
        assert isinstance(json.loads(generated_text), dict), generated_text


@functools.cache
def _closing_tokens(llm: LLM) -> tuple[int, ...]:
    tokenizer = llm.get_tokenizer()
    pieces = {i: tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)}
    return tuple(i for i, piece in pieces.items() if piece and set(piece) <= set('"}]'))


def closing_bias(llm: LLM, value: float) -> dict[int, float]:
    return {token: value for token in _closing_tokens(llm)}


def test_schema_xgrammar_does_not_support(llm, unsupported_json_schema):
    """vLLM's test 3, its llguidance branch: multipleOf and string lengths compile and hold."""
    schema = bounded_unsupported(unsupported_json_schema)
    params = SamplingParams(temperature=1.0, max_tokens=100, seed=0, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    outputs = llm.generate("Give an example JSON object for a grade that fits this schema: "
                           f"{unsupported_json_schema}. Make the response as short as possible.", params,
                           use_tqdm=False)
    (generated_text,) = texts(outputs)
    parsed_json = json.loads(generated_text)
    assert isinstance(parsed_json, dict)
    jsonschema.validate(instance=parsed_json, schema=unsupported_json_schema)


@pytest.mark.parametrize("grammar", ["sample_sql_ebnf", "sample_sql_lark"])
def test_sql_grammar(llm, grammar, request):
    """vLLM's tests 4 (GBNF) and 5 (Lark). The grammar picks neither the column nor the table nor the number,
    so the reply is one of its sentences, not necessarily the one the prompt asks for (module docstring)."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0,
                            structured_outputs=StructuredOutputsParams(grammar=request.getfixturevalue(grammar)))
    (generated_text,) = texts(llm.generate(SQL_PROMPT, params, use_tqdm=False))
    assert generated_text.strip() in SQL_SENTENCES, generated_text


def test_invalid_grammar(llm):
    """vLLM's test 6: the error names the field and says what failed, nothing stays queued, the LLM goes on."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(grammar="not a grammar"))
    with pytest.raises(ValueError, match="structured_outputs.grammar .*Failed to convert the grammar "):
        llm.generate(SQL_PROMPT, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.structured.grammars
    choice = SamplingParams(seed=0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert texts(llm.generate(SQL_PROMPT, choice, use_tqdm=False))[0] in ("yes", "no")


def test_regex(llm, sample_regex):
    """vLLM's test 7: an IPv4 address, twice (its default 16 tokens hold the longest, 15 characters)."""
    params = SamplingParams(temperature=0.8, top_p=0.95,
                            structured_outputs=StructuredOutputsParams(regex=sample_regex))
    prompt = (f"Give an example IPv4 address with this regex: {sample_regex}. Make the response as short as "
              "possible. Retrun only the IPv4.")
    for generated_text in texts(llm.generate([prompt] * 2, seeded(params, 2), use_tqdm=False)):
        assert re.fullmatch(sample_regex, generated_text) is not None, generated_text


def test_choice(llm, sample_structured_outputs_choices):
    """vLLM's test 8."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0,
                            structured_outputs=StructuredOutputsParams(choice=sample_structured_outputs_choices))
    (generated_text,) = texts(llm.generate("The best language for type-safe systems programming is (Make the "
                                           "response as short as possible.) ", params, use_tqdm=False))
    assert generated_text in sample_structured_outputs_choices


class CarType(StrEnum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"
    coupe = "Coupe"


class CarDescription(BaseModel):
    brand: str
    model: str
    car_type: CarType


def test_pydantic_model_with_an_enum(llm):
    """vLLM's test 9: CarDescription's schema as pydantic writes it ($defs, $ref). Its strings have no bound:
    with the object closed and no whitespace, a seeded reply ends (tests/jaxhybrid/test_structured_outputs.py
    counts how many of 16 do)."""
    json_schema = CarDescription.model_json_schema()
    params = SamplingParams(temperature=1.0, max_tokens=400, seed=0, structured_outputs=StructuredOutputsParams(
        json=json_schema, disable_any_whitespace=True, disable_additional_properties=True))
    (generated_text,) = texts(llm.generate("Generate a JSON with the brand, model and car_type of the most iconic "
                                           "car from the 90's. Make the response as short as possible. Return only "
                                           "the json.", params, use_tqdm=False))
    output_json = json.loads(generated_text)
    jsonschema.validate(instance=output_json, schema=json_schema)
    assert CarDescription.model_validate(output_json).car_type in CarType


def test_min_and_max_length(llm):
    """vLLM's test 10: a string of exactly 50 characters."""
    json_schema = {"type": "object", "properties": {"description": {"type": "string", "maxLength": 50,
                                                                    "minLength": 50}},
                   "required": ["description"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, max_tokens=400, seed=0, structured_outputs=StructuredOutputsParams(
        json=json_schema, disable_any_whitespace=True))
    (generated_text,) = texts(llm.generate("Generate a description of a frog using 50 characters. Make the "
                                           "response as short as possible.", params, use_tqdm=False))
    output_json = json.loads(generated_text)
    jsonschema.validate(instance=output_json, schema=json_schema)
    assert len(output_json["description"]) == 50


def test_structural_tag_is_refused():
    """vLLM's test 11 needs `structural_tag`, which this API refuses (STRUCT_OUTPUT_SKIPS.md)."""
    tag = json.dumps({"type": "structural_tag", "structures": [], "triggers": ["<function="]})
    with pytest.raises(ValueError, match="structured_outputs.structural_tag is not supported"):
        StructuredOutputsParams.from_dict({"structural_tag": tag})
    with pytest.raises(TypeError):
        StructuredOutputsParams(structural_tag=tag)


REASONING_PROMPT = ("Solve the following math problem step-by-step, then provide the final answer as JSON object "
                    "with a single key 'result'. Make sure to correct your reasoning if there are any issue should "
                    "it arise.\nProblem: What is 5 * 8 + 2?")
REASONING_SCHEMA = {"type": "object", "properties": {"result": {"type": "integer"}}, "required": ["result"],
                    "additionalProperties": False}
REASONING_BIAS = 8.0  # on </think>: at temperature 0.1, a few tokens of reasoning (seed 0), then its end


@pytest.mark.parametrize(("reasoning_parser", "k"), [("deepseek_r1", 3), ("qwen3", 0)],
                         ids=["deepseek_r1-K=3", "qwen3-K=0"])
def test_structured_output_with_reasoning_matrices(tmp_path_factory, reasoning_parser, k):
    """vLLM's reasoning matrix (DeepSeek-R1 with speculative decoding, Qwen3 with `<think>` in the prompt) on the
    embedded model with test_agents.py's marker tokenizer: the grammar starts where the reasoning ends, the
    parser splits the text, the content is the schema's. A logit_bias makes the random model write `</think>`
    after a few tokens of reasoning, and the result gets a range (its digits have no end)."""
    tokenizer = marker_tokenizer(tmp_path_factory.mktemp("markers"))
    llm = make_llm(k, str(tokenizer), reasoning_parser)
    schema = copy.deepcopy(REASONING_SCHEMA)
    schema["properties"]["result"].update(minimum=0, maximum=999)
    prompt = REASONING_PROMPT + ("<think>\n" if reasoning_parser == "qwen3" else "")
    params = SamplingParams(temperature=0.1, max_tokens=64, seed=0, logit_bias={END_OF_THINKING: REASONING_BIAS},
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    (generated_text,) = texts(llm.generate([prompt], params, use_tqdm=False))
    reasoning, content = llm.reasoning_parser.extract_reasoning(generated_text, None)
    assert content is not None and reasoning, generated_text
    assert generated_text == reasoning + "</think>" + content
    output_json = json.loads(content)
    jsonschema.validate(instance=output_json, schema=schema)
    jsonschema.validate(instance=output_json, schema=REASONING_SCHEMA)


def test_structured_output_auto_mode(llm, unsupported_json_schema):
    """vLLM's backend "auto" falls back from xgrammar; here the one backend takes the schema, and the same
    SamplingParams serve a second generate unchanged."""
    schema = bounded_unsupported(unsupported_json_schema)
    params = SamplingParams(temperature=1.0, max_tokens=100, seed=1, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    before = copy.deepcopy(params)
    prompt = ("Give an example JSON object for a grade that fits this schema: "
              f"{unsupported_json_schema}. Make the response as short as possible.")
    outputs = llm.generate(prompt, params, use_tqdm=False)
    outputs.extend(llm.generate(prompt, params, use_tqdm=False))
    assert params == before
    first, second = texts(outputs)
    assert first == second  # seeded
    jsonschema.validate(instance=json.loads(first), schema=unsupported_json_schema)


def test_no_additional_properties(llm):
    """vLLM's test_guidance_no_additional_properties: asked for a1 ... a20, a closed object holds a1, a2, a3
    only. The greedy model's strings run on, so they get a length (outputs are validated against vLLM's schema
    too); the open schema would have let a4 in: the grammar is checked after the three keys, both ways."""
    schema = {"type": "object", "properties": {"a1": {"type": "string"}, "a2": {"type": "string"},
                                               "a3": {"type": "string"}},
              "required": ["a1", "a2", "a3"]}
    bounded = copy.deepcopy(schema)
    for field in bounded["properties"].values():
        field["maxLength"] = 8
    prompt = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
              "<|im_start|>user\nPlease generate a large JSON object with key-value pairs a1=b1, a2=b2, ..., a20=b20. "
              "Make the response as short as possible.<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0, max_tokens=256, structured_outputs=StructuredOutputsParams(
        json=bounded, disable_any_whitespace=True, disable_additional_properties=True))
    (generated_text,) = texts(llm.generate(prompt, params, use_tqdm=False))
    generated = json.loads(generated_text)
    jsonschema.validate(instance=generated, schema=bounded)
    jsonschema.validate(instance=generated, schema=schema)
    assert set(generated) == {"a1", "a2", "a3"}

    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(tokenizer.to_json(), llm.model.config.vocab_size, [tokenizer.eos_token_id])
    three_keys, fourth_key = tokenizer.encode('{"a1":"b1","a2":"b2","a3":"b3"'), tokenizer.encode(',"a4"')
    closed = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=True)
    open_ = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    for structured, accepted in ((closed, 0), (open_, len(fourth_key))):
        matcher = compiler.compile(structured)
        assert matcher.consume_tokens(three_keys)
        assert matcher.validate_tokens(fourth_key) == accepted


def test_structured_output_batched_with_non_guided_requests(llm, sample_json_schema):
    """A constrained and an unconstrained request in one batch: the JSON holds, and the greedy free text is the
    full forward's continuation (vLLM asks for "12,742", a fact a random model does not know), which is no
    JSON."""
    schema = bounded_employee(sample_json_schema)
    guided_prompt = ("Give an example JSON for an employee profile that fits this schema. Make the response as short "
                     f"as possible. Schema: {sample_json_schema}")
    non_guided_prompt = "The diameter of the Earth in kilometers is "
    sampling_params = [
        SamplingParams(temperature=1.0, max_tokens=160, seed=2, structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True)),
        SamplingParams(seed=42, temperature=0, top_p=1.0, ignore_eos=True),  # no max_tokens: vLLM's 16
    ]
    outputs = llm.generate([guided_prompt, non_guided_prompt], sampling_params, use_tqdm=False)
    guided = outputs[0].outputs[0]
    assert guided.finish_reason == "stop" and "\n" not in guided.text
    output_json = json.loads(guided.text)
    jsonschema.validate(instance=output_json, schema=schema)
    jsonschema.validate(instance=output_json, schema=sample_json_schema)

    free = outputs[1]
    assert free.outputs[0].token_ids == greedy_continuation(llm.model, tuple(free.prompt_token_ids), 16)
    with pytest.raises(ValueError):
        json.loads(free.outputs[0].text)
