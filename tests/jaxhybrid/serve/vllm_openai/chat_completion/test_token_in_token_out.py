"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_token_in_token_out.py: chat takes
pre-tokenized input (`prompt_token_ids`, with no messages) and generates exactly as from the messages it
came from; chat-template options next to it are a 400. vLLM runs dummy weights; this is the embedded
model on the session's server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


def _render_prompt_token_ids(server) -> list[int]:
    """The token ids the server renders MESSAGES to."""
    resp = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES}, timeout=60)
    resp.raise_for_status()
    return resp.json()["tokens"]


def test_chat_token_in_matches_messages(server, client):
    prompt_token_ids = _render_prompt_token_ids(server)
    baseline = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=16,
                                              temperature=0)
    token_in = client.chat.completions.create(model=MODEL_NAME, messages=[], max_completion_tokens=16,
                                              temperature=0,
                                              extra_body={"prompt_token_ids": prompt_token_ids,
                                                          "return_token_ids": True})

    # text out: pre-tokenized input still yields a detokenized message
    assert token_in.choices[0].message.content is not None
    # the engine saw exactly the ids we supplied
    assert token_in.prompt_token_ids == prompt_token_ids
    # identical prompt tokens -> identical greedy completion
    assert token_in.choices[0].message.content == baseline.choices[0].message.content


def test_chat_token_in_rejects_template_option(server, client):
    prompt_token_ids = _render_prompt_token_ids(server)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_completion_tokens=4,
                                       extra_body={"prompt_token_ids": prompt_token_ids,
                                                   "add_generation_prompt": True})
