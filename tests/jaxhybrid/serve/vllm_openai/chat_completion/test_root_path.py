"""Port of vLLM's tests/entrypoints/openai/chat_completion/test_root_path.py: with --root-path /llm and an API
key, chat completions are served both at /v1 and at /llm/v1, and the key is checked on both. vLLM's key comes
from VLLM_API_KEY, ours from the app's `api_keys` (--api-key); the server is the long engine's, as in
test_chat_echo.py, and the request is that module's, bounded the same way."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import openai
import pytest

from tests.jaxhybrid.serve.vllm_openai.conftest import BOUNDED, MODEL_NAME, InProcessServer

API_KEY = "abc-123"
ERROR_API_KEY = "abc"
ROOT_PATH = "llm"


@pytest.fixture(scope="module")
def server(long_engine):
    process = InProcessServer(long_engine, {"api_keys": (API_KEY,), "root_path": "/" + ROOT_PATH})
    yield process
    process.stop()


class Case(NamedTuple):
    model_name: str
    base_url: list[str]
    api_key: str
    expected_error: Any


@pytest.mark.parametrize("test_case", [
    Case(model_name=MODEL_NAME, base_url=["v1"], api_key=ERROR_API_KEY,
             expected_error=openai.AuthenticationError),
    Case(model_name=MODEL_NAME, base_url=[ROOT_PATH, "v1"], api_key=ERROR_API_KEY,
             expected_error=openai.AuthenticationError),
    Case(model_name=MODEL_NAME, base_url=["v1"], api_key=API_KEY, expected_error=None),
    Case(model_name=MODEL_NAME, base_url=[ROOT_PATH, "v1"], api_key=API_KEY, expected_error=None),
])
def test_chat_session_root_path_with_api_key(server, test_case: Case):
    saying: str = "Here is a common saying about apple. An apple a day, keeps"
    ctx = contextlib.nullcontext()
    if test_case.expected_error is not None:
        ctx = pytest.raises(test_case.expected_error)
    with ctx:
        client = openai.OpenAI(api_key=test_case.api_key, base_url="/".join([server.url, *test_case.base_url]),
                               max_retries=0, timeout=600)  # the openai client's default: a hang bound
        chat_completion = client.chat.completions.create(
            model=test_case.model_name,
            messages=[{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False, **BOUNDED})

        assert chat_completion.id is not None
        assert len(chat_completion.choices) == 1
        choice = chat_completion.choices[0]
        assert choice.finish_reason == "stop"
        message = choice.message
        assert len(message.content) > 0
        assert message.role == "assistant"
