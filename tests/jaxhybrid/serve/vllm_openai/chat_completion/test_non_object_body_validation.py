"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_non_object_body_validation.py: a body that
is not a JSON object fails validation (a 4xx), never an AttributeError (a 500); an empty cache_salt is
still refused. The cache_salt check lives in the engine here, so it is exercised over HTTP."""

from __future__ import annotations

import openai
import pytest
from pydantic import ValidationError

from jaxhybrid.openai.protocol import ChatCompletionRequest
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME


@pytest.mark.parametrize("payload", ["this is not valid json{{{", ["not", "an", "object"], 42, None])
def test_chat_completion_request_rejects_non_object_body(payload):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(payload)


def test_chat_completion_request_cache_salt_still_validated_on_dict(client):
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                       extra_body={"cache_salt": ""})
