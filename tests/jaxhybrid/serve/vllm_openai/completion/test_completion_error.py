"""Port of vLLM's tests/entrypoints/openai/completion/test_completion_error.py: an engine output with
finish_reason "error" fails a plain request (the server's 500) and ends a stream with an in-band
"Internal server error" event then [DONE]; a json_schema response_format without its schema and negative prompt
token ids are refused. vLLM mocks its engine;
here the serving layer is fed hand-made outputs (`fakes.FakeStream`), and the prompt checks go over HTTP."""

from __future__ import annotations

import asyncio

import openai
import pytest

from jaxhybrid.openai.protocol import CompletionRequest
from jaxhybrid.serve import app, streaming
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME
from tests.jaxhybrid.serve.vllm_openai.fakes import FakeStream, collect, output, server_state

STATE = server_state()


def test_completion_error_non_stream():
    """finish_reason='error' is a 500 InternalServerError (non-streaming)."""
    request = CompletionRequest(model=MODEL_NAME, prompt="Test prompt", max_tokens=10, stream=False)
    streams = [FakeStream([output("", [], "error")])]
    with pytest.raises(streaming.EngineFailed):
        asyncio.run(app._completion_response(STATE, streams, [None], request, MODEL_NAME, "cmpl-test"))


def test_completion_error_stream():
    """finish_reason='error' is an in-band 500 InternalServerError (streaming)."""
    request = CompletionRequest(model=MODEL_NAME, prompt="Test prompt", max_tokens=10, stream=True)
    streams = [FakeStream([output("Hello", [100], None), output("Hello", [100], "error")])]
    chunks = streaming.completion_chunks(STATE, streams, [None], request, MODEL_NAME, "cmpl-test")
    response = streaming.sse(STATE, chunks)

    chunks = collect(response.body_iterator)

    assert len(chunks) >= 2
    assert any("Internal server error" in chunk for chunk in chunks), f"Expected error message in chunks: {chunks}"
    assert chunks[-1] == "data: [DONE]\n\n"


def test_json_schema_response_format_missing_schema():
    """response_format json_schema without its json_schema is a 400, not a 500 (vLLM refuses it as the request
    is built; here the request's sampling params are where its constraint is read)."""
    request = CompletionRequest(model=MODEL_NAME, prompt="Test prompt", max_tokens=10,
                                response_format={"type": "json_schema"})
    with pytest.raises(Exception, match="json_schema.*must be provided"):
        request.params({})


def test_negative_prompt_token_ids_nested(client):
    """Negative token IDs in prompt (nested list) are a validation error."""
    with pytest.raises(openai.BadRequestError, match="greater than or equal to 0"):
        client.completions.create(model=MODEL_NAME, prompt=[[-1]], max_tokens=10)


def test_negative_prompt_token_ids_flat(client):
    """Negative token IDs in prompt (flat list) are a validation error."""
    with pytest.raises(openai.BadRequestError, match="greater than or equal to 0"):
        client.completions.create(model=MODEL_NAME, prompt=[-1], max_tokens=10)
