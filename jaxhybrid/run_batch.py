"""`python -m jaxhybrid.run_batch`: offline batch jobs, JSONL in and JSONL out, in input order (docs/batch.md).

Two line formats, told apart by their keys: the OpenAI batch lines of `vllm run-batch`, and scoring lines
`{"id", "prompt", "candidates", "top_logprobs"?}`, whose prompt is computed once for all its candidates.
A bad line becomes an error line and the job goes on. Lines run a window at a time, each window from an
empty prefix cache; ids and seeds come from line numbers. So a line's output depends only on its window, and a
resumed job (`--resume`) or one spread over Ray Data actors (`--ray`) writes the same bytes as one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from jaxhybrid.engine.outputs import RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine_args import (
    TOOL_FLAGS,
    ParserSetupError,
    build_llm,
    check_tool_flags,
    make_parser,
    non_default,
    parse_args,
)
from jaxhybrid.llm import LLM
from jaxhybrid.malloc import preload_tcmalloc
from jaxhybrid.sample.params import MAX_SEED, SamplingParams
from jaxhybrid.scoring import PromptScores, read_scores, scoring_requests
from jaxhybrid.serve import errors, render, responses
from jaxhybrid.serve.chat_parsing import ChatParsers
from jaxhybrid.serve.errors import BadRequest
from jaxhybrid.serve.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("jaxhybrid.run_batch")

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


def _batch_work(llm: LLM, line: dict, index: int, model: str, created: int, seed: int,
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
    params = _seeded(request.params(llm.generation_defaults), seed * 1_000_003 + index)
    response_id = f"{'cmpl' if url == '/v1/completions' else 'chatcmpl'}-{index}"
    if isinstance(request, ChatCompletionRequest):
        params = parsers.adjust(request, params)
        text = render.render_chat(llm, request.messages, request.add_generation_prompt, "body.messages",
                                  request.continue_final_message, request.template_kwargs(),
                                  tools=request.template_tools())
        prompt = request.engine_prompt(llm, text, params)
        return _Work([(prompt, params)], lambda finals: responses.chat_response(
            request, finals[0], model, response_id, created, parsers=parsers))
    prompts = [request.engine_prompt(llm, p, params) for p in request.prompts()]
    echoed = [render.prompt_text(llm, p) for p in prompts] if request.echo else None
    return _Work([(p, params) for p in prompts], lambda finals: responses.completion_response(
        request, finals, model, echoed, response_id, created, responses.token_decoder(llm)))


@dataclass
class JobSummary:
    lines: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the cache or a checkpoint, of all looked up
    checkpoint_hit_rate: float = 0.0    # requests with a checkpoint that started from it, of all with one

    @classmethod
    def of(cls, counters: Counter, seconds: float) -> JobSummary:
        """From `BatchJob.counters`, summed over windows and replicas."""
        return cls(counters["lines"], counters["errors"], counters["prompt_tokens"], counters["generated_tokens"],
                   seconds, counters["cached_tokens"] / max(counters["prefix_cache_queries"], 1),
                   counters["checkpoint_hits"] / max(counters["checkpoint_queries"], 1))


class BatchJob:
    """Runs input lines through one `LLM`, a window at a time, and yields output lines in input order."""

    def __init__(self, llm: LLM, *, model_name: str, created: int = 0, seed: int = 0, reuse: bool = True,
                 default_top_logprobs: int | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False):
        self.llm, self.model_name, self.created, self.seed = llm, model_name, created, seed
        self.reuse, self.default_top_logprobs = reuse, default_top_logprobs
        # chat lines are parsed as the server parses chat: the engine's reasoning parser, the tool-call flags
        self.parsers = ChatParsers.from_flags(llm.tokenizer, llm.args.reasoning_parser, tool_call_parser,
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
        return self.counted + Counter({name: getattr(self.llm.engine.stats, name) for name in lookups})

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
            return _batch_work(self.llm, line, index, self.model_name, self.created, self.seed, self.parsers)
        if "candidates" not in line or "prompt" not in line:
            raise BadRequest("a line needs custom_id/url/body (OpenAI batch) or prompt/candidates (scoring)", "line")
        top = line.get("top_logprobs", self.default_top_logprobs)
        scoring = scoring_requests(self.llm, line["prompt"], line["candidates"], top, self.reuse)
        return _Work(scoring.requests, lambda finals: _scores_json(read_scores(finals, scoring.prompt_len, top)),
                     scoring.prompt_logprobs_from)

    def _run_window(self, chunk: list[tuple[int, str]]) -> Iterator[str]:
        engine, results, pending = self.llm.engine, {}, {}
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


def resume_point(output: Path, window: int) -> int:
    """Lines of an earlier run of the job to keep: its complete lines, down to a whole number of windows (a
    line's floating-point results depend on the lines it ran with). The rest is cut off the file."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    keep = data.count(b"\n") // window * window
    end = 0
    for _ in range(keep):
        end = data.index(b"\n", end) + 1
    with output.open("r+b") as f:
        f.truncate(end)
    return keep


def _input_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number among non-blank lines, text), read lazily."""
    with path.open() as f:
        yield from enumerate(line for line in f if line.strip())


_SCORE_FLAGS: dict[str, dict] = {
    "--input": dict(required=True, help="JSONL input (OpenAI batch lines or scoring lines)"),
    "--output": dict(required=True, help="JSONL output, one line per input line, in input order"),
    "--resume": dict(action="store_true", help="keep the complete lines of an earlier run and carry on"),
    "--window": dict(type=int, default=256, help="input lines in flight at once"),
    "--top-logprobs": dict(type=int, default=None, help="scoring lines: top-k next tokens after the prompt"),
    "--checkpoint-reuse": dict(action=argparse.BooleanOptionalAction, default=True,
                               help="scoring lines: compute each prompt once (--no-checkpoint-reuse: per candidate)"),
    "--served-model-name": dict(default=None, help="the `model` field of OpenAI batch responses"),
    "--ray": dict(action="store_true", help="data parallel: windows spread over Ray Data actors, one engine each"),
    "--num-replicas": dict(type=int, default=1, help="with --ray: engines (actors; one GPU each where GPUs exist)"),
    "--ray-address": dict(default=None, help="with --ray: the cluster to join (default: RAY_ADDRESS, else local)"),
    **TOOL_FLAGS,
}


def main(argv: list[str] | None = None) -> JobSummary:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = make_parser("python -m jaxhybrid.run_batch", __doc__.splitlines()[0], _SCORE_FLAGS)
    args = parse_args(parser, argv)
    check_tool_flags(parser, args)
    log.info("non-default arguments: %s", non_default(parser, args))
    source, output = Path(args.input), Path(args.output)
    if not source.exists():
        parser.error(f"--input {source} does not exist")
    if args.window < 1 or args.num_replicas < 1:
        parser.error("--window and --num-replicas must be >= 1")
    done = resume_point(output, args.window) if args.resume else 0
    job_options = dict(model_name=args.served_model_name or str(args.model or "jaxhybrid-default"),
                       created=int(source.stat().st_mtime), seed=args.seed, reuse=args.checkpoint_reuse,
                       default_top_logprobs=args.top_logprobs, tool_call_parser=args.tool_call_parser,
                       enable_auto_tool_choice=args.enable_auto_tool_choice)
    lines = itertools.islice(_input_lines(source), done, None)
    if args.ray:
        from jaxhybrid.ray_data import score_windows

        windows = score_windows(lines, args.window, num_replicas=args.num_replicas, address=args.ray_address,
                                make_llm=functools.partial(build_llm, args), job_options=job_options)
    else:
        try:
            job = BatchJob(build_llm(args), **job_options)
        except ParserSetupError as error:  # a parser flag the model's tokenizer cannot serve: one line
            raise SystemExit(f"python -m jaxhybrid.run_batch: error: {error}") from None
        windows = job.run(lines, args.window)
    start, counters = time.perf_counter(), Counter()
    with output.open("a" if args.resume else "w") as out, tqdm(desc="score", unit="line", initial=done) as bar:
        for texts, counted in windows:
            for text in texts:
                out.write(text)  # one whole line per write; a kill leaves at most a torn last line
                out.flush()
            counters += counted
            bar.update(len(texts))
            bar.set_postfix_str(f"{counters['prompt_tokens'] / (time.perf_counter() - start):.0f} prompt tok/s")
        os.fsync(out.fileno())
    summary = JobSummary.of(counters, time.perf_counter() - start)
    print(json.dumps({"summary": dataclasses.asdict(summary), "resumed_after": done}), file=sys.stderr)
    return summary


if __name__ == "__main__":
    preload_tcmalloc()
    main()
