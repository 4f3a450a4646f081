"""Port of vLLM's tests/entrypoints/openai/completion/test_prompt_validation.py (its text-prompt part): a
prompt token id outside the vocabulary is a 400 that says so. The prompt-embeds and hidden-state tests
are out of scope (SKIPS.md)."""

from __future__ import annotations

import re

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME


def test_out_of_vocab_token_ids(client):
    with pytest.raises(openai.BadRequestError, match=re.compile(".*out of vocabulary.*").pattern):
        client.completions.create(model=MODEL_NAME, prompt=[999999], max_tokens=5, temperature=0.0)
