"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_error.py (text parts; the image, audio
and video system-message warnings are out of scope, SKIPS.md): an engine output with finish_reason "error"
fails a plain chat request (the server's 500) and ends a stream with an in-band "Internal server error" event
then [DONE]; system messages of text or text parts are accepted; a json_schema response_format without its
schema is refused.
vLLM mocks its engine; here the serving layer is fed hand-made outputs (`fakes.FakeStream`)."""

from __future__ import annotations

import asyncio

import pytest

from jaxhybrid.openai.protocol import ChatCompletionRequest
from jaxhybrid.serve import app, streaming
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME
from tests.jaxhybrid.serve.vllm_openai.fakes import FakeStream, collect, output, prompt, server_state


def test_chat_error_non_stream():
    """finish_reason='error' is a 500 InternalServerError (non-streaming)."""
    request = ChatCompletionRequest(model=MODEL_NAME, messages=[{"role": "user", "content": "Test prompt"}],
                                    max_tokens=10, stream=False)
    with pytest.raises(streaming.EngineFailed):
        asyncio.run(app._chat_response(server_state(), [FakeStream([output("", [], "error")])], request, MODEL_NAME,
                                       "chatcmpl-test"))


def test_chat_error_stream():
    """finish_reason='error' is an in-band 500 InternalServerError (streaming)."""
    request = ChatCompletionRequest(model=MODEL_NAME, messages=[{"role": "user", "content": "Test prompt"}],
                                    max_tokens=10, stream=True)
    streams = [FakeStream([output("Hello", [100], None), output("Hello", [100], "error")])]
    state = server_state()
    chunks = streaming.chat_chunks(state, streams, prompt(), request, MODEL_NAME, "chatcmpl-test")
    response = streaming.sse(state, chunks)

    chunks = collect(response.body_iterator)

    assert len(chunks) >= 2
    assert any("Internal server error" in chunk for chunk in chunks), f"Expected error message in chunks: {chunks}"
    assert chunks[-1] == "data: [DONE]\n\n"


def test_system_message_accepts_text():
    request = ChatCompletionRequest(model=MODEL_NAME,
                                    messages=[{"role": "system", "content": "You are a helpful assistant."}])
    assert request.messages[0]["role"] == "system"


def test_system_message_accepts_text_array():
    request = ChatCompletionRequest(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]}])
    assert request.messages[0]["role"] == "system"


def test_json_schema_response_format_missing_schema():
    """response_format json_schema without its json_schema is a 400, not a 500 (vLLM refuses it as the request
    is built; here the request's sampling params are where its constraint is read)."""
    request = ChatCompletionRequest(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                    response_format={"type": "json_schema"})
    with pytest.raises(Exception, match="json_schema.*must be provided"):
        request.params({})
