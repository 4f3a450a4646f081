"""The batch job's lines (`python -m jaxhybrid.run_batch`, `jaxhybrid.ray_data`) run through one built engine.

Two line formats, told apart by their keys: the OpenAI batch lines of `vllm run-batch` (`jaxhybrid.openai`
parses and answers them as the server does), and scoring lines `{"id", "prompt", "candidates",
"top_logprobs"?}`, whose prompt is computed once for all its candidates (`jaxhybrid.scoring`). A bad line
becomes an error line and the job goes on. Lines run a window at a time, each window from an empty prefix
cache; ids and seeds come from line numbers, so a line's output depends only on its window.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import ValidationError

from jaxhybrid.engine.builder import BuiltEngine
from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.openai import errors, render, responses
from jaxhybrid.openai.chat_parsing import ChatParsers
from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxhybrid.sample.params import MAX_SEED, SamplingParams
from jaxhybrid.scoring import PromptScores, read_scores, scoring_requests

_BATCH_KEYS = {"custom_id", "method", "url", "body"}
_SCORE_KEYS = {"id", "prompt", "candidates", "top_logprobs"}


@dataclass
class _Work:
    """One input line turned into engine requests, and how their finished outputs become its output line."""

    requests: list[tuple[Prompt, SamplingParams]]
    finish: Callable[[list[RequestOutput]], dict]
    prompt_logprobs_from: int = 0  # a scoring line's: its candidates' positions only


def _scores_json(scores: PromptScores) -> dict:
    reply = {"scores": [dataclasses.asdict(c) for c in scores.candidates]}
    if scores.top_logprobs is not None:
        reply["top_logprobs"] = scores.top_logprobs
    return reply


def _seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return params if params.seed is not None else dataclasses.replace(params, seed=seed % (MAX_SEED + 1))


def _batch_work(built: BuiltEngine, line: dict, index: int, model: str, created: int, seed: int,
                parsers: ChatParsers = responses.NO_PARSERS) -> _Work:
    url, body = line.get("url"), line.get("body")
    if line.get("method", "POST") != "POST":
        raise BadRequest(f"method must be POST, got {line.get('method')!r}", "method")
    kinds = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    if url not in kinds:
        raise BadRequest(f"url must be one of {sorted(kinds)}, got {url!r}", "url")
    try:
        request = kinds[url].model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest(f"body.{field}: {first['msg']}", f"body.{field}") from error
    request.check()
    if request.stream:
        raise BadRequest("stream is not available in a batch job", "body.stream")
    if isinstance(request, ChatCompletionRequest):
        parsers.check(request)
    params = _seeded(request.params(built.generation_defaults), seed * 1_000_003 + index)
    response_id = f"{'cmpl' if url == '/v1/completions' else 'chatcmpl'}-{index}"
    if isinstance(request, ChatCompletionRequest):
        params = parsers.adjust(request, params)
        text = render.render_chat(built.prompts, request.messages, request.add_generation_prompt, "body.messages",
                                  request.continue_final_message, request.template_kwargs(),
                                  tools=request.template_tools())
        prompt = request.engine_prompt(built.prompts, text, params)
        return _Work([(prompt, params)], lambda finals: responses.chat_response(
            request, finals[0], model, response_id, created, parsers=parsers))
    prompts = [request.engine_prompt(built.prompts, p, params) for p in request.prompts()]
    echoed = [render.prompt_text(built.tokenizer, p) for p in prompts] if request.echo else None
    return _Work([(p, params) for p in prompts], lambda finals: responses.completion_response(
        request, finals, model, echoed, response_id, created, responses.token_decoder(built.tokenizer)))


class BatchJob:
    """Runs input lines through one built engine, a window at a time, and yields output lines in input order."""

    def __init__(self, built: BuiltEngine, *, model_name: str, created: int = 0, seed: int = 0, reuse: bool = True,
                 default_top_logprobs: int | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False):
        self.built, self.model_name, self.created, self.seed = built, model_name, created, seed
        self.reuse, self.default_top_logprobs = reuse, default_top_logprobs
        # chat lines are parsed as the server parses chat: the engine's reasoning parser, the tool-call flags
        self.parsers = ChatParsers.from_flags(built.tokenizer, built.args.reasoning_parser, tool_call_parser,
                                              enable_auto_tool_choice)
        self.counted = Counter()  # lines, errors, prompt_tokens, generated_tokens

    def run(self, lines: Iterator[tuple[int, str]], window: int) -> Iterator[tuple[list[str], Counter]]:
        """Per window of `window` (line number, text) pairs: its output lines and what it counted."""
        while chunk := list(itertools.islice(lines, window)):
            before = self.counters()
            texts = list(self._run_window(chunk))
            yield texts, self.counters() - before

    def counters(self) -> Counter:
        """Lines, errors and tokens so far, and the engine's cache lookups: what windows and replicas add up."""
        lookups = ("cached_tokens", "prefix_cache_queries", "checkpoint_hits", "checkpoint_queries")
        return self.counted + Counter({name: getattr(self.built.engine.stats, name) for name in lookups})

    @staticmethod
    def _load(index: int, raw: str) -> dict:
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as error:
            raise BadRequest(f"line {index + 1} is not JSON: {error}", "line") from error
        if not isinstance(line, dict):
            raise BadRequest(f"line {index + 1} must be a JSON object", "line")
        return line

    def _work(self, index: int, line: dict) -> _Work:
        keys, expected = set(line), _BATCH_KEYS if "custom_id" in line else _SCORE_KEYS
        if keys - expected:
            raise BadRequest(f"unknown fields {sorted(keys - expected)} (expected {sorted(expected)})",
                             sorted(keys - expected)[0])
        if "custom_id" in line:
            return _batch_work(self.built, line, index, self.model_name, self.created, self.seed, self.parsers)
        if "candidates" not in line or "prompt" not in line:
            raise BadRequest("a line needs custom_id/url/body (OpenAI batch) or prompt/candidates (scoring)", "line")
        top = line.get("top_logprobs", self.default_top_logprobs)
        scoring = scoring_requests(self.built.prompts, line["prompt"], line["candidates"], top, self.reuse)
        return _Work(scoring.requests, lambda finals: _scores_json(read_scores(finals, scoring.prompt_len, top)),
                     scoring.prompt_logprobs_from)

    def _run_window(self, chunk: list[tuple[int, str]]) -> Iterator[str]:
        engine, results, pending = self.built.engine, {}, {}
        # A cache hit and a recomputation differ in the last bits: from an empty cache, a line's output
        # depends on its window alone, wherever and whenever the window runs.
        engine.reset_prefix_cache()
        for index, raw in chunk:
            line: dict = {}
            try:
                line = self._load(index, raw)
                work = self._work(index, line)
                ids = [f"{index}-{j}" for j in range(len(work.requests))]
                try:
                    for request_id, (prompt, params) in zip(ids, work.requests, strict=True):
                        engine.add_request(request_id, prompt, params, prompt_logprobs_from=work.prompt_logprobs_from)
                except ValueError as error:
                    for request_id in ids:
                        engine.abort(request_id)
                    raise errors.as_bad_request(error) from error
                pending[index] = (line, work, ids)
            except BadRequest as error:
                results[index] = self._error_line(index, line, error)
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        for index, _ in chunk:
            if index in pending:
                line, work, ids = pending[index]
                results[index] = self._output_line(index, line, work, [finished[i] for i in ids])
            self.counted["lines"] += 1
            yield json.dumps(results[index]) + "\n"

    def _output_line(self, index: int, line: dict, work: _Work, finals: list[RequestOutput]) -> dict:
        self.counted["prompt_tokens"] += sum(len(o.prompt_token_ids) for o in finals)
        self.counted["generated_tokens"] += sum(len(c.token_ids) for o in finals for c in o.outputs)
        if any(c.finish_reason == "error" for o in finals for c in o.outputs):
            return self._error_line(index, line, BadRequest("the engine failed this line", None, 500))
        body = work.finish(finals)
        if "custom_id" in line:
            return {"id": f"jaxhybrid-{index}", "custom_id": line["custom_id"],
                    "response": {"status_code": 200, "request_id": f"jaxhybrid-{index}", "body": body},
                    "error": None}
        return {"id": line.get("id"), **body, "error": None}

    def _error_line(self, index: int, line: dict, error: BadRequest) -> dict:
        self.counted["errors"] += 1
        detail = errors.error_body(str(error), "BadRequestError" if error.status == 400 else "InternalServerError",
                                   error.status, error.param)["error"]
        if "custom_id" in line:
            return {"id": f"jaxhybrid-{index}", "custom_id": line["custom_id"], "response": None, "error": detail}
        return {"id": line.get("id"), "line": index + 1, "error": detail}
