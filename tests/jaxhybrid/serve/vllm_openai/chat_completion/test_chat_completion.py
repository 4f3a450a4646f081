"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_completion.py: structured outputs that do
not compile (a JSON schema with a non-schema property, a broken regex, a grammar naming an undefined rule, an
empty grammar) are 400s; truncate_prompt_tokens keeps the first or the last tokens of the rendered chat, as
truncation_side says. (Its kv_transfer_params tests are out of scope, SKIPS.md.)"""

from __future__ import annotations

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

INVALID_JSON_SCHEMA = {
    "$defs": {"CarType": {"enum": ["sedan", "SUV", "Truck", "Coupe"], "title": "CarType", "type": "string"}},
    "properties": {"brand": {"title": "Brand", "type": "string"}, "model": {"title": "Model", "type": "string"},
                   "car_type": {"$ref": "#/$defs/CarType"}, "foo": "bar"},
    "required": ["brand", "model", "car_type"], "title": "CarDescription", "type": "object"}
INVALID_SQL_GRAMMAR = """
        root ::= select_statementinvalidsyntax

        select_statement ::= "SELECT " column " from " table " where " condition

        column ::= "col_1 " | "col_2 "

        table ::= "table_1 " | "table_2 "

        condition ::= column "= " number

        number ::= "1 " | "2 "
    """


def test_invalid_json_schema(client) -> None:
    prompt = "Generate a JSON with the brand, model and car_type ofthe most iconic car from the 90's"
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                       extra_body={"structured_outputs": {"json": INVALID_JSON_SCHEMA}})


def test_invalid_regex(client):
    prompt = ("Generate an email address for Alan Turing, who works in Enigma.End in .com and new line. Example "
              "result:alan.turing@enigma.com\n")
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                       extra_body={"structured_outputs": {"regex": r"[.*"}, "stop": ["\n"]})


def test_invalid_grammar(client):
    prompt = "Generate an SQL query to show the 'username' and 'email'from the 'users' table."
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                       extra_body={"structured_outputs": {"grammar": INVALID_SQL_GRAMMAR}})


def test_empty_grammar(client) -> None:
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello"}],
                                       extra_body={"structured_outputs": {"grammar": ""}})


def test_chat_completion_truncation_side_controls_prompt_truncation(client) -> None:
    messages = [{"role": "user", "content": "Summarize how prompt truncation works in one sentence."}]

    full_completion = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1,
                                                     temperature=0.0, extra_body={"return_token_ids": True})
    full_token_ids = full_completion.prompt_token_ids
    assert full_token_ids is not None
    assert len(full_token_ids) > 4

    right_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right_completion.prompt_token_ids == full_token_ids[:4]

    left_completion = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert left_completion.prompt_token_ids == full_token_ids[-4:]
