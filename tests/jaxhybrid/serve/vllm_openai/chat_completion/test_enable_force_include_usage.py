"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_enable_force_include_usage.py: a server
started with --enable-force-include-usage puts usage in every chunk of every stream, asked or not (an
in-process server with that flag, on the package's in-process engine)."""

from __future__ import annotations

import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, InProcessServer, make_client


@pytest.fixture(scope="module")
def chat_client_with_force_include_usage(long_engine):
    server = InProcessServer(long_engine, force_include_usage=True)
    yield make_client(server)
    server.stop()


def test_chat_with_enable_force_include_usage(chat_client_with_force_include_usage):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    stream = chat_client_with_force_include_usage.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=10, extra_body=dict(min_tokens=10),
        temperature=0.0, stream=True)
    last_completion_tokens = 0
    for chunk in stream:
        assert chunk.usage.prompt_tokens >= 0
        assert (last_completion_tokens == 0 or chunk.usage.completion_tokens > last_completion_tokens
                or (not chunk.choices and chunk.usage.completion_tokens == last_completion_tokens))
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        last_completion_tokens = chunk.usage.completion_tokens
