"""The app in process (httpx's ASGI transport) with faults injected into its engine: a stalled step turns
/health into 503 until it ends, and a failed step answers 500 (in-band once a stream has started) for
the requests it had started while the server keeps serving the rest. The loop's operator logs (the stats line,
the request log) and the waiting-by-reason split it exports."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.stat_logger import RequestLogger, StatLogger
from jaxhybrid.llm import LLM
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve.app import build_app
from jaxhybrid.serve.engine_loop import EngineLoop
from jaxhybrid.serve.metrics import ServerMetrics
from jaxhybrid.serve.state import ServerState
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
    app = build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len))

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


class _Clock:
    """The stats line's clock, moved by the test: a line is due exactly when the test says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _records(caplog, name: str, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name and text in r.getMessage()]


def test_the_stats_and_request_lines_report_what_ran(llm, caplog):
    """The engine thread logs the stats line once its interval is up, with the interval's throughput from the
    engine's own totals, and each request as it is taken and as it ends."""
    caplog.set_level(logging.INFO, "jaxhybrid")
    config, clock = llm.config, _Clock()
    metrics = ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode})
    loop = EngineLoop(llm.engine, metrics, watchdog_timeout=5.0, idle_poll=0.02,
                      stat_logger=StatLogger(interval=2.0, device="CPU", clock=clock),
                      request_logger=RequestLogger(max_log_len=6))
    app = build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len))
    before = dataclasses.replace(llm.engine.stats)

    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert response.status_code == 200
        assert not _records(caplog, "jaxhybrid.stats", "Avg prompt throughput")  # the interval is not up
        clock.now = 2.0
        deadline = time.monotonic() + 10
        while not _records(caplog, "jaxhybrid.stats", "Avg prompt throughput"):
            assert time.monotonic() < deadline, "no stats line"
            await asyncio.sleep(0.02)

    drive(llm, loop, app, body)
    prompt = (llm.engine.stats.prefill_tokens - before.prefill_tokens) / 2
    assert prompt > 0
    (line,) = _records(caplog, "jaxhybrid.stats", "Avg prompt throughput")
    assert line.getMessage().startswith(f"Engine 000: Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation "
                                        "throughput: 1.5 tokens/s, Running: 0 reqs, Waiting: 0 reqs, CPU KV cache "
                                        "usage: 0.0%, State slot usage: 0.0%, Prefix cache hit rate: ")
    (received,) = _records(caplog, "jaxhybrid.requests", "Received request")
    (finished,) = _records(caplog, "jaxhybrid.requests", "Finished request")
    request_id = received.getMessage().split()[2].rstrip(":")
    assert f"prompt: {PROMPT[:6]!r}, prompt_tokens: {len(llm.tokenizer.encode(PROMPT))}, " in received.getMessage()
    assert "max_tokens=3" in received.getMessage()
    assert finished.getMessage().startswith(f"Finished request {request_id}: finish_reason: length, ")
    assert "generation_tokens: 3" in finished.getMessage()


def test_without_its_loggers_the_loop_logs_no_stats_or_requests(serve, caplog):
    caplog.set_level(logging.DEBUG, "jaxhybrid")

    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 200

    serve(body)
    assert not [r for r in caplog.records if r.name in ("jaxhybrid.stats", "jaxhybrid.requests")]


@pytest.mark.parametrize("flags, stats, requests", [([], True, False),
                                                    (["--disable-log-stats", "--enable-log-requests"], False, True)])
def test_the_server_flags_turn_the_loggers_on_and_off(llm, monkeypatch, flags, stats, requests):
    """vLLM's --disable-log-stats (stats on by default) and --enable-log-requests (off by default)."""
    from jaxhybrid.serve import __main__ as server

    monkeypatch.setattr(server, "build_engine", lambda args, background_compile: llm.built)
    _, state = server.build_server(server.parse_args([*flags, "--max-log-len", "8"]))
    assert (state.loop.stat_logger is not None) == stats
    assert (state.loop.request_logger is not None) == requests
    assert not requests or state.loop.request_logger.max_log_len == 8


def test_consumers_waiting_for_their_checkpoint_are_deferred(llm):
    """Two requests with the same checkpoint: while the first produces it (a 16-token chunk a step), the second
    waits for it, which the waiting-by-reason series reports as deferred rather than waiting for capacity."""
    engine, metrics = llm.engine, ServerMetrics("tiny", llm.config.max_model_len, 0, {"cache_mode": "align"})
    prompt = Prompt(tuple(range(5, 105)), checkpoint_position=64)
    for request_id in ("producer", "consumer"):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    metrics.observe_engine(engine.load(), engine.stats)
    assert engine.load()[:2] == (1, 1) and engine.load().deferred == 1
    waiting = {s.labels["reason"]: s.value for family in text_string_to_metric_families(metrics.exposition().decode())
               if family.name == "jaxhybrid:num_requests_waiting_by_reason" for s in family.samples}
    assert waiting == {"capacity": 0.0, "deferred": 1.0}
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.load().deferred == 0 and finished["consumer"].num_cached_tokens >= 64
    assert [finished[r].metrics.num_preemptions for r in ("producer", "consumer")] == [0, 0]
