"""One request never hurts another: each probe an attacker sent to the server (oversized `n`, a 50 MB prompt,
unauthenticated tokenizing, new constraint widths, lone surrogates, malformed bodies, ids in errors) as a
test on the app in process, with the engine's compilations counted, /health timed beside the probe, and a
canary request that must still be served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import httpx
import jax
import pytest

from jaxhybrid.llm import LLM
from jaxhybrid.serve import __main__ as serve_main
from jaxhybrid.serve.app import build_app
from jaxhybrid.serve.engine_loop import EngineLoop
from jaxhybrid.serve.metrics import ServerMetrics
from jaxhybrid.serve.state import ServerState
from tests.jaxhybrid.serve.asgi import drive

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 4 << 20  # an [id] * 10**6 list (3 MB) fits, a 50 MB prompt does not
CANARY = {"prompt": "def read_config(path):\n", "max_tokens": 2, "temperature": 0}
HEALTH_BOUND = 0.1  # seconds: /health answers from the event loop alone, which no probe may hold up


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, num_blocks=64, num_state_slots=12,
               token_buckets=(32,), row_buckets=(4,), max_sampling_constraints=1024, precompile=True)


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """The jitted functions lowered to XLA while the block runs: a new shape or a new function each."""
    lowered: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture
def serve(llm) -> Callable[[Callable[[httpx.AsyncClient], Awaitable[None]]], None]:
    config = llm.config
    metrics = ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode})
    loop = EngineLoop(llm.engine, metrics, max_queued=8, max_queued_tokens=400, idle_poll=0.05)
    app = build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len), (KEY,),
                    max_body_bytes=MAX_BODY)
    return lambda body: drive(llm, loop, app, body)


def openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    """The error's message, after checking its status and its OpenAI shape."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


async def while_health_polled(client: httpx.AsyncClient, probe: Awaitable[httpx.Response]
                              ) -> tuple[httpx.Response, float]:
    """The probe's response and the event loop's worst stall while it ran: how late /health answered plus a
    10 ms sleep came back, beyond the sleep (a loop held up anywhere in between shows here)."""
    task, slowest = asyncio.ensure_future(probe), 0.0
    while not task.done():
        start = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        await asyncio.sleep(0.01)
        slowest = max(slowest, time.perf_counter() - start - 0.01)
    return await task, slowest


async def canary(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json=CANARY, headers=AUTH)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("n", [2**63, 2**64, 10**20, 20000, 5])
def test_n_beyond_the_batch_is_a_400(serve, n):
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={**CANARY, "n": n}, headers=AUTH)
        assert "max_num_seqs=4" in openai_error(response, 400, "n")
        await canary(client)
        assert (await client.get("/health")).status_code == 200

    serve(body)


@pytest.mark.parametrize(("extra", "param", "bound"), [
    ({"n": 5}, "n", "max_num_seqs=4"),
    ({"prompt": ["Hi"] * 9}, "prompt", "--max-num-queued-requests 8"),
    ({"prompt": ["Hi"] * 3, "n": 3}, "n", "--max-num-queued-requests 8"),
])
def test_a_request_that_can_never_run_is_a_400_not_a_429(serve, extra, param, bound):
    """n past a batch, or more sequences than the queue holds: no retry could help."""
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={**CANARY, **extra}, headers=AUTH)
        assert bound in openai_error(response, 400, param)
        fits = await client.post("/v1/completions", json={**CANARY, "prompt": ["Hi"] * 4, "n": 2}, headers=AUTH)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 8

    serve(body)


@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["a"] * 65}, "stop"), ({"stop": ["a" * 4097]}, "stop"), ({"stop_token_ids": list(range(1025))},
                                                                         "stop_token_ids"),
    ({"bad_words": ["x" * 200_000]}, "bad_words"), ({"messages": [{"role": "user", "content": "Hi"}] * 16385},
                                                     "messages"),
    ({"prompt": [[5]] * 5000}, "prompt"),
])
def test_long_lists_are_a_400_before_they_cost_anything(serve, extra, param):
    async def body(client: httpx.AsyncClient) -> None:
        path = "/v1/chat/completions" if "messages" in extra else "/v1/completions"
        response, slowest = await while_health_polled(client, client.post(path, json={**CANARY, **extra},
                                                                           headers=AUTH))
        openai_error(response, 400, param)
        assert slowest < 5 * HEALTH_BOUND

    serve(body)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "presence_penalty"])
def test_numbers_past_float32_are_a_400(serve, field):
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={**CANARY, field: 1e39}, headers=AUTH)
        openai_error(response, 400, field)

    serve(body)


def test_detokenize_takes_at_most_a_context(serve):
    async def body(client: httpx.AsyncClient) -> None:
        openai_error(await client.post("/detokenize", json={"tokens": [5] * 129}), 400, "tokens")
        assert (await client.post("/detokenize", json={"tokens": [5] * 128})).status_code == 200

    serve(body)


def test_a_50_mb_body_is_refused_while_health_answers(serve):
    async def body(client: httpx.AsyncClient) -> None:
        content = json.dumps({**CANARY, "prompt": "a b " * 12_500_000})  # encoded before the clock starts
        huge = client.post("/v1/completions", content=content, headers={**AUTH, "content-type": "application/json"})
        response, slowest = await while_health_polled(client, huge)
        assert "--max-request-body-bytes" in openai_error(response, 413, "body")
        # receiving the body up to the limit holds the loop for tens of ms on a loaded machine (parsing all
        # 50 MB would take about 60 ms more), tokenizing its 25M words seconds
        assert slowest < 5 * HEALTH_BOUND
        await canary(client)

    serve(body)


def test_a_body_without_a_length_is_cut_off_at_the_bound(serve):
    async def chunks():
        for _ in range(50):
            yield b"x" * (1 << 20)

    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", content=chunks(), headers=AUTH)
        assert "--max-request-body-bytes" in openai_error(response, 413, "body")
        await canary(client)

    serve(body)


def test_unauthenticated_tokenize_of_a_prompt_that_cannot_fit_is_refused_at_once(serve):
    async def body(client: httpx.AsyncClient) -> None:
        start = time.perf_counter()
        response, slowest = await while_health_polled(client, client.post("/tokenize", json={
            "prompt": "a b " * 200_000}))
        assert "maximum context length" in openai_error(response, 400, "prompt")
        assert time.perf_counter() - start < 1 and slowest < HEALTH_BOUND
        small = await client.post("/tokenize", json={"prompt": "a b " * 10})
        assert small.status_code == 200 and small.json()["count"] > 10

    serve(body)


def test_a_million_id_prompt_is_refused_without_holding_up_health(serve):
    """Parsing and validating a 3 MB body is the event loop's only work (tens of ms); checking the ids runs on a
    worker thread."""
    async def body(client: httpx.AsyncClient) -> None:
        probe = client.post("/v1/completions", json={**CANARY, "prompt": [5] * 10**6}, headers=AUTH)
        response, slowest = await while_health_polled(client, probe)
        assert "maximum context length" in openai_error(response, 400, "prompt")
        assert slowest < 5 * HEALTH_BOUND
        await canary(client)

    serve(body)


def test_tokenizing_runs_off_the_event_loop(serve):
    """A 3.6 MB prompt cut to its last 8 tokens is tokenized whole on a worker thread, with the GIL
    released: the event loop goes on. On the loop it would stall for the whole tokenization (about 2.5 s on
    two cores); off it, only for the conversion of the ids to a Python list (0.1-0.3 s on a loaded CI)."""
    async def body(client: httpx.AsyncClient) -> None:
        probe = client.post("/v1/completions", headers=AUTH, json={
            **CANARY, "prompt": "def f(x): return x\n" * 190_000, "truncate_prompt_tokens": 8})
        response, slowest = await while_health_polled(client, probe)
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 8
        assert slowest < 6 * HEALTH_BOUND

    serve(body)


def test_constraints_compile_nothing_and_too_many_are_a_400(serve, llm):
    vocab = llm.model.config.vocab_size
    allowed = {**CANARY, "allowed_token_ids": list(range(0, vocab, vocab // 1000))[:1000]}
    probes = [({**CANARY, "logit_bias": {str(t): 1.0 for t in range(vocab)}}, "logit_bias"),
              ({**CANARY, "bad_words": [f"w{i}" for i in range(10_000)]}, "bad_words")]

    async def body(client: httpx.AsyncClient) -> None:
        await canary(client)  # what serving compiles besides the step, once
        with counting_compiles() as lowered:
            first = await client.post("/v1/completions", json={**CANARY, "logit_bias": {"1": 2.0}}, headers=AUTH)
            assert first.status_code == 200
            response = await client.post("/v1/completions", json=allowed, headers=AUTH)
            assert response.status_code == 200
            duplicates = await client.post("/v1/completions", json={**CANARY, "allowed_token_ids": [7] * 10**6},
                                           headers=AUTH)
            assert duplicates.status_code == 200
            for probe, param in probes:
                message = openai_error(await client.post("/v1/completions", json=probe, headers=AUTH), 400, param)
                assert "max_sampling_constraints=1024" in message
            await canary(client)
        assert lowered == [], f"serving compiled {lowered}"

    serve(body)


def test_only_allowed_ids_come_out_even_when_repeated(serve, llm):
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", headers=AUTH, json={
            **CANARY, "temperature": 1.0, "max_tokens": 6, "allowed_token_ids": [7, 9] * 50_000,
            "return_token_ids": True})
        assert response.status_code == 200
        assert set(response.json()["choices"][0]["token_ids"]) <= {7, 9}

    serve(body)


@pytest.mark.parametrize("top_k", [2**31, 2**63 - 1])
def test_top_k_beyond_the_vocabulary_keeps_every_token(serve, top_k):
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json={**CANARY, "top_k": top_k}, headers=AUTH)
        plain = await client.post("/v1/completions", json=CANARY, headers=AUTH)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain.json()[
            "choices"][0]["text"]

    serve(body)


LONE = '"\\ud800"'  # the six characters of a JSON escape that is half a surrogate pair
SURROGATE_PROBES = [
    ("/v1/completions", '{"prompt": LONE, "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": LONE}]}'),
    ("/v1/completions", '{"prompt": "Hi", "bad_words": [LONE]}'),
    ("/v1/completions", '{"prompt": "Hi", "request_id": LONE}'),
    ("/tokenize", '{"prompt": LONE}'),
]


def test_lone_surrogates_are_a_400_and_one_log_line(serve, caplog):
    async def body(client: httpx.AsyncClient) -> None:
        for path, raw in SURROGATE_PROBES:
            response = await client.post(path, content=raw.replace("LONE", LONE),
                                         headers={**AUTH, "content-type": "application/json"})
            assert "surrogate" in openai_error(response, 400, "body")
        pair = await client.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}',
                                 headers={"content-type": "application/json"})
        assert pair.status_code == 200  # a whole pair is an emoji

    with caplog.at_level(logging.INFO, logger="jaxhybrid.serve"):
        serve(body)
    records = [r for r in caplog.records if r.name == "jaxhybrid.serve" and "surrogate" in r.getMessage()]
    assert len(records) == len(SURROGATE_PROBES) and not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(("method", "path", "raw", "status"), [
    ("POST", "/v1/completions", b'{"prompt": "Hi",', 400),
    ("POST", "/v1/completions", b"[" * 10_000 + b"]" * 10_000, 400),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 100 + b"1" + b"]" * 100 + b"}", 400),
    ("GET", "/v1/nope", None, 404),
    ("GET", "/v1/completions", None, 405),
    ("POST", "/health", b"{}", 405),
])
def test_every_error_has_an_openai_body(serve, method, path, raw, status):
    async def body(client: httpx.AsyncClient) -> None:
        response = await client.request(method, path, content=raw, headers={**AUTH, "content-type": "application/json"})
        openai_error(response, status)
        unauthorized = await client.post("/v1/completions", json=CANARY)
        openai_error(unauthorized, 401)

    serve(body)


def test_errors_do_not_leak_the_engine_ids(serve):
    async def body(client: httpx.AsyncClient) -> None:
        for bad in ({"prompt": [10**9]}, {"prompt": "Hi", "stop_token_ids": [10**9]}):
            response = await client.post("/v1/completions", json={**CANARY, **bad},
                                         headers={**AUTH, "X-Request-Id": "abc'def"})
            message = openai_error(response, 400)
            assert "abc" not in message and "cmpl" not in message, message

    serve(body)


def test_the_queue_is_bounded_in_prompt_tokens(serve, llm, monkeypatch):
    """With the engine held, four prompts of 100 tokens fill the 400-token queue and two more get a 429 naming
    the bound; a request that alone passes the bound is a 400, since no retry could help."""
    gate, step = threading.Event(), llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: gate.wait(30) and step())
    long = {**CANARY, "prompt": [5] * 100, "max_tokens": 20, "ignore_eos": True}

    async def body(client: httpx.AsyncClient) -> None:
        tasks = [asyncio.ensure_future(client.post("/v1/completions", json=long, headers=AUTH)) for _ in range(6)]
        deadline = time.monotonic() + 30
        while sum(t.done() for t in tasks) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        gate.set()
        statuses = sorted(r.status_code for r in await asyncio.gather(*tasks))
        assert statuses == [200] * 4 + [429] * 2, statuses
        busy = next(t.result() for t in tasks if t.result().status_code == 429)
        assert "--max-num-queued-tokens 400" in openai_error(busy, 429)
        alone = await client.post("/v1/completions", json={**long, "prompt": [5] * 101, "n": 4}, headers=AUTH)
        assert "--max-num-queued-tokens 400" in openai_error(alone, 400, "prompt")
        await canary(client)

    serve(body)


def test_a_request_of_a_whole_batch_shares_it_with_the_next_client(llm, monkeypatch):
    """n = max_num_seqs, then a canary, both queued before a step: admission gives each client its share of
    the rows, so the canary is served in the first steps instead of after the batch's 40 tokens."""
    config = llm.config
    loop = EngineLoop(llm.engine, ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode}),
                      idle_poll=0.05)
    gate, add = threading.Event(), llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *args, **kwargs: gate.wait(30) and add(*args, **kwargs))
    big = {**CANARY, "n": 4, "max_tokens": 40, "ignore_eos": True, "temperature": 1.0}

    async def body(client: httpx.AsyncClient) -> None:
        whole = asyncio.ensure_future(client.post("/v1/completions", json=big))
        small = asyncio.ensure_future(client.post("/v1/completions", json=CANARY))
        deadline = time.monotonic() + 30
        while loop.queued[0] < 5 and time.monotonic() < deadline:  # both in the engine's inbox
            await asyncio.sleep(0.02)
        gate.set()
        done, _ = await asyncio.wait({whole, small}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {small} and small.result().status_code == 200
        assert (await whole).status_code == 200 and len(whole.result().json()["choices"]) == 4

    drive(llm, loop, build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len)), body)


def test_the_engines_ids_are_cut_from_its_errors(llm, monkeypatch):
    """An engine error naming the request (as the scheduler's do) reaches the client without the id."""
    config = llm.config
    loop = EngineLoop(llm.engine, ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode}),
                      idle_poll=0.05)

    def refuse(request_id, *args, **kwargs):
        raise ValueError(f"request {request_id!r}: request {request_id!r} can never fit in 12 slots")

    monkeypatch.setattr(llm.engine, "add_request", refuse)

    async def body(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/completions", json=CANARY, headers={"X-Request-Id": "abc'def"})
        assert openai_error(response, 400) == "the request can never fit in 12 slots"

    drive(llm, loop, build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len)), body)


def test_a_stuck_engine_is_reported_and_the_server_exits(llm, monkeypatch):
    """The watchdog calls `on_stuck` once within its bound; the server's `on_stuck` exits with status 1."""
    config = llm.config
    metrics = ServerMetrics("tiny", config.max_model_len, 0, {"cache_mode": config.cache_mode})
    reasons: list[str] = []
    loop = EngineLoop(llm.engine, metrics, watchdog_timeout=0.4, idle_poll=0.05, on_stuck=reasons.append)
    stuck, has_requests = threading.Event(), llm.engine.has_unfinished_requests
    monkeypatch.setattr(llm.engine, "has_unfinished_requests", lambda: stuck.wait(5) and has_requests())
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while not reasons and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(reasons) == 1 and "has not completed" in reasons[0] and not loop.healthy()
    finally:
        stuck.set()
        loop.stop()
    exits: list[int] = []
    monkeypatch.setattr(serve_main.os, "_exit", exits.append)
    serve_main.exit_stuck("test")
    assert exits == [1]
