"""The FastAPI app: parse a request, prepare its prompts off the event loop, submit them to the
`EngineLoop`, and stream or collect its outputs.

Handlers never touch the engine. Every error has an OpenAI body: an input problem a 400 naming the field, a
body that is too large a 413, an unknown model or route a 404, a full queue a 429 with `Retry-After`, a
draining or stuck engine a 503, and a request the engine failed a 500 (in-band, as a last `data:` event,
once a stream has started). The event loop only parses and routes: rendering chat templates, tokenizing and
detokenizing run on `ServerState.workers`, so a large prompt never holds up /health or other requests. A
client that goes away aborts its request: a stream is cancelled by Starlette, a plain request by
`_unless_disconnected`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable
from typing import NamedTuple

import llguidance
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.flags import installed_version
from jaxhybrid.openai import errors, render, responses
from jaxhybrid.openai.errors import BadRequest
from jaxhybrid.openai.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve import middleware, streaming
from jaxhybrid.serve.engine_loop import EngineUnavailable, QueueFull, RequestStream
from jaxhybrid.serve.http_errors import error_response
from jaxhybrid.serve.state import ServerState

log = logging.getLogger("jaxhybrid.serve")
DEFAULT_MAX_BODY_BYTES = 8 << 20  # --max-request-body-bytes


def build_app(state: ServerState, api_keys: tuple[str, ...] = (), *, root_path: str = "",
              request_id_headers: bool = False, tokenizer_info: bool = False,
              server_load_tracking: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app; vLLM's opt-ins: `root_path` (--root-path) also serves every path under that prefix,
    `request_id_headers` echoes X-Request-Id on every response, `tokenizer_info` serves GET /tokenizer_info,
    `server_load_tracking` GET /load (the generation requests in flight); `max_body_bytes` bounds a request's
    body (--max-request-body-bytes)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        yield
        state.loop.stop()  # after the graceful drain: what is left is aborted

    app = FastAPI(title="jaxhybrid", version=installed_version(), lifespan=lifespan)
    app.add_middleware(middleware.BodyGuard, max_bytes=max_body_bytes)
    if api_keys:
        app.add_middleware(middleware.ApiKeyGuard, keys=api_keys)
    if root_path:  # outside the key guard, which then sees the root path too
        app.add_middleware(middleware.RootPath, root_path=root_path)
    if request_id_headers:
        app.add_middleware(middleware.RequestIdHeader)
    app.add_middleware(middleware.InternalErrors)  # added last, so outermost: it sees every middleware's errors
    if server_load_tracking:
        @app.get("/load")
        async def load() -> dict:
            return {"server_load": state.server_load}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "cannot parse the body")
            return error_response(400, f"malformed JSON: {reason}", "body")
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        # pydantic's error type too ("greater_than_equal"), as vLLM's messages carry it; the param is the
        # request's field (the path goes on into the value, and through a union's members by their types)
        return error_response(400, f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')} "
                              f"[type={first.get('type', 'invalid')}]", location[0] if location else "body")

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, error: BadRequest) -> JSONResponse:
        return error_response(error.status, str(error), error.param)

    @app.exception_handler(QueueFull)
    async def _full(request: Request, error: QueueFull) -> JSONResponse:
        state.loop.metrics.rejected.inc()
        return error_response(429, f"the server is busy: {error}; retry later", headers={"Retry-After": "1"})

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:  # no route, method, ...
        return error_response(error.status_code, str(error.detail), headers=error.headers)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, error: EngineUnavailable) -> JSONResponse:
        return error_response(503, str(error))

    @app.get("/health")
    @app.get("/ping")  # SageMaker's health route, as vLLM serves it
    @app.post("/ping")
    async def health() -> Response:
        return Response(status_code=200 if state.loop.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.loop.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": installed_version()}

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "jaxhybrid", "root": state.model_root,
             "parent": None, "max_model_len": state.max_model_len, "permission": []} for name in state.model_names]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(state, body.model)
        tokenizer = render.require_tokenizer(state.built.tokenizer, "prompt")
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("send exactly one of prompt and messages", "prompt")

        def tokenized() -> dict:
            text = body.prompt if body.messages is None else render.render_chat(
                state.built.prompts, body.messages, body.add_generation_prompt, "messages", body.continue_final_message,
                content_format=state.content_format, tools=body.template_tools())
            render.check_text_fits(state.built.prompts, text, "prompt" if body.messages is None else "messages")
            add_special = body.messages is None if body.add_special_tokens is None else body.add_special_tokens
            ids = tokenizer.encode(text, add_special)
            return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                    "token_strs": tokenizer.token_strs(ids) if body.return_token_strs else None}

        return await state.off_loop(tokenized)

    if tokenizer_info:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            return render.tokenizer_info(render.require_tokenizer(state.built.tokenizer, "tokenizer"))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(state, body.model)
        vocab = state.built.model.config.vocab_size
        if len(body.tokens) > state.max_model_len:  # open without a key: no more than a context's worth
            raise BadRequest(f"at most max_model_len={state.max_model_len} token ids, got {len(body.tokens)}",
                             "tokens")
        if any(not 0 <= t < vocab for t in body.tokens):
            raise BadRequest(f"token ids must be in [0, {vocab})", "tokens")
        tokenizer = render.require_tokenizer(state.built.tokenizer, "tokens")
        return {"prompt": await state.off_loop(lambda: tokenizer.decode(body.tokens))}

    @app.post("/v1/completions")
    @middleware.load_aware(state)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        name = _check_model(state, body.model)
        body.check()
        prepared = await state.off_loop(lambda: _completion_prompts(state, body))
        prompts = prepared.prompts
        response_id = responses.response_id("cmpl", request.headers.get("X-Request-Id"), body.request_id)
        streams = await _add_all(state, responses.new_id(response_id), prepared, body.cache_salt)
        if body.stream:
            return streaming.sse(state, streaming.completion_chunks(state, streams, prompts, body, name, response_id))
        return await _unless_disconnected(request, state, _completion_response(state, streams, prompts, body, name,
                                                                               response_id))

    @app.post("/v1/chat/completions")
    @middleware.load_aware(state)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        name = _check_model(state, body.model)
        body.check()
        state.parsers.check(body)
        prepared = await state.off_loop(lambda: _chat_prompts(state, [body]))
        response_id = responses.response_id("chatcmpl", request.headers.get("X-Request-Id"), body.request_id)
        streams = await _add_all(state, responses.new_id(response_id), prepared, body.cache_salt)
        if body.stream:
            return streaming.sse(state, streaming.chat_chunks(state, streams, prepared.prompts[0], body, name,
                                                              response_id, state.parsers))
        return await _unless_disconnected(request, state, _chat_response(state, streams, body, name, response_id))

    @app.post("/v1/chat/completions/batch")
    @middleware.load_aware(state)
    async def chat_batch(body: BatchChatCompletionRequest, request: Request) -> Response:
        """vLLM's batched chat: each conversation a chat request of its own, answered together."""
        name = _check_model(state, body.model)
        body.check()
        conversations = body.conversations()
        for conversation in conversations:
            state.parsers.check(conversation)
        prepared = await state.off_loop(lambda: _chat_prompts(state, conversations))
        response_id = responses.response_id("chatcmpl", request.headers.get("X-Request-Id"), body.request_id)
        streams = await _add_all(state, responses.new_id(response_id), prepared, body.cache_salt)
        return await _unless_disconnected(request, state, _batch_chat_response(state, streams, conversations, name,
                                                                               response_id))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's single route, as vLLM serves it: a body that is a chat request is answered as
        /v1/chat/completions, else one that is a completion request as /v1/completions."""
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            raise BadRequest(f"JSON decode error: {error}") from None
        for kind, endpoint in ((ChatCompletionRequest, chat), (CompletionRequest, completions)):
            try:
                parsed = kind.model_validate(body)
            except ValidationError:
                continue
            return await endpoint(parsed, request)
        raise BadRequest("Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', "
                         "'CompletionRequest']")

    return app


# -- parsing -------------------------------------------------------------------------------------------------

def _check_model(state: ServerState, model: str | None) -> str:
    """The model a response names: the first served name, whichever of them the request gave, or none (an
    empty name too), as vLLM's --served-model-name; an unknown name is a 404."""
    if model and model not in state.model_names:
        raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
    return state.model_names[0]


class _Prepared(NamedTuple):
    """A request ready for the engine: its sampling params, prompts and compiled grammar (if constrained)."""

    params: SamplingParams
    prompts: list[Prompt]
    grammar: llguidance.LLMatcher | None
    grammar_after_reasoning: bool = True  # false: the request turned its reasoning off, the grammar starts at once


def _completion_prompts(state: ServerState, body: CompletionRequest) -> _Prepared:
    """The request's sampling params and its prompts, tokenized (on a worker thread)."""
    prompts = body.prompts()
    params = _checked(state, body.params(state.built.generation_defaults), len(prompts), "prompt")
    return _Prepared(params, [body.engine_prompt(state.built.prompts, p, params) for p in prompts],
                     _grammar(state, params))


def _chat_prompts(state: ServerState, conversations: list[ChatCompletionRequest]) -> _Prepared:
    """The sampling params (the same fields in each conversation) and each conversation's prompt: its
    prompt_token_ids, or its messages through the chat template (on a worker thread)."""
    first = conversations[0]
    params = state.parsers.adjust(first, first.params(state.built.generation_defaults))
    params = _checked(state, params, len(conversations), "messages")
    after_reasoning = first.include_reasoning and (first.chat_template_kwargs or {}).get("enable_thinking") is not False
    return _Prepared(params, [_chat_prompt(state, body, params) for body in conversations], _grammar(state, params),
                     after_reasoning)


def _grammar(state: ServerState, params: SamplingParams) -> llguidance.LLMatcher | None:
    """The request's grammar compiled here, on a worker thread, so a slow one never holds up the engine's."""
    if params.structured_outputs is None:
        return None
    try:
        return state.built.engine.structured.compile(params.structured_outputs)
    except ValueError as error:
        raise BadRequest(str(error), "structured_outputs") from error


def _checked(state: ServerState, params: SamplingParams, num_prompts: int, prompts_field: str) -> SamplingParams:
    """The engine's checks (ids against the vocabulary, constraint entries) and the request's size: n at most
    a batch, and all its sequences (prompts x n) within the queue's bound. Before the queue's check: a
    request that can never run is a 400, not a 429 to retry."""
    batch, queue = state.built.config.max_num_seqs, state.loop.max_queued
    if params.n > batch:
        raise BadRequest(f"n must be at most max_num_seqs={batch} (the samples of one prompt share a batch), got "
                         f"{params.n}", "n")
    if queue is not None and num_prompts * params.n > queue:
        raise BadRequest(f"the request asks for {num_prompts} prompt(s) x n={params.n} sequences, more than the "
                         f"queue holds (--max-num-queued-requests {queue})", "n" if params.n > 1 else prompts_field)
    try:
        table = state.built.engine.table
        table.constraint_entries(table.checked_params(params))  # bad words tokenized here, not on the engine's thread
    except ValueError as error:
        raise errors.as_bad_request(error) from error
    return params


def _chat_prompt(state: ServerState, body: ChatCompletionRequest, params: SamplingParams) -> Prompt:
    if body.prompt_token_ids is not None:
        return body.engine_prompt(state.built.prompts, body.prompt_token_ids, params)
    text = render.render_chat(state.built.prompts, body.messages, body.add_generation_prompt, "messages",
                              body.continue_final_message, body.template_kwargs(), state.content_format,
                              body.template_tools(state.exclude_tools_when_tool_choice_none))
    return body.engine_prompt(state.built.prompts, text, params)


async def _add_all(state: ServerState, response_id: str, prepared: _Prepared, cache_salt: str | None
                   ) -> list[RequestStream]:
    """Submit every prompt at once, if the queue has room for them all; if one is refused, the others are
    aborted and its error is raised."""
    params, prompts = prepared.params, prepared.prompts
    tokens = params.n * sum(len(p.token_ids) for p in prompts)
    bound = state.loop.max_queued_tokens
    if bound is not None and tokens > bound:  # it could never be queued: not a 429 to retry
        raise BadRequest(f"the request's prompts take {tokens} tokens (n counting n), more than the queue holds "
                         f"(--max-num-queued-tokens {bound})", "prompt")
    state.loop.check_room(len(prompts) * params.n, tokens)
    added = await asyncio.gather(*[state.loop.add(f"{response_id}-{i}", prompt, params, cache_salt, response_id,
                                                  prepared.grammar, prepared.grammar_after_reasoning)
                                   for i, prompt in enumerate(prompts)], return_exceptions=True)
    refused = [a for a in added if isinstance(a, BaseException)]
    if refused:
        for stream in added:
            if isinstance(stream, RequestStream):
                stream.close()
        if isinstance(refused[0], ValueError) and not isinstance(refused[0], BadRequest):
            raise errors.as_bad_request(refused[0]) from refused[0]
        raise refused[0]
    return added


async def _unless_disconnected(request: Request, state: ServerState, work: Awaitable[dict]) -> Response:
    """Run `work`, aborting it if the client goes away first (vLLM's `with_cancellation`)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        state.loop.metrics.disconnects.inc()
        return Response(status_code=499)
    try:
        return JSONResponse(task.result())
    except streaming.EngineFailed:
        return error_response(500, "Internal server error: the engine failed this request")


async def _completion_response(state: ServerState, streams: list[RequestStream], prompts: list[Prompt],
                               body: CompletionRequest, name: str, response_id: str) -> dict:
    finals = await streaming.finals(streams)
    texts = [render.prompt_text(state.built.tokenizer, p) for p in prompts] if body.echo else None
    return responses.completion_response(body, finals, name, texts, response_id,
                                         decode=responses.token_decoder(state.built.tokenizer),
                                         prompt_tokens_details=state.prompt_tokens_details)


async def _chat_response(state: ServerState, streams: list[RequestStream], body: ChatCompletionRequest, name: str,
                         response_id: str) -> dict:
    return responses.chat_response(body, (await streaming.finals(streams))[0], name, response_id,
                                   prompt_tokens_details=state.prompt_tokens_details, parsers=state.parsers)


async def _batch_chat_response(state: ServerState, streams: list[RequestStream],
                               conversations: list[ChatCompletionRequest], name: str, response_id: str) -> dict:
    return responses.batch_chat_response(conversations, await streaming.finals(streams), name, response_id,
                                         prompt_tokens_details=state.prompt_tokens_details, parsers=state.parsers)


