"""Port of vLLM's tests/entrypoints/openai/basic/test_basic.py: /version, /health, cancelling a flood of
requests whose clients time out, a wrong content type, and /health's 503 once the engine is dead, on an
in-process server whose --max-model-len fits the cancellation case's 10000 tokens.
GET /load (--enable-server-load-tracking) while a long completion runs.
--disable-frontend-multiprocessing has no counterpart here, so each test runs once."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from importlib.metadata import version
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from jaxhybrid.serve.app import build_app
from jaxhybrid.serve.state import ServerState
from tests.jaxhybrid.serve.vllm_openai.conftest import MODEL_NAME, InProcessServer, make_client


@pytest.fixture(scope="module")
def long_server(long_engine):
    server = InProcessServer(long_engine, {"server_load_tracking": True})
    yield server
    server.stop()


def test_show_version(long_server):
    response = httpx.get(f"{long_server.url}/version")
    response.raise_for_status()
    assert response.json() == {"version": version("jaxhybrid")}


def test_check_health(long_server):
    assert httpx.get(f"{long_server.url}/health").status_code == HTTPStatus.OK


def test_request_cancellation(long_server):
    # clunky test: send an ungodly amount of load in with short timeouts, then ensure that it still responds
    # quickly afterwards
    chat_input = [{"role": "user", "content": "Write a long story"}]

    async def flood() -> list[BaseException | None]:
        async with openai.AsyncOpenAI(base_url=f"{long_server.url}/v1", api_key="EMPTY", max_retries=0,
                                      timeout=0.5) as client:
            tasks = [asyncio.create_task(client.chat.completions.create(
                messages=chat_input, model=MODEL_NAME, max_tokens=10000, extra_body={"min_tokens": 10000}))
                for _ in range(200)]  # about 2 million tokens
            done, pending = await asyncio.wait(tasks, return_when=asyncio.ALL_COMPLETED)
            assert len(pending) == 0
            return [task.exception() for task in done]

    # every request was sent and timed out (not refused: a 400 would invalidate this test)
    for error in asyncio.run(flood()):
        assert isinstance(error, openai.APITimeoutError), error

    # had the server not cancelled the others, it could not answer this one within the timeout
    response = make_client(long_server, timeout=5).chat.completions.create(messages=chat_input, model=MODEL_NAME,
                                                                      max_tokens=10)
    assert len(response.choices) == 1


def test_request_wrong_content_type(long_server):
    with pytest.raises(openai.APIStatusError):
        make_client(long_server).chat.completions.create(
            messages=[{"role": "user", "content": "Write a long story"}], model=MODEL_NAME, max_tokens=10000,
            extra_headers={"Content-Type": "application/x-www-form-urlencoded"})


def test_server_load(long_server):
    # Check initial server load
    response = httpx.get(f"{long_server.url}/load")
    assert response.status_code == HTTPStatus.OK
    assert response.json().get("server_load") == 0

    def make_long_completion_request() -> httpx.Response:
        # min_tokens: the completion runs its 1000 tokens whatever this model's greedy text
        return httpx.post(f"{long_server.url}/v1/completions", timeout=600,
                          json={"prompt": "Give me a long story", "max_tokens": 1000, "temperature": 0,
                                "min_tokens": 1000})

    with ThreadPoolExecutor(1) as pool:
        completion = pool.submit(make_long_completion_request)
        # vLLM sleeps 0.1 s for the request to start; here /load is asked (a bounded number of times) until
        # it counts the request, each answer given while the request runs
        loads = []
        while not completion.done() and 1 not in loads and len(loads) < 10000:
            response = httpx.get(f"{long_server.url}/load")
            assert response.status_code == HTTPStatus.OK
            loads.append(response.json().get("server_load"))
        # the loop stops at the first answer that counts the request; it fails if the request ended first
        assert loads and loads[-1] == 1, f"/load never counted the running request: {loads[-10:]}"

        # Wait for the completion request to finish.
        assert completion.result().status_code == HTTPStatus.OK

    # Check server load after the completion request has finished.
    response = httpx.get(f"{long_server.url}/load")
    assert response.status_code == HTTPStatus.OK
    assert response.json().get("server_load") == 0


def test_health_check_engine_dead_error():
    """/health is 503 Service Unavailable once the engine is dead (vLLM: check_health raises
    EngineDeadError; here the engine loop reports itself unhealthy)."""
    dead_loop = SimpleNamespace(healthy=lambda: False)
    state = ServerState(built=None, loop=dead_loop, model_names=(MODEL_NAME,), model_root="", max_model_len=1)
    response = TestClient(build_app(state)).get("/health")  # no lifespan: the loop is never started
    assert response.status_code == 503
