"""Port of vLLM's tests/entrypoints/openai/completion/test_empty_prompt_list.py: an empty prompt list is a
validation error naming the prompt; a non-empty one is kept. vLLM refuses it when the request is built
and says "Either prompt or prompt_embeds must be provided"; this server has no prompt_embeds and refuses
it in `check()`, with param "prompt" (the match is on "prompt" for that reason)."""

from __future__ import annotations

import pytest

from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import CompletionRequest


def test_empty_prompt_list_rejected():
    with pytest.raises(BadRequest, match="prompt") as error:
        CompletionRequest(model="m", prompt=[]).check()
    assert error.value.param == "prompt"


def test_nonempty_prompt_list_ok():
    req = CompletionRequest(model="m", prompt=["hello"])
    req.check()
    assert req.prompt == ["hello"]
