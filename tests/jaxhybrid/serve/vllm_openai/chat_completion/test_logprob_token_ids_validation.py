"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_logprob_token_ids_validation.py: an empty
`logprob_token_ids`, or one without logprobs, is refused naming the field; a non-list is a validation
error. vLLM refuses when the request is built; this server in `check()`. A well-formed one is refused too,
as not supported (SKIPS.md)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import BatchChatCompletionRequest, ChatCompletionRequest, CompletionRequest

MODELS = [ChatCompletionRequest, CompletionRequest, BatchChatCompletionRequest]
BASE = {ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        CompletionRequest: {"model": "m", "prompt": "hi"},
        BatchChatCompletionRequest: {"messages": [[{"role": "user", "content": "hi"}]]}}


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("logprobs", [None, False, True])
def test_rejects_empty_token_ids(cls, logprobs):
    data = {**BASE[cls], "logprob_token_ids": []}
    if logprobs is not None:
        data["logprobs"] = logprobs
    with pytest.raises(BadRequest, match="must not be an empty list") as exc:
        cls.model_validate(data).check()
    assert exc.value.param == "logprob_token_ids"


@pytest.mark.parametrize("cls", MODELS)
def test_rejects_token_ids_without_logprobs(cls):
    with pytest.raises(BadRequest, match="when using `logprob_token_ids`") as exc:
        cls.model_validate({**BASE[cls], "logprob_token_ids": [100]}).check()
    assert exc.value.param == "logprob_token_ids"


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("val", [123, "123"])
def test_defers_non_list_to_pydantic(cls, val):
    with pytest.raises(ValidationError):
        cls.model_validate({**BASE[cls], "logprob_token_ids": val})


@pytest.mark.parametrize("cls", MODELS)
def test_refuses_well_formed_token_ids_as_unsupported(cls):
    with pytest.raises(BadRequest, match="not supported") as exc:
        cls.model_validate({**BASE[cls], "logprob_token_ids": [100], "logprobs": 1}).check()
    assert exc.value.param == "logprob_token_ids"
