"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_usage_policy.py: usage is always in a plain
chat response, never in a stream unless stream_options.include_usage asks, and then in a final chunk."""

from __future__ import annotations

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME

COMMON = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=5,
              temperature=0.0)


class TestUsagePolicyDefault:
    def test_non_streaming(self, client):
        """Non-streaming always returns usage."""
        response = client.chat.completions.create(**COMMON, stream=False)
        assert response.usage is not None
        assert response.usage.prompt_tokens > 0
        assert response.usage.completion_tokens > 0

    def test_streaming_no_usage(self, client):
        """Streaming without stream_options returns no usage chunk."""
        usage_in_chunks = False
        for chunk in client.chat.completions.create(**COMMON, stream=True):
            if chunk.usage is not None and not chunk.choices:
                usage_in_chunks = True
        assert not usage_in_chunks

    def test_streaming_with_usage_option(self, client):
        """Streaming with stream_options.include_usage=True returns usage."""
        final_chunk_with_usage = False
        for chunk in client.chat.completions.create(**COMMON, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None and not chunk.choices:
                final_chunk_with_usage = True
                assert chunk.usage.prompt_tokens > 0
        assert final_chunk_with_usage
