"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py:
stop_token_ids below the vocabulary size are taken; one past it, or negative, is a 400."""

from __future__ import annotations

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, VOCAB_SIZE


def test_chat_stop_token_ids_valid(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Testing valid stop token ids"}], max_tokens=5,
        extra_body={"stop_token_ids": [VOCAB_SIZE - 1]})
    assert completion.choices[0].message.content is not None


def test_chat_stop_token_ids_out_of_vocab(client):
    invalid_token_id = VOCAB_SIZE + 1
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing stop token ids"}],
                                       max_tokens=5, extra_body={"stop_token_ids": [invalid_token_id]})
    error = excinfo.value
    assert error.status_code == 400
    assert str(invalid_token_id) in str(error)
    assert str(VOCAB_SIZE) in str(error)


def test_chat_stop_token_ids_negative(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME,
                                       messages=[{"role": "user", "content": "Testing stop token ids"}],
                                       max_tokens=5, extra_body={"stop_token_ids": [-1]})
    assert excinfo.value.status_code == 400
