"""Reasoning and tool calls on /v1/chat/completions, in process on the embedded model: the --reasoning-parser
split into `reasoning` and content (whole and streamed, include_reasoning, enable_thinking, the engine starting
a grammar where the reasoning ends), tool_choice "required" and named functions forced by their JSON schema,
"auto" through the hermes parser, tools and tool messages through the chat template, and vLLM's 400s.

The embedded model writes random text, so the tests make its output say something: a structured output (the
text a parser must split, or the forced tool schema) fixes its shape, and a logit_bias keeps the random model
from padding JSON with whitespace (or, where a schema lets it, with extra keys) until max_tokens runs out. Its
tokenizer lacks the marker tokens the parsers look for, so `marker_tokenizer` gives four rare tokens their
names (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`) and a small Qwen3-like chat template that reads
tools, tool calls and enable_thinking. The markers are plain vocabulary entries, not added tokens: text (a
prompt, a grammar's) still encodes to their pieces, and the model writes them as one token only where a
logit_bias asks; the parsers read text, and the engine's reasoning gate the one token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest

import jaxhybrid
from jaxhybrid.batch_job import BatchJob
from jaxhybrid.engine.args import ParserSetupError
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.llm import LLM
from jaxhybrid.openai import render
from jaxhybrid.openai.chat_parsing import ChatParsers
from jaxhybrid.parsers.reasoning import get_reasoning_parser
from jaxhybrid.serve.__main__ import parse_args
from jaxhybrid.serve.app import build_app
from jaxhybrid.serve.engine_loop import EngineLoop
from jaxhybrid.serve.metrics import ServerMetrics, cache_config_info
from jaxhybrid.serve.state import ServerState
from tests.jaxhybrid.serve.asgi import drive

EMBEDDED = Path(jaxhybrid.__file__).parent / "assets" / "default_model"
MARKERS = {4092: "<think>", 4093: "</think>", 4094: "<tool_call>", 4095: "</tool_call>"}
END_OF_THINKING = 4093
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}[{{ m.tool_call_id }}] {% endif %}"
    "{{ m.content }}{% for call in m.tool_calls or [] %}"
    "{% if call.function.arguments is not mapping %}{{ raise_exception('arguments must be an object') }}{% endif %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}{% if not bare %}<think>\n\n</think>\n\n{% endif %}"
    "{% else %}<think>\n{% endif %}{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}  # the template closes the reasoning in the prompt
TOOL_FLAGS = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def marker_tokenizer(directory: Path) -> Path:
    """The embedded tokenizer with MARKERS renamed from rare tokens (the merges that made those tokens go, so
    no text encodes to them any more), and TEMPLATE as its template."""
    spec = json.loads((EMBEDDED / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    names = {token_id: token for token, token_id in vocab.items()}
    for token_id, marker in MARKERS.items():
        old = names[token_id]
        del vocab[old]
        vocab[marker] = token_id
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "".join(m) != old and old not in m]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return marker_tokenizer(tmp_path_factory.mktemp("marker-tokenizer"))


@pytest.fixture(scope="module")
def llm(tokenizer_dir):
    # no reasoning parser on the engine: a grammar writes the whole output (reasoning included) unless a test
    # turns the engine's reasoning gate on
    return LLM(tokenizer=str(tokenizer_dir), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=256,
               num_blocks=64, num_state_slots=12, token_buckets=(16,), row_buckets=(2,), async_scheduling=False)


@pytest.fixture(scope="module")
def bias(llm) -> dict[str, float]:
    """No whitespace-only token, and closing brackets first wherever the grammar allows them: short JSON."""
    texts = {i: llm.tokenizer.decode([i], skip_special_tokens=False) for i in range(llm.tokenizer.vocab_size)}
    return {**{str(i): -100 for i, text in texts.items() if not text.strip()},
            **{str(i): 100 for i, text in texts.items() if text and set(text) <= set("}]")}}


@pytest.fixture
def serve(llm):
    """`serve(body, **state_flags)`: an app with those ServerState flags on a fresh engine loop."""

    def run(body, **flags) -> None:
        config = llm.config
        loop = EngineLoop(llm.engine, ServerMetrics("tiny", config.max_model_len, 0, cache_config_info(config)),
                          idle_poll=0.05)
        drive(llm, loop, build_app(ServerState(llm.built, loop, ("tiny",), "embedded", config.max_model_len, **flags)),
              body)

    return run


async def chat(client: httpx.AsyncClient, body: dict, path: str = "/v1/chat/completions") -> dict:
    response = await client.post(path, json={"messages": ASK, "max_tokens": 40, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client: httpx.AsyncClient, body: dict) -> list[dict]:
    """The choices of a streamed reply's chunks."""
    response = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 40, **body,
                                                                "stream": True})
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [choice for line in lines[:-1] for choice in json.loads(line.removeprefix("data: "))["choices"]]


def streamed_calls(choices: list[dict]) -> list[dict]:
    """The tool calls a stream's deltas build: the first part of each brings id, type and name, every part
    adds to its arguments."""
    calls: dict[int, dict] = {}
    for part in (part for choice in choices for part in choice["delta"].get("tool_calls", [])):
        if part["index"] not in calls:
            assert part["id"] and part["type"] == "function" and part["function"]["name"], part
            calls[part["index"]] = {"id": part["id"], "name": part["function"]["name"], "arguments": ""}
        else:
            assert "id" not in part and "name" not in part["function"], part
        calls[part["index"]]["arguments"] += part["function"].get("arguments") or ""
    return [calls[index] for index in sorted(calls)]


def joined(choices: list[dict], field: str) -> str:
    return "".join(choice["delta"].get(field) or "" for choice in choices)


def test_required_tool_choice_calls_tools_whose_arguments_fit_their_schemas(serve, bias):
    async def body(client: httpx.AsyncClient) -> None:
        replies = [await chat(client, {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed,
                                       "logit_bias": bias, "chat_template_kwargs": NO_THINKING})
                   for seed in range(4)]
        called = [reply["choices"][0] for reply in replies if reply["choices"][0]["finish_reason"] == "tool_calls"]
        assert called, replies
        for choice in called:
            assert choice["message"]["content"] == "" and choice["message"]["reasoning"] is None
            for call in choice["message"]["tool_calls"]:
                assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])

    serve(body, **TOOL_FLAGS)


def test_named_tool_choice_calls_that_function(serve, bias):
    async def body(client: httpx.AsyncClient) -> None:
        named = {"type": "function", "function": {"name": "get_time"}}
        for seed in range(3):
            choice = (await chat(client, {"tools": TOOLS, "tool_choice": named, "temperature": 1.0, "seed": seed,
                                          "logit_bias": bias, "chat_template_kwargs": NO_THINKING}))["choices"][0]
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_time" and choice["finish_reason"] == "stop"  # vLLM: named stops
            jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)

    serve(body, **TOOL_FLAGS)


@pytest.mark.parametrize("tool_choice, finish_reason", [
    ("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")])
def test_forced_tool_calls_stream_what_the_whole_reply_holds(serve, bias, tool_choice, finish_reason):
    async def body(client: httpx.AsyncClient) -> None:
        request = {"tools": TOOLS, "tool_choice": tool_choice, "temperature": 0, "logit_bias": bias,
                   "chat_template_kwargs": NO_THINKING}
        whole = (await chat(client, request))["choices"][0]
        choices = await stream(client, request)
        expected = [(call["function"]["name"], call["function"]["arguments"])
                    for call in whole["message"]["tool_calls"]]
        assert [(call["name"], call["arguments"]) for call in streamed_calls(choices)] == expected
        assert whole["finish_reason"] == choices[-1]["finish_reason"] == finish_reason
        assert joined(choices, "content") == "" and joined(choices, "reasoning") == ""

    serve(body, **TOOL_FLAGS)


HERMES_OUTPUT = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(paris|rome)", "days": [1-7]\}\}'
                 r'</tool_call>\n<tool_call>\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}</tool_call>')


def test_auto_tool_choice_parses_calls_with_the_hermes_parser(serve):
    async def body(client: httpx.AsyncClient) -> None:
        request = {"tools": TOOLS, "temperature": 0, "structured_outputs": {"regex": HERMES_OUTPUT},
                   "max_tokens": 200}  # no tool_choice with tools: "auto"
        whole = (await chat(client, request))["choices"][0]
        message = whole["message"]
        assert whole["finish_reason"] == "tool_calls" and message["content"] == "Sure. "
        assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather", "get_time"]
        for call in message["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
        choices = await stream(client, request)
        calls = streamed_calls(choices)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in message["tool_calls"]]
        assert joined(choices, "content") == "Sure. " and choices[-1]["finish_reason"] == "tool_calls"
        single = (await chat(client, {**request, "parallel_tool_calls": False}))["choices"][0]["message"]
        assert [call["function"]["name"] for call in single["tool_calls"]] == ["get_weather"]
        plain = (await chat(client, {**request, "tool_choice": "none"}))["choices"][0]
        assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
        assert plain["message"]["content"].startswith("Sure. <tool_call>")

    serve(body, **TOOL_FLAGS)


def test_tools_and_tool_messages_reach_the_template(serve, llm):
    conversation = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": [{"type": "text", "text": "sunny"}]}]
    text = render.render_chat(llm.built.prompts, conversation, True, tools=[tool for tool in TOOLS])
    assert "tools: get_weather get_time" in text and "[call-1] sunny" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}</tool_call>' in text
    broken = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    assert '"arguments": {}' in render.render_chat(llm.built.prompts, broken, True)  # history: kept, as {} (vLLM)

    async def body(client: httpx.AsyncClient) -> None:
        def prompt_tokens(reply: dict) -> int:
            return reply["usage"]["prompt_tokens"]

        base = {"messages": conversation, "max_tokens": 1}
        without = prompt_tokens(await chat(client, base))
        with_tools = prompt_tokens(await chat(client, {**base, "tools": TOOLS, "tool_choice": "none"}))
        counted = (await client.post("/tokenize", json={"messages": conversation, "tools": TOOLS})).json()["count"]
        assert with_tools == counted > without
        bad = [*ASK, {"role": "assistant", "content": "", "tool_calls": ["call"]}]
        response = await client.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 1})
        assert response.status_code == 400 and "must be objects" in response.json()["error"]["message"]

    serve(body)

    async def excluded(client: httpx.AsyncClient) -> None:
        base = {"messages": conversation, "max_tokens": 1}
        with_tools = await chat(client, {**base, "tools": TOOLS, "tool_choice": "none"})
        assert with_tools["usage"]["prompt_tokens"] == (await chat(client, base))["usage"]["prompt_tokens"]

    serve(excluded, exclude_tools_when_tool_choice_none=True)


REFUSALS = [  # (request fields, server flags, param, words of the message)
    ({"tools": TOOLS, "tool_choice": "auto"}, {}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": TOOLS}, {}, "tool_choice", "--enable-auto-tool-choice"),  # tools alone mean "auto"
    ({"tools": TOOLS, "tool_choice": "required"}, {}, "tool_choice", "requires --tool-call-parser"),
    ({"tools": TOOLS, "tool_choice": "required"}, {"tool_call_parser": "hermes"}, "tool_choice",
     "requires --tool-call-parser"),  # the parser without --enable-auto-tool-choice is not used (vLLM)
    ({"tool_choice": "required"}, TOOL_FLAGS, "tool_choice", "`tools` must be set"),
    ({"tools": []}, TOOL_FLAGS, "tools", "must not be an empty array"),
    ({"tools": TOOLS, "tool_choice": "always"}, TOOL_FLAGS, "tool_choice", "Invalid value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, TOOL_FLAGS,
     "tool_choice", "does not match any"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, TOOL_FLAGS,
     "tool_choice.function.name", "Expected field `name`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}}, TOOL_FLAGS,
     "tool_choice.function.name", "Invalid `name`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "structured_outputs": {"regex": "a"}}, TOOL_FLAGS, "structured_outputs", "not both"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, TOOL_FLAGS, "tools", "Field required"),
    ({"reasoning_effort": "extreme"}, {}, "reasoning_effort", "Input should be"),
]


def test_tool_choice_and_tools_refusals_name_their_field(serve):
    async def body(client: httpx.AsyncClient, fields: dict, param: str, words: str) -> None:
        response = await client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1, **fields})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["type"]) == (400, param, "BadRequestError"), error
        assert words in error["message"], error

    for fields, flags, param, words in REFUSALS:
        serve(lambda client, f=fields, p=param, w=words: body(client, f, p, w), **flags)

    async def batch(client: httpx.AsyncClient) -> None:
        response = await client.post("/v1/chat/completions/batch", json={
            "messages": [ASK], "max_tokens": 1, "tools": TOOLS, "tool_choice": "required"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        await chat(client, {"messages": [ASK], "tools": TOOLS, "max_tokens": 1}, "/v1/chat/completions/batch")

    serve(batch, **TOOL_FLAGS)


THOUGHT = r"[a-z]{3,8}</think>yes"  # a structured output that writes reasoning, its end and content


def test_reasoning_parser_splits_reasoning_from_content(serve):
    async def body(client: httpx.AsyncClient) -> None:
        request = {"temperature": 0, "structured_outputs": {"regex": THOUGHT}}
        message = (await chat(client, request))["choices"][0]["message"]
        assert re.fullmatch("[a-z]{3,8}", message["reasoning"]) and message["content"] == "yes"
        assert "reasoning_content" not in message  # vLLM 0.32 sends `reasoning` only
        choices = await stream(client, request)
        assert (joined(choices, "reasoning"), joined(choices, "content")) == (message["reasoning"], "yes")
        hidden = (await chat(client, {**request, "include_reasoning": False, "return_token_ids": True}))
        assert hidden["choices"][0]["message"]["reasoning"] is None
        assert hidden["choices"][0]["message"]["content"] == "yes" and hidden["choices"][0]["token_ids"] is None
        choices = await stream(client, {**request, "include_reasoning": False})
        assert joined(choices, "reasoning") == "" and joined(choices, "content") == "yes"
        batch = await chat(client, {**request, "messages": [ASK, ASK]}, "/v1/chat/completions/batch")
        assert [choice["message"] for choice in batch["choices"]] == [message, message]

    serve(body, reasoning_parser="qwen3")


def test_batch_job_chat_lines_have_the_servers_message_fields(llm):
    job = BatchJob(llm.built, model_name="m", **TOOL_FLAGS)
    job.parsers = ChatParsers.from_flags(llm.tokenizer, "qwen3", **TOOL_FLAGS)  # as LLM(reasoning_parser="qwen3")
    bodies = [{"messages": ASK, "temperature": 0, "max_tokens": 40, "structured_outputs": {"regex": THOUGHT}},
              {"messages": ASK, "temperature": 0, "max_tokens": 200, "tools": TOOLS,
               "chat_template_kwargs": NO_THINKING, "structured_outputs": {"regex": HERMES_OUTPUT}}]
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": body})
             for i, body in enumerate(bodies)]
    thought, called = [json.loads(text) for texts, _ in job.run(iter(enumerate(lines)), window=2) for text in texts]
    message = thought["response"]["body"]["choices"][0]["message"]
    assert re.fullmatch("[a-z]{3,8}", message["reasoning"]) and message["content"] == "yes"
    choice = called["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] is None
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]


def test_enable_thinking_and_reasoning_effort_reach_the_parser(serve, llm):
    async def body(client: httpx.AsyncClient) -> None:
        async def split(kwargs: dict, **fields) -> tuple[str | None, str | None, str]:
            choice = (await chat(client, {"temperature": 0, "max_tokens": 8, "return_token_ids": True,
                                          "chat_template_kwargs": kwargs, **fields}))["choices"][0]
            raw = llm.tokenizer.decode(choice["token_ids"], skip_special_tokens=False)
            return choice["message"]["reasoning"], choice["message"]["content"], raw

        reasoning, content, raw = await split({})  # the template opened <think>: all of it is reasoning so far
        assert (reasoning, content) == (raw, None) and "</think>" not in raw
        # `bare`: the template writes no marker at all, so only the parser's enable_thinking tells
        reasoning, content, raw = await split({"bare": True, "enable_thinking": False})
        assert (reasoning, content) == (None, raw)
        assert (await split({"bare": True}, reasoning_effort="none"))[:2] == (None, raw)
        assert (await split({"bare": True, "enable_thinking": True}, reasoning_effort="none"))[1] is None

    serve(body, reasoning_parser="qwen3")


def test_the_engine_starts_the_grammar_where_the_reasoning_ends(serve, llm, bias, monkeypatch):
    """What LLM(reasoning_parser=...) gives the engine (test_llm_reasoning_parser_wires_the_engine): here the
    grammar waits for </think>, which a logit_bias makes the model write first."""
    monkeypatch.setattr(llm.engine.structured, "reasoning_end", get_reasoning_parser("qwen3")(
        llm.tokenizer).is_reasoning_end)

    async def body(client: httpx.AsyncClient) -> None:
        # </think> outbids everything; the closing brackets (short JSON) only what the grammar leaves after it
        think_first = {**{token: min(value, 50) for token, value in bias.items()}, str(END_OF_THINKING): 100}
        request = {"temperature": 0, "logit_bias": think_first, "structured_outputs": {"choice": ["yes", "no"]},
                   "return_token_ids": True, "max_tokens": 8}
        choice = (await chat(client, request))["choices"][0]
        assert choice["token_ids"][0] == END_OF_THINKING and choice["message"]["reasoning"] is None
        assert choice["message"]["content"] in ("yes", "no")
        forced = (await chat(client, {"tools": TOOLS, "tool_choice": "required", "temperature": 0,
                                      "logit_bias": think_first, "max_tokens": 40}))["choices"][0]
        assert forced["finish_reason"] == "tool_calls" and forced["message"]["reasoning"] is None
        for call in forced["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])

    serve(body, reasoning_parser="qwen3", **TOOL_FLAGS)


def test_llm_reasoning_parser_wires_the_engine(tokenizer_dir):
    small = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, num_blocks=16, num_state_slots=4)
    llm = LLM(tokenizer=str(tokenizer_dir), reasoning_parser="qwen3", **small)
    ends = llm.engine.structured.reasoning_end
    assert ends([END_OF_THINKING]) and not ends([4092]) and llm.reasoning_parser.is_reasoning_end([END_OF_THINKING])
    with pytest.raises(ParserSetupError, match="'<think>' token"):
        LLM(reasoning_parser="qwen3", **small)  # the embedded tokenizer has no marker tokens
    embedded = SimpleNamespace(tokenizer=Tokenizer.from_pretrained(EMBEDDED))  # all a ServerState's parsers read
    with pytest.raises(ParserSetupError, match="--reasoning-parser deepseek_r1 cannot be used"):
        ServerState(embedded, None, ("tiny",), "x", 64, reasoning_parser="deepseek_r1")
    assert ServerState(embedded, None, ("tiny",), "x", 64, **TOOL_FLAGS).parsers.tools is not None  # text only


def test_parser_flags(capsys):
    args = parse_args(["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"])
    assert (args.reasoning_parser, args.enable_auto_tool_choice, args.tool_call_parser) == (
        "qwen3", True, "qwen3_coder")
    with pytest.raises(SystemExit):
        parse_args(["--enable-auto-tool-choice"])
    assert capsys.readouterr().err.strip().endswith("--enable-auto-tool-choice requires --tool-call-parser")
    for flag in ("--reasoning-parser", "--tool-call-parser"):
        with pytest.raises(SystemExit):
            parse_args([flag, "mistral"])
        assert "invalid choice: 'mistral'" in capsys.readouterr().err
