"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_serving_chat.py (the cases whose behaviour this
server has): the response names the first served model name whichever alias (or none) the request gave, and
truncation_side picks which end of a rendered chat truncate_prompt_tokens keeps. vLLM drives a mocked
`OpenAIServingChat`; here the requests go to in-process servers on the session `LLM`, each with max_tokens=1 so
that it ends (vLLM's mocked engine returns at once). The cases left out are in SKIPS.md."""

from __future__ import annotations

import httpx
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, SERVER_FLAGS, InProcessServer

MODEL_NAME_SHORT = "jaxhybrid"  # vLLM's second served name ("gpt2" beside "openai-community/gpt2")


@pytest.fixture(scope="module")
def aliased_server(session_llm):
    process = InProcessServer(session_llm, SERVER_FLAGS, model_names=(MODEL_NAME, MODEL_NAME_SHORT))
    yield process
    process.stop()


def _chat(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "what is 1+1?"}], "max_tokens": 1, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_serving_chat_returns_correct_model_name(aliased_server):
    # Test that full name is returned when short name is requested
    assert _chat(aliased_server, model=MODEL_NAME_SHORT)["model"] == MODEL_NAME

    # Test that full name is returned when empty string is specified
    assert _chat(aliased_server, model="")["model"] == MODEL_NAME

    # Test that full name is returned when no model is specified
    assert _chat(aliased_server)["model"] == MODEL_NAME


def _render_chat_prompt_token_ids(server, messages: list[dict], truncate_prompt_tokens: int | None = None,
                                  truncation_side: str | None = None) -> list[int]:
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0.0, "return_token_ids": True,
            "truncate_prompt_tokens": truncate_prompt_tokens, "truncation_side": truncation_side}
    prompt_token_ids = _chat(server, **{k: v for k, v in body.items() if v is not None})["prompt_token_ids"]
    assert prompt_token_ids is not None
    return prompt_token_ids


def test_serving_chat_truncation_side_controls_prompt_truncation(server):
    messages = [{"role": "user", "content": "Summarize how prompt truncation works in one sentence."}]

    full_token_ids = _render_chat_prompt_token_ids(server, messages)
    assert len(full_token_ids) > 4

    right_token_ids = _render_chat_prompt_token_ids(server, messages, truncate_prompt_tokens=4,
                                                    truncation_side="right")
    assert right_token_ids == full_token_ids[:4]

    left_token_ids = _render_chat_prompt_token_ids(server, messages, truncate_prompt_tokens=4,
                                                   truncation_side="left")
    assert left_token_ids == full_token_ids[-4:]
