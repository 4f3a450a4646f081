"""The app in process (httpx's ASGI transport) with faults injected into its engine: a stalled step turns
/health into 503 until it ends, and a failed step answers 500 (in-band once a stream has started) for
the requests it had started while the server keeps serving the rest."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from jaxhybrid.llm import LLM
from jaxhybrid.serve.app import ServerState, build_app
from jaxhybrid.serve.engine_loop import EngineLoop
from jaxhybrid.serve.metrics import ServerMetrics
from tests.jaxhybrid.serve.asgi import drive

PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, num_blocks=64, num_state_slots=12,
               token_buckets=(16,), row_buckets=(2,))


@pytest.fixture
def serve(llm, monkeypatch):
    """(run, runner): `run(coroutine_fn)` drives an app on a fresh engine loop with an httpx client."""
    config = llm.config
    metrics = ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode})
    loop = EngineLoop(llm.engine, metrics, watchdog_timeout=0.5, idle_poll=0.05)
    app = build_app(ServerState(llm, loop, ("tiny",), "embedded", config.max_model_len))

    return lambda body: drive(llm, loop, app, body)


def test_a_stalled_step_makes_health_503_until_it_ends(serve, llm, monkeypatch):
    release, step = threading.Event(), llm.engine.runner.dispatch

    def stalled(plan, *args):
        release.wait(30)
        return step(plan, *args)

    monkeypatch.setattr(llm.engine.runner, "dispatch", stalled)

    async def body(client: httpx.AsyncClient) -> None:
        assert (await client.get("/health")).status_code == 200
        request = asyncio.create_task(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}))
        deadline = time.monotonic() + 10
        while (await client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline, "the watchdog never fired"
            await asyncio.sleep(0.05)
        release.set()
        assert (await request).status_code == 200
        assert (await client.get("/health")).status_code == 200

    serve(body)


def test_a_failed_step_is_a_500_and_the_server_keeps_serving(serve, llm, monkeypatch):
    step, armed = llm.engine.runner.dispatch, threading.Event()

    def failing(plan, *args):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected device failure")
        return step(plan, *args)

    monkeypatch.setattr(llm.engine.runner, "dispatch", failing)
    long = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}

    async def body(client: httpx.AsyncClient) -> None:
        armed.set()
        response = await client.post("/v1/completions", json=long)
        assert response.status_code == 500 and response.json()["error"]["type"] == "InternalServerError"
        armed.set()
        async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
            assert stream.status_code == 200
            events = [line async for line in stream.aiter_lines() if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 500
        ok = await client.post("/v1/completions", json={**long, "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        metrics = (await client.get("/metrics")).text
        assert 'jaxhybrid:engine_failed_steps_total{model_name="tiny"} 2.0' in metrics

    serve(body)


def test_a_steps_outputs_reach_the_event_loop_in_one_call(serve, llm, monkeypatch):
    """Two streams decoding together: each step that has outputs wakes the event loop once, with both."""
    outputs_per_step, step = [], llm.engine.step

    def counting_step():
        outputs = step()
        if outputs:
            outputs_per_step.append(len(outputs))
        return outputs

    monkeypatch.setattr(llm.engine, "step", counting_step)
    calls = []

    async def body(client: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda callback, *args: (
            calls.append(len(args[0]) if callback.__name__ == "_put_all" else None), threadsafe(callback, *args))[1])
        long = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
        responses = await asyncio.gather(*(client.post("/v1/completions", json=long) for _ in range(2)))
        assert [r.status_code for r in responses] == [200, 200]

    serve(body)
    assert [c for c in calls if c is not None] == outputs_per_step and max(outputs_per_step) >= 2
