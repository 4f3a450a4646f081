"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_cache_accounting.py: `usage` counts the prompt
tokens read from the prefix cache as `cache_read_input_tokens`, none on a cold request and some when the
same prompt comes again, streamed (the final usage chunk) or not. vLLM's server is fresh, so its first
request is cold; the session's server has served other modules' prompts, so each test salts its prompts
with a fresh `cache_salt` (a cache of its own) instead. A hybrid model's prefix cache holds recurrent states
every --mamba-block-size tokens (64), so the system message is long enough to fill such a block."""

from __future__ import annotations

import uuid

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

SYSTEM = "You are a helpful assistant. " * 12  # vLLM's system message, repeated past one 64-token block


def _fresh_cache() -> dict:
    return {"extra_body": {"cache_salt": uuid.uuid4().hex}}


def test_cache_accounting_non_streaming(client):
    """Second request with same prefix should show cache hits."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the capital of France?"}]
    salt = _fresh_cache()

    # first request: cold, nothing cached yet
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5,
                                           temperature=0.0, **salt)
    assert first.usage is not None
    assert hasattr(first.usage, "cache_read_input_tokens")
    assert first.usage.cache_read_input_tokens == 0

    # second request: same prefix, should hit the cache
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5,
                                            temperature=0.0, **salt)
    assert second.usage is not None
    assert second.usage.cache_read_input_tokens > 0


def test_cache_accounting_streaming(client):
    """Streaming: final usage chunk should contain cache fields."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the capital of Germany?"}]
    salt = _fresh_cache()

    # warm the cache
    client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5, temperature=0.0,
                                   **salt)

    # second request streaming
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5,
                                            temperature=0.0, stream=True, stream_options={"include_usage": True},
                                            **salt)
    final_usage = None
    for chunk in stream:
        if chunk.usage is not None:
            final_usage = chunk.usage

    assert final_usage is not None
    assert hasattr(final_usage, "cache_read_input_tokens")
    assert final_usage.cache_read_input_tokens > 0
