"""Port of vLLM's tests/entrypoints/openai/completion/test_usage_policy.py: usage is always in a plain
response, never in a stream unless stream_options.include_usage asks, and then in a final chunk."""

from __future__ import annotations

from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME


class TestUsagePolicyDefault:
    def test_non_streaming(self, client):
        """Non-streaming always returns usage."""
        response = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0.0,
                                             stream=False)
        assert response.usage is not None
        assert response.usage.prompt_tokens > 0
        assert response.usage.completion_tokens > 0

    def test_streaming_no_usage(self, client):
        """Streaming without stream_options returns no usage chunk."""
        stream = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0.0,
                                           stream=True)
        usage_in_chunks = False
        for chunk in stream:
            if chunk.usage is not None and not chunk.choices:
                usage_in_chunks = True
        assert not usage_in_chunks

    def test_streaming_with_usage_option(self, client):
        """Streaming with stream_options.include_usage=True returns usage."""
        stream = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True})
        final_chunk_with_usage = False
        for chunk in stream:
            if chunk.usage is not None and not chunk.choices:
                final_chunk_with_usage = True
                assert chunk.usage.prompt_tokens > 0
        assert final_chunk_with_usage
