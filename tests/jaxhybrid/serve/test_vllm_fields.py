"""vLLM's request fields and endpoints beyond the OpenAI basics, on the app in process (httpx's ASGI transport):
truncate_prompt_tokens (server and `LLM`), add_special_tokens, return_token_ids, return_tokens_as_token_ids,
continuous usage stats, text content parts, /tokenizer_info, X-Request-Id, the per-request metrics, and a 400
naming every vLLM field the server does not implement."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tokenizers.processors import TemplateProcessing

from jaxhybrid.llm import LLM
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve import middleware, streaming
from jaxhybrid.serve.app import build_app
from jaxhybrid.serve.engine_loop import EngineLoop
from jaxhybrid.serve.metrics import ServerMetrics, cache_config_info
from jaxhybrid.serve.state import ServerState
from tests.jaxhybrid.serve.asgi import drive

PROMPT = "def read_config(path):\n    with open(path) as f:\n"
CHAT = [{"role": "user", "content": "Write a function that reads a file."}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    # serial steps: a request's last step is counted before its output is out, so /metrics is settled then
    return LLM(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=128, num_blocks=64, num_state_slots=12,
               token_buckets=(16,), row_buckets=(2,), async_scheduling=False)


@pytest.fixture
def serve(llm):
    """`serve(body, **flags)` drives an app (with `build_app`'s flags, both on by default) on a fresh engine
    loop with an httpx client, then checks that nothing is left in the engine."""

    def run(body, request_id_headers: bool = True, tokenizer_info: bool = True, server_load_tracking: bool = False,
            **state_flags) -> None:
        config = llm.config
        loop = EngineLoop(llm.engine, ServerMetrics("tiny", config.max_model_len, 0, cache_config_info(config)),
                          idle_poll=0.05)
        app = build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len, **state_flags),
                        request_id_headers=request_id_headers, tokenizer_info=tokenizer_info,
                        server_load_tracking=server_load_tracking)
        drive(llm, loop, app, body)

    return run


def events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]", lines
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


async def ok(client: httpx.AsyncClient, path: str, body: dict, **kwargs) -> httpx.Response:
    response = await client.post(path, json=body, **kwargs)
    assert response.status_code == 200, response.text
    return response


def test_truncate_prompt_tokens_keeps_the_last_tokens(serve, llm):
    ids = llm.get_tokenizer().encode(PROMPT * 3)
    assert len(ids) > 20

    async def body(client: httpx.AsyncClient) -> None:
        cut = (await ok(client, "/v1/completions", {"prompt": ids, "max_tokens": 4, "truncate_prompt_tokens": 9,
                                                    **GREEDY})).json()
        tail = (await ok(client, "/v1/completions", {"prompt": ids[-9:], "max_tokens": 4, **GREEDY})).json()
        assert cut["usage"]["prompt_tokens"] == 9 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
        chat = (await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                          "truncate_prompt_tokens": 5})).json()
        assert chat["usage"]["prompt_tokens"] == 5
        for value, needle in [(129, "max_model_len (128)"), (0, ">= 1")]:
            response = await client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": value})
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "truncate_prompt_tokens", response.text
            assert needle in error["message"]

    serve(body)


def test_llm_truncate_prompt_tokens(llm):
    ids = llm.get_tokenizer().encode(PROMPT * 12)
    assert len(ids) > llm.config.max_model_len
    kept, whole = llm.generate([ids, PROMPT], [SamplingParams(max_tokens=1, truncate_prompt_tokens=100),
                                               SamplingParams(max_tokens=1, truncate_prompt_tokens=-1)],
                               use_tqdm=False)
    assert kept.prompt_token_ids == ids[-100:]
    assert whole.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)  # -1: up to max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=-2)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(129\) is greater than max_model_len"):
        llm.generate(PROMPT, SamplingParams(truncate_prompt_tokens=129), use_tqdm=False)


def test_return_token_ids_plain_and_streamed(serve, llm):
    tokenizer = llm.get_tokenizer()

    async def body(client: httpx.AsyncClient) -> None:
        asked = {"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True, **GREEDY}
        plain = (await ok(client, "/v1/completions", asked)).json()["choices"][0]
        assert plain["prompt_token_ids"] == tokenizer.encode(PROMPT) and len(plain["token_ids"]) == 5
        assert tokenizer.decode(plain["token_ids"]) == plain["text"]
        unasked = (await ok(client, "/v1/completions", {**asked, "return_token_ids": False})).json()["choices"][0]
        assert unasked["token_ids"] is None and unasked["prompt_token_ids"] is None
        chunks = events(await ok(client, "/v1/completions", {**asked, "stream": True}))
        assert chunks[0]["choices"][0]["prompt_token_ids"] == plain["prompt_token_ids"]
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == plain["token_ids"]

        chat_body = {"messages": CHAT, "max_tokens": 4, "return_token_ids": True, **GREEDY}
        rendered = (await ok(client, "/tokenize", {"messages": CHAT})).json()["tokens"]
        chat = (await ok(client, "/v1/chat/completions", chat_body)).json()
        assert chat["prompt_token_ids"] == rendered and len(chat["choices"][0]["token_ids"]) == 4
        streamed = events(await ok(client, "/v1/chat/completions", {**chat_body, "stream": True}))
        assert streamed[0]["prompt_token_ids"] == rendered
        assert all("prompt_token_ids" not in c for c in streamed[1:])
        assert [t for c in streamed[1:] for t in c["choices"][0]["token_ids"]] == chat["choices"][0]["token_ids"]

    serve(body)


def test_add_special_tokens_adds_the_tokenizers_own_tokens(serve, llm, monkeypatch):
    """vLLM's defaults: a completion prompt gets the tokenizer's special tokens, a rendered chat does not
    (the template wrote them); the field turns either way. The embedded tokenizer adds none, so it is given
    a post-processor that puts its eos token first, as a BOS-adding checkpoint's does."""
    tokenizer = llm.get_tokenizer()
    bos = tokenizer.eos_token_id
    adds_bos = TemplateProcessing(single=f"{tokenizer.eos_token} $A", special_tokens=[(tokenizer.eos_token, bos)])
    monkeypatch.setattr(tokenizer._tok, "post_processor", adds_bos)
    plain = tokenizer.encode(PROMPT)

    async def body(client: httpx.AsyncClient) -> None:
        asked = {"prompt": PROMPT, "max_tokens": 2, "return_token_ids": True, **GREEDY}
        default = (await ok(client, "/v1/completions", asked)).json()["choices"][0]["prompt_token_ids"]
        off = (await ok(client, "/v1/completions", {**asked, "add_special_tokens": False})).json()
        assert default == [bos, *plain] and off["choices"][0]["prompt_token_ids"] == plain

        chat_body = {"messages": CHAT, "max_tokens": 2, "return_token_ids": True, **GREEDY}
        rendered = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
        chat = (await ok(client, "/v1/chat/completions", chat_body)).json()
        on = (await ok(client, "/v1/chat/completions", {**chat_body, "add_special_tokens": True})).json()
        assert chat["prompt_token_ids"] == rendered and on["prompt_token_ids"] == [bos, *rendered]

        assert (await ok(client, "/tokenize", {"prompt": PROMPT})).json()["tokens"] == [bos, *plain]
        assert (await ok(client, "/tokenize", {"messages": CHAT})).json()["tokens"] == rendered

    serve(body)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(serve):
    async def body(client: httpx.AsyncClient) -> None:
        out = (await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "logprobs": 2,
                                                    "return_token_ids": True, "return_tokens_as_token_ids": True,
                                                    **GREEDY})).json()["choices"][0]
        assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
        assert all(re.fullmatch(r"token_id:\d+", k) for top in out["logprobs"]["top_logprobs"] for k in top)
        chat = (await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                          "top_logprobs": 2, "return_token_ids": True,
                                                          "return_tokens_as_token_ids": True, **GREEDY})).json()
        choice = chat["choices"][0]
        assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(top["token"].startswith("token_id:") for c in choice["logprobs"]["content"]
                   for top in c["top_logprobs"])

    serve(body)


def test_continuous_usage_stats_on_every_chunk(serve):
    async def body(client: httpx.AsyncClient) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = events(await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                                             "stream_options": options, **GREEDY}))
        prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
        counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 4
        assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in chunks)
        chat = events(await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "stream": True,
                                                                "stream_options": options, **GREEDY}))
        assert chat[0]["usage"]["completion_tokens"] == 0 and chat[-2]["usage"]["completion_tokens"] == 3
        # vLLM: an empty stream_options asks for no usage
        plain = events(await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                                            "stream_options": {}, **GREEDY}))
        assert plain[-1]["choices"] and all("usage" not in c for c in plain)

    serve(body)


def test_prompt_tokens_details_only_when_enabled(serve):
    """vLLM's --enable-prompt-tokens-details: off, usage has no prompt_tokens_details, plain or streamed. Cached
    tokens are counted there only: vLLM sends `cache_read_input_tokens` on its Anthropic route alone."""
    streamed = {"stream": True, "stream_options": {"include_usage": True}}

    def usages(plain: httpx.Response, stream: httpx.Response) -> list[dict]:
        return [plain.json()["usage"], events(stream)[-1]["usage"]]

    async def enabled(client: httpx.AsyncClient) -> None:
        for path, base in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})]:
            body = {**base, "max_tokens": 2, **GREEDY}
            for usage in usages(await ok(client, path, body), await ok(client, path, {**body, **streamed})):
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 0 and "cache_read_input_tokens" not in usage

    async def disabled(client: httpx.AsyncClient) -> None:
        for path, base in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})]:
            body = {**base, "max_tokens": 2, **GREEDY}
            for usage in usages(await ok(client, path, body), await ok(client, path, {**body, **streamed})):
                assert "prompt_tokens_details" not in usage and "cache_read_input_tokens" not in usage
                assert usage["prompt_tokens"] > 0

    serve(disabled)
    serve(enabled, prompt_tokens_details=True)


def test_force_include_usage_puts_usage_on_every_chunk(serve):
    """vLLM's --enable-force-include-usage: a stream that asks for no usage has it on every chunk and in a
    final usage chunk; a plain request is unchanged."""
    async def body(client: httpx.AsyncClient) -> None:
        for path, base in [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})]:
            chunks = events(await ok(client, path, {**base, "max_tokens": 3, "stream": True, **GREEDY}))
            assert all("usage" in c for c in chunks)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
            assert chunks[-2]["usage"]["completion_tokens"] == 3  # the continuous count of the last token
            plain = (await ok(client, path, {**base, "max_tokens": 3, **GREEDY})).json()
            assert plain["usage"]["completion_tokens"] == 3

    serve(body, force_include_usage=True)


def test_server_load_counts_requests_until_their_response_is_out(serve):
    """vLLM's --enable-server-load-tracking: GET /load counts a plain request until its handler returns and a
    stream until its last event is out; without the flag there is no /load."""
    state = SimpleNamespace(server_load=0)

    async def events_of_a_stream() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def streamed() -> Response:
        return StreamingResponse(events_of_a_stream())

    async def plain() -> Response:
        assert state.server_load == 1  # while its handler runs
        return JSONResponse({})

    async def counts() -> None:
        await middleware.load_aware(state)(plain)()
        assert state.server_load == 0
        response = await middleware.load_aware(state)(streamed)()
        lines = response.body_iterator
        assert (await anext(lines), state.server_load) == ("data: 1\n\n", 1)
        assert [line async for line in lines] == ["data: [DONE]\n\n"] and state.server_load == 0

    asyncio.run(counts())

    async def enabled(client: httpx.AsyncClient) -> None:
        await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True, **GREEDY})
        assert (await client.get("/load")).json() == {"server_load": 0}

    async def disabled(client: httpx.AsyncClient) -> None:
        assert (await client.get("/load")).status_code == 404

    serve(enabled, server_load_tracking=True)
    serve(disabled)


def test_a_stream_whose_outputs_are_ready_lets_other_requests_in():
    """A fast model's stream finds its outputs queued already, so draining them suspends nowhere; its
    handler still yields the event loop between chunks: GET /health, sent once the stream has started, is
    answered before the stream's last event."""
    state = SimpleNamespace(loop=SimpleNamespace(healthy=lambda: True))
    app = build_app(state)

    async def ready_events() -> AsyncIterator[dict]:  # suspends nowhere, as a stream with queued outputs
        for i in range(1000):
            yield {"i": i}

    async def run() -> None:
        lines = streaming.sse(state, ready_events()).body_iterator
        assert await anext(lines) == 'data: {"i": 0}\n\n'  # the stream has started
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
            health = asyncio.ensure_future(client.get("/health"))
            sent = []
            async for line in lines:
                sent.append(line)
                if health.done():  # answered while the stream was still sending
                    break
            assert health.done() and sent[-1] != "data: [DONE]\n\n", "/health waited for the stream to end"
            assert (await health).status_code == 200
            await lines.aclose()

    asyncio.run(run())


def test_chat_echo_streams_the_last_message_first(serve):
    """vLLM's chat echo, streamed: the last message's content is each choice's first content delta."""
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}]
    body = {"messages": messages, "echo": True, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 3, **GREEDY}

    async def run(client: httpx.AsyncClient) -> None:
        plain = (await ok(client, "/v1/chat/completions", body)).json()["choices"][0]["message"]["content"]
        chunks = events(await ok(client, "/v1/chat/completions", {**body, "stream": True}))
        contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert contents[0] == "" and contents[1] == saying  # the role's delta, then the echo
        assert "".join(c or "" for c in contents) == plain and plain.startswith(saying)
        # a generation prompt makes the reply the assistant's: a user's last message is not echoed
        user_last = {**body, "messages": messages[:1], "continue_final_message": False,
                     "add_generation_prompt": True}
        reply = (await ok(client, "/v1/chat/completions", user_last)).json()["choices"][0]["message"]["content"]
        assert not reply.startswith("tell me")

    serve(run)


def test_chat_content_text_parts_are_joined_and_other_parts_refused(serve):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Write a function"},
                                          {"type": "text", "text": "that reads a file."}]}]
    joined = [{"role": "user", "content": "Write a function\nthat reads a file."}]

    async def body(client: httpx.AsyncClient) -> None:
        assert (await ok(client, "/tokenize", {"messages": parts})).json() == (
            await ok(client, "/tokenize", {"messages": joined})).json()
        a = (await ok(client, "/v1/chat/completions", {"messages": parts, "max_tokens": 3, **GREEDY})).json()
        b = (await ok(client, "/v1/chat/completions", {"messages": joined, "max_tokens": 3, **GREEDY})).json()
        assert a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"]
        # vLLM's other text parts: a plain str, input_text / output_text / refusal; a null text is skipped, and
        # fields beyond the text (read by "openai"-format templates) are ignored
        variants = [{"role": "user", "content": ["Write a function",
                                                 {"type": "input_text", "text": "that reads a file.",
                                                  "source_lang_code": "en"},
                                                 {"type": "text", "text": None}]},
                    {"role": "user", "content": [{"type": "output_text", "text": "Write a function"},
                                                 {"type": "refusal", "refusal": "that reads a file."}]}]
        for variant in variants:
            assert (await ok(client, "/tokenize", {"messages": [variant]})).json() == (
                await ok(client, "/tokenize", {"messages": joined})).json()
        image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                              {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
        response = await client.post("/v1/chat/completions", json={"messages": image})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert "image_url" in response.json()["error"]["message"]

    serve(body)


def test_tokenizer_info_only_when_enabled(serve, llm):
    async def enabled(client: httpx.AsyncClient) -> None:
        info = (await client.get("/tokenizer_info")).json()
        assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["eos_token"] == "<|endoftext|>"
        assert info["chat_template"] == llm.get_tokenizer().chat_template
        entry = info["added_tokens_decoder"]["0"]  # vLLM's test: each entry a dict with content and special
        assert entry["content"] == "<|endoftext|>" and entry["special"] is True

    async def disabled(client: httpx.AsyncClient) -> None:
        assert (await client.get("/tokenizer_info")).status_code == 404

    serve(enabled)
    serve(disabled, tokenizer_info=False)


def test_x_request_id_names_the_response(serve):
    async def body(client: httpx.AsyncClient) -> None:
        header = {"X-Request-Id": "trace-42"}
        same = await asyncio.gather(*(ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                                         headers=header) for _ in range(2)))  # one id twice: both served
        assert [r.json()["id"] for r in same] == ["cmpl-trace-42"] * 2
        assert same[0].headers["x-request-id"] == "trace-42"
        chat = await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, headers=header)
        assert chat.json()["id"] == "chatcmpl-trace-42"
        chunks = events(await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True},
                                 headers=header))
        assert {c["id"] for c in chunks} == {"cmpl-trace-42"}
        by_body = await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "request_id": "mine"})
        assert by_body.json()["id"] == "cmpl-mine"
        assert re.fullmatch(r"[0-9a-f]{32}", (await client.get("/health")).headers["x-request-id"])

    async def without_headers(client: httpx.AsyncClient) -> None:
        response = await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                            headers={"X-Request-Id": "trace-43"})
        assert response.json()["id"] == "cmpl-trace-43" and "x-request-id" not in response.headers

    serve(body)
    serve(without_headers, request_id_headers=False)


def _value(metrics: str, series: str) -> float:
    match = re.search(rf'^jaxhybrid:{re.escape(series)}(?:{{[^}}]*}})? (\S+)$', metrics, re.MULTILINE)
    assert match, series
    return float(match.group(1))


def test_per_request_metrics(serve, llm):
    async def body(client: httpx.AsyncClient) -> None:
        await ok(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
        before = (await client.get("/metrics")).text
        await ok(client, "/v1/completions", {"prompt": PROMPT, "n": 2, "max_tokens": 4, **GREEDY})
        after = (await client.get("/metrics")).text
        assert _value(after, "request_params_n_sum") == 3 and _value(after, "request_params_n_count") == 2
        assert _value(after, "request_params_max_tokens_sum") == 5
        assert _value(after, "request_max_num_generation_tokens_sum") == 5
        for phase in ("prefill", "decode", "inference"):
            assert _value(after, f"request_{phase}_time_seconds_count") == 2, phase
        assert (_value(after, "request_inference_time_seconds_sum") >= _value(
            after, "request_decode_time_seconds_sum") > 0)

        def gained(series: str) -> float:
            return _value(after, series) - _value(before, series)

        # each step of the second request: the prompt tokens it computed and the tokens it generated
        assert gained("iteration_tokens_total_count") == gained("engine_steps_total") > 0
        assert gained("iteration_tokens_total_sum") == gained("prompt_tokens_total") + gained(
            "generation_tokens_total")
        blocks = llm.config.num_blocks - 1
        assert f'kv_cache_size_tokens="{blocks * llm.config.block_size}"' in after

    serve(body)


REFUSED = [
    ("/v1/completions", "use_beam_search", True), ("/v1/completions", "length_penalty", 0.5),
    ("/v1/completions", "guided_json", {}),
    ("/v1/completions", "guided_choice", ["a", "b"]), ("/v1/completions", "priority", 1),
    ("/v1/completions", "logprob_token_ids", [1, 2]),
    ("/v1/completions", "prompt_embeds", "AAAA"), ("/v1/completions", "vllm_xargs", {"a": 1}),
    ("/v1/completions", "kv_transfer_params", {"a": 1}), ("/v1/completions", "thinking_token_budget", 8),
    ("/v1/completions", "stream_interval", 4), ("/v1/completions", "spaces_between_special_tokens", False),
    ("/v1/completions", "repetition_detection", {"max_pattern_size": 4}),
    ("/v1/chat/completions", "chat_template", "{{ 1 }}"),
    ("/v1/chat/completions", "documents", [{"title": "t", "text": "x"}]),
]


def test_unimplemented_vllm_fields_are_refused_and_their_defaults_accepted(serve):
    async def body(client: httpx.AsyncClient) -> None:
        bases = {"/v1/completions": {"prompt": PROMPT, "max_tokens": 1},
                 "/v1/chat/completions": {"messages": CHAT, "max_tokens": 1}}
        for path, field, value in REFUSED:
            response = await client.post(path, json={**bases[path], field: value})
            error = response.json()["error"]
            assert (response.status_code, error["param"], error["type"]) == (400, field, "BadRequestError"), field
            assert field in error["message"]
        defaults = {"use_beam_search": False, "priority": 0, "response_format": {"type": "text"},
                    "tool_choice": "none", "length_penalty": 1.0, "include_reasoning": True,
                    "parallel_tool_calls": True, "reasoning_effort": None}
        await ok(client, "/v1/chat/completions", {**bases["/v1/chat/completions"], **defaults})

    serve(body)
