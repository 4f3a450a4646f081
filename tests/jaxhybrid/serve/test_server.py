"""The real server process on the embedded model, over HTTP, with the official `openai` client where it
fits: completions, chat, streaming, logprobs, n > 1, stop strings, checkpoint hits, every 400, auth,
disconnects, the bounded queue and the side endpoints."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from jaxhybrid import load_model
from tests.jaxhybrid.serve.server_process import ServerProcess
from tests.tolerances import assert_close, float32_atol, model_depth

KEY = "test-key"
MAX_QUEUED = 12
AUTH = {"Authorization": f"Bearer {KEY}"}
CODE = "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as f:\n        return f.read()\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    process = ServerProcess(["--api-key", KEY, "--max-num-queued-requests", str(MAX_QUEUED),
                             "--enable-prompt-tokens-details", "--served-model-name", "tiny", "jaxhybrid-default"],
                            tmp / "server.log",
                            tmp_path_factory.getbasetemp() / "compile-cache")
    yield process
    assert process.stop() in (0, -15), process.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body, headers=AUTH, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={**headers, "content-type": "application/json"},
                      timeout=120, **kwargs)


def sse_events(response: httpx.Response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_greedy_completion_streams_the_same_text(server, client):
    plain = client.completions.create(model="tiny", prompt=CODE, max_tokens=12, temperature=0)
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 12
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": CODE}).json()["count"]
    assert plain.usage.prompt_tokens == count and plain.usage.total_tokens == count + 12
    chunks = list(client.completions.create(model="tiny", prompt=CODE, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_uses_the_template(server, client):
    messages = [{"role": "user", "content": "Write a function that reads a file."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == rendered and reply.usage.completion_tokens == 10
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content
    assert stream[-1].usage.completion_tokens == 10


def test_raw_stream_is_well_formed_sse(server):
    response = post(server, "/v1/completions", {"prompt": CODE, "max_tokens": 5, "stream": True, "ignore_eos": True,
                                                 "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert all(e["object"] == "text_completion" for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_logprobs_and_echo_scoring(server, client):
    # without the checkpoint's repetition penalty: greedy then picks the token the raw logprobs rank first
    out = client.completions.create(model="tiny", prompt=CODE, max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"repetition_penalty": 1.0})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert "".join(logprobs.tokens) == out.choices[0].text
    # the "score this text" call: echo, no new tokens, the prompt's logprobs
    scored = client.completions.create(model="tiny", prompt=CODE, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == CODE
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == scored.usage.prompt_tokens
    assert all(lp < 0 for lp in choice.logprobs.token_logprobs[1:])
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"repetition_penalty": 1.0})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_n_and_several_prompts(server, client):
    out = client.completions.create(model="tiny", prompt=[CODE, "def main():\n"], n=3, max_tokens=6, temperature=1.0,
                                    seed=7)
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 36
    again = client.completions.create(model="tiny", prompt=[CODE, "def main():\n"], n=3, max_tokens=6,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: the same draws


def test_stop_string_ends_the_text(server, client):
    text = client.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another slice of {text!r}"
    out = client.completions.create(model="tiny", prompt=CODE, max_tokens=24, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_checkpoint_consumers_are_reported_as_cached(server, client):
    anchor = CODE * 4  # well over two 16-token hash units
    candidates = ["x = 1\n", "y = 2\n", "z = 3\n"]
    outs = [client.completions.create(model="tiny", prompt=anchor + "<|mamba_checkpoint|>" + c, max_tokens=1,
                                      temperature=0) for c in candidates]
    checkpoint = len(httpx.post(f"{server.url}/tokenize", json={"prompt": anchor}).json()["tokens"]) // 16 * 16
    assert checkpoint > 0
    for out in outs[1:]:  # the first computes the anchor; the rest start from its checkpoint
        assert out.usage.prompt_tokens_details.cached_tokens >= checkpoint
    assert server.metric("checkpoint_hits_total") >= len(candidates) - 1


def test_prompt_logprobs_of_a_marked_prompt_cover_every_position(server):
    """Also once the checkpoint is cached (the test above): the marker is no token, its prompt's logprobs
    are those of the prompt without it."""
    anchor = CODE * 4
    body = {"max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    marked, plain = (post(server, "/v1/completions", {**body, "prompt": anchor + marker + "w = 4\n"}).json()
                     for marker in ("<|mamba_checkpoint|>", ""))
    got, want = marked["choices"][0]["prompt_logprobs"], plain["choices"][0]["prompt_logprobs"]
    assert len(got) == len(want) == marked["usage"]["prompt_tokens"] and got[0] is None and want[0] is None
    assert [list(p) for p in got[1:]] == [list(p) for p in want[1:]]  # the same token at every position
    values = [next(iter(p.values()))["logprob"] for p in want[1:]]
    atol = min(1e-4, float32_atol(model_depth(load_model().config, len(want)), max(map(abs, values))))
    assert_close([next(iter(p.values()))["logprob"] for p in got[1:]], values, atol, "prompt logprobs")


BAD = [
    ("{not json", "body"),
    ("[1, 2]", "body"),
    ({"prompt": CODE, "max_tokens": -1}, "max_tokens"),
    ({"prompt": CODE, "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": CODE, "max_tokens": "many"}, "max_tokens"),
    ({"prompt": CODE * 40}, "prompt"),
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": [-3, 5]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": CODE, "temperature": -1}, "temperature"),
    ({"prompt": CODE, "top_p": 1.5}, "top_p"),
    ({"prompt": CODE, "logprobs": 100}, "logprobs"),
    ({"prompt": CODE, "logprobs": "all"}, "logprobs"),
    ({"prompt": CODE, "n": 0}, "n"),
    ({"prompt": "a<|mamba_checkpoint|>b<|mamba_checkpoint|>c"}, "prompt"),
    ({"prompt": "<|mamba_checkpoint|>" + CODE}, "prompt"),
    ({"prompt": CODE, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": CODE, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": CODE, "logit_bias": {"4097": 1.0}}, "logit_bias"),
    ({"prompt": CODE, "logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"prompt": CODE, "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": CODE, "allowed_token_ids": [4096]}, "allowed_token_ids"),
    ({"prompt": CODE, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": CODE, "bad_words": [" "]}, "bad_words"),
    ({"prompt": CODE, "logprobs": -2}, "logprobs"),
    ({"prompt": CODE, "logprobs": -1}, "logprobs"),  # the whole vocabulary: over the default max_logprobs
    ({"prompt": CODE, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": CODE, "cache_salt": ""}, "cache_salt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert error["param"] == param, error
    assert "request '" not in error["message"]  # the engine's internal request ids stay inside


def test_out_of_vocab_logit_bias_names_the_id_and_the_vocabulary(server, client):
    """vLLM's check (test_chat_logit_bias_validation): the bad id and the vocabulary size in the message."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logit_bias={"4097": 1.0})
    assert error.value.status_code == 400 and "4097" in str(error.value) and "4096" in str(error.value)


def test_logit_bias_allowed_token_ids_bad_words_and_min_tokens(server, client):
    """OpenAI's string-keyed logit_bias and vLLM's extras reach the sampler, in completions and chat."""
    config = post(server, "/detokenize", {"tokens": [1855]}).json()["prompt"]
    biased = client.completions.create(model="tiny", prompt=CODE, max_tokens=3, temperature=0,
                                       logit_bias={"1855": 100})
    assert biased.choices[0].text == config * 3
    banned = client.completions.create(model="tiny", prompt=CODE, max_tokens=3, temperature=0,
                                       logit_bias={"1855": 100}, extra_body={"bad_words": [config]})
    assert config not in banned.choices[0].text and banned.usage.completion_tokens == 3
    eos = post(server, "/tokenize", {"prompt": "<|endoftext|>"}).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, extra_body={"allowed_token_ids": [*eos, 1855],
                                                                     "min_tokens": 3})
    assert chat.usage.completion_tokens >= 3 and chat.choices[0].message.content.startswith(config * 3)


def test_unrequested_prompt_logprobs_are_null_not_absent(server, client):
    completion = post(server, "/v1/completions", {"prompt": CODE, "max_tokens": 2}).json()
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2}).json()
    assert completion["choices"][0]["prompt_logprobs"] is None and chat["prompt_logprobs"] is None
    assert "prompt_logprobs" in completion["choices"][0] and "prompt_logprobs" in chat


def test_bad_chat_and_unknown_model(server):
    for body in ({"messages": []}, {"messages": [{"role": "user"}]}, {"messages": "hi"}):
        response = post(server, "/v1/chat/completions", body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text
    response = post(server, "/v1/completions", {"model": "gpt-4", "prompt": CODE})
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"
    # nothing a client sent disturbed the engine
    assert post(server, "/v1/completions", {"prompt": CODE, "max_tokens": 2}).status_code == 200
    assert not any(server.wait_drained().values())


def test_api_key_guards_v1_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = post(server, "/v1/completions", {"prompt": CODE, "max_tokens": 1}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
        assert response.json()["error"]["message"].startswith("Unauthorized")
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "jaxhybrid-default"]
    assert models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_tokenize_round_trip(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": CODE, "return_token_strs": True}).json()
    # the tokenizer's own strings (byte-level: Ġ is a space, Ċ a newline), as vLLM returns them
    assert "".join(tokens["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n") == CODE
    assert any("Ġ" in t for t in tokens["token_strs"]) and tokens["max_model_len"] == 256
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": CODE}).json()["token_strs"] is None
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": CODE}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [10**7]}).status_code == 400


def test_disconnect_aborts_and_frees(server):
    disconnects = server.metric("http_requests_client_disconnected_total")
    body = {"prompt": CODE, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 6:
                break  # closing the stream now is a client disconnect
    assert server.metric("num_requests_running") + server.metric("num_requests_waiting") <= 1
    assert not any(server.wait_drained().values())
    with pytest.raises(httpx.ReadTimeout):  # a plain request whose client gives up
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.3)
    assert not any(server.wait_drained().values())
    assert server.metric("http_requests_client_disconnected_total") == disconnects + 2


def test_full_queue_answers_429_and_recovers(server):
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            body = {"prompt": CODE, "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(MAX_QUEUED + 6)])

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= MAX_QUEUED // 2 and 429 in codes and set(codes) <= {200, 429}, codes
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == 429
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in responses if r.status_code == 200)
    assert not any(server.wait_drained().values())
    assert post(server, "/v1/completions", {"prompt": CODE, "max_tokens": 1}).status_code == 200


def test_metrics_count_what_happened(server, client):
    before = server.metric("generation_tokens_total")
    client.completions.create(model="tiny", prompt=CODE, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 60  # bounded: the metric is written by the engine's thread
    while server.metric("generation_tokens_total") < before + 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("generation_tokens_total") == before + 7
    text = httpx.get(f"{server.url}/metrics").text
    for series in ("time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                   "inter_token_latency_seconds_count", "prefix_cache_queries_total", "cache_config_info"):
        assert f"jaxhybrid:{series}" in text


def _offsets_follow_tokens(logprobs: dict, start: int = 0) -> None:
    """vLLM's text offsets: each token starts where the one before ended."""
    lengths = [len(token) for token in logprobs["tokens"]]
    assert logprobs["text_offset"] == [start + sum(lengths[:j]) for j in range(len(lengths))]


def test_text_offsets_run_on_across_stream_chunks_and_through_an_echoed_prompt(server):
    body = {"prompt": CODE, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    _offsets_follow_tokens(whole["logprobs"])
    chunks = [e["choices"][0] for e in sse_events(post(server, "/v1/completions", {**body, "stream": True}))]
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in ("tokens", "text_offset")}
    assert streamed == {key: whole["logprobs"][key] for key in ("tokens", "text_offset")}

    echoed = post(server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    assert all(isinstance(token, str) for token in echoed["logprobs"]["tokens"])  # the first one too
    assert echoed["logprobs"]["token_logprobs"][0] is None
    _offsets_follow_tokens(echoed["logprobs"])
    assert "".join(echoed["logprobs"]["tokens"]) == echoed["text"]
    echoed_stream = [e["choices"][0] for e in sse_events(post(server, "/v1/completions",
                                                              {**body, "echo": True, "stream": True}))]
    assert echoed_stream[0]["logprobs"]["text_offset"][0] == len(CODE)  # after the echoed prompt


def test_echo_of_token_ids_keeps_special_tokens(server):
    ids = [1] + httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).json()["tokens"] + [2]  # im_start/end
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True}).json()
    assert out["choices"][0]["text"].startswith("<|im_start|>hi<|im_end|>"), out


def test_tokenize_renders_chat_as_asked(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]
    tokenize = lambda **options: httpx.post(f"{server.url}/tokenize", json={"messages": messages, **options})
    texts = {}
    for name, options in (("prompt", {}), ("plain", {"add_generation_prompt": False}),
                          ("continue", {"add_generation_prompt": False, "continue_final_message": True})):
        ids = tokenize(**options).json()["tokens"]
        texts[name] = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert texts["prompt"].startswith(texts["plain"]) and len(texts["prompt"]) > len(texts["plain"])
    assert texts["continue"].endswith("Hello there") and texts["plain"].startswith(texts["continue"])
    both = tokenize(continue_final_message=True)
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"
