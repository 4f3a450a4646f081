"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py: logit_bias
takes token ids below the vocabulary size; an id past it, a key that is not an integer or a value that is
not a number is a 400 naming the field and every offending key."""

from __future__ import annotations

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, VOCAB_SIZE


def test_chat_logit_bias_valid(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Testing valid logit bias"}], max_tokens=5,
        logit_bias={str(VOCAB_SIZE - 1): 1.0})
    assert completion.choices[0].message.content is not None


def test_chat_logit_bias_invalid(client):
    invalid_token_id = VOCAB_SIZE + 1
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing invalid logit bias"}],
                                       max_tokens=5, logit_bias={str(invalid_token_id): 1.0})
    error = excinfo.value
    assert error.status_code == 400
    assert str(invalid_token_id) in str(error)
    assert str(VOCAB_SIZE) in str(error)


def test_chat_logit_bias_non_integer_key(client):
    """A non-integer key is refused with a message naming it, not a raw int() error."""
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing invalid logit bias key"}],
                                       max_tokens=5, logit_bias={"not_a_token_id": 50})
    assert excinfo.value.status_code == 400
    assert "not_a_token_id" in str(excinfo.value)
    assert "logit_bias" in str(excinfo.value)


def test_chat_logit_bias_non_numeric_value(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing invalid logit bias value"}],
                                       max_tokens=5, logit_bias={"1": "not_a_number"})
    assert excinfo.value.status_code == 400
    assert "logit_bias" in str(excinfo.value)


def test_chat_logit_bias_multiple_non_integer_keys(client):
    """Every bad key is reported, not just the first."""
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing multiple bad keys"}],
                                       max_tokens=5, logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert excinfo.value.status_code == 400
    assert "bad1" in str(excinfo.value)
    assert "bad2" in str(excinfo.value)
