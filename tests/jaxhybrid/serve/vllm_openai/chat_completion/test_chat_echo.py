"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_chat_echo.py: chat echo with
continue_final_message, prompt_logprobs=-1 and top_logprobs=-1 (the whole vocabulary), on an in-process
server whose --max-logprobs is the vocabulary size, as vLLM's."""

from __future__ import annotations

import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import (
    BOUNDED,
    MODEL_NAME,
    VOCAB_SIZE,
    InProcessServer,
    make_client,
)


@pytest.fixture(scope="module")
def client(long_engine):
    server = InProcessServer(long_engine)
    yield make_client(server)
    server.stop()


@pytest.mark.parametrize("echo", [True, False])
def test_chat_session_with_echo_and_continue_final_message(client, echo: bool):
    saying: str = "Here is a common saying about apple. An apple a day, keeps"
    chat_completion = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False, **BOUNDED})
    assert chat_completion.id is not None
    assert len(chat_completion.choices) == 1

    choice = chat_completion.choices[0]
    assert choice.finish_reason == "stop"

    message = choice.message
    if echo:
        assert message.content is not None and saying in message.content
    else:
        assert message.content is not None and saying not in message.content
    assert message.role == "assistant"


BEIJING = [{"role": "system", "content": "You are a helpful assistant."},
           {"role": "user", "content": "Beijing is the capital of which country?"}]


def test_prompt_logprobs(client):
    # unlike vLLM's, one new token: what is checked is the prompt's, and this model samples for thousands
    completion = client.chat.completions.create(model=MODEL_NAME, messages=BEIJING, max_tokens=1,
                                                extra_body={"prompt_logprobs": -1})
    assert completion.prompt_logprobs is not None
    assert len(completion.prompt_logprobs) > 0


def test_top_logprobs(client):
    completion = client.chat.completions.create(model=MODEL_NAME, messages=BEIJING, max_tokens=1,
                                                extra_body={"top_logprobs": -1, "logprobs": "true"})
    assert completion.choices[0].logprobs is not None
    assert completion.choices[0].logprobs.content is not None
    assert len(completion.choices[0].logprobs.content) > 0
    assert len(completion.choices[0].logprobs.content[0].top_logprobs) == VOCAB_SIZE
