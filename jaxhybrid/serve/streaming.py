"""A request's outputs as they come: merged over its prompts, collected, or streamed as server-sent events
whose chunks carry only what is new."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from jaxhybrid.engine.outputs import CompletionOutput, RequestOutput
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.openai import render, responses
from jaxhybrid.openai.chat_parsing import ChatParsers, ChoiceParser
from jaxhybrid.openai.errors import error_body
from jaxhybrid.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxhybrid.serve.engine_loop import EngineUnavailable, RequestStream
from jaxhybrid.serve.state import ServerState


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream as they come; closing it aborts the unfinished ones."""
    if len(streams) == 1:  # the common case needs no tasks
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except BaseException as error:
            queue.put_nowait((i, error))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


def check_output(output: RequestOutput) -> None:
    if any(c.finish_reason == "error" for c in output.outputs):
        raise EngineFailed()


class EngineFailed(Exception):
    """The engine ended a request with finish_reason "error"."""


async def finals(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, output in merged(streams):
        check_output(output)
        finals[i] = output
    return finals


def sse(state: ServerState, events: AsyncIterator[dict]) -> StreamingResponse:
    async def lines() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
                # while its outputs are ready, a stream awaits nothing that suspends (nor does a socket
                # that takes the bytes): let other requests in between its chunks
                await asyncio.sleep(0)
        except EngineFailed:
            yield f"data: {json.dumps(error_body('Internal server error', 'InternalServerError', 500))}\n\n"
        except EngineUnavailable as error:
            yield f"data: {json.dumps(error_body(str(error), 'ServiceUnavailableError', 503))}\n\n"
        except asyncio.CancelledError:  # the client went away; closing `events` aborted its requests
            state.loop.metrics.disconnects.inc()
            raise
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


class Deltas:
    """What each choice has sent so far, so that every chunk carries only new text and tokens."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens)
        self.finished: set[int] = set()  # choices whose finish_reason was sent

    def new(self, index: int, completion) -> tuple[str, int, int] | None:
        """(new text, first new token, end token), or None when nothing changed; a finished choice sends
        its finish_reason once, though later outputs of its request (n > 1) still carry it."""
        if index in self.finished:
            return None
        chars, tokens = self.sent.get(index, (0, 0))
        text, num_tokens = completion.text, len(completion.token_ids)
        if len(text) == chars and num_tokens == tokens and not completion.finished():
            return None
        self.sent[index] = (len(text), num_tokens)
        if completion.finished():
            self.finished.add(index)
        return text[chars:], tokens, num_tokens


async def completion_chunks(state: ServerState, streams: list[RequestStream], prompts: list[Prompt],
                            body: CompletionRequest, name: str, response_id: str) -> AsyncIterator[dict]:
    head = responses.envelope("text_completion", response_id, name)
    # offsets: where a choice's next token text starts, echo included; the tokens' own texts count, as the
    # streamed text can lag them (text that may start a stop string is held back) (vLLM)
    deltas, finals, offsets, decode = Deltas(), {}, {}, responses.token_decoder(state.built.tokenizer)
    final_usage, continuous = body.usage_flags(state.force_include_usage)
    async for i, output in merged(streams):
        check_output(output)
        finals[i] = output
        for completion in output.outputs:
            index = i * body.n + completion.index
            first = index not in deltas.sent
            new = deltas.new(index, completion)
            if new is None:
                continue
            text, start, end = new
            echoed = render.prompt_text(state.built.tokenizer, prompts[i]) if body.echo and first else ""
            choice = {"index": index, "text": echoed + text, "logprobs": None, "finish_reason": None,
                      "stop_reason": None}
            if completion.logprobs is not None:
                offset = offsets.get(index, 0) + len(echoed)
                logprobs = responses.completion_logprobs(completion.token_ids[start:end],
                                                         completion.logprobs[start:end], offset, decode,
                                                         body.return_tokens_as_token_ids)
                offsets[index] = offset + sum(len(token) for token in logprobs["tokens"])
                choice["logprobs"] = logprobs
            if body.return_token_ids:  # vLLM: the prompt's ids on a choice's first chunk, then each delta's
                choice["token_ids"] = completion.token_ids[start:end]
                if first:
                    choice["prompt_token_ids"] = output.prompt_token_ids
            if completion.finished():
                choice.update(responses.finish_fields(completion))
            yield with_usage(continuous, {**head, "choices": [choice]}, len(output.prompt_token_ids), end)
    if final_usage:
        yield {**head, "choices": [], "usage": responses.usage(list(finals.values()), state.prompt_tokens_details)}


async def chat_chunks(state: ServerState, streams: list[RequestStream], prompt: Prompt, body: ChatCompletionRequest,
                      name: str, response_id: str, parsers: ChatParsers = responses.NO_PARSERS) -> AsyncIterator[dict]:
    """The chunks of a chat stream; `parsers` (the server's) split each choice's deltas into reasoning, content
    and tool calls."""
    head = responses.envelope("chat.completion.chunk", response_id, name)
    deltas, final, num_prompt = Deltas(), None, len(prompt.token_ids)
    final_usage, continuous = body.usage_flags(state.force_include_usage)
    for index in range(body.n):  # the first delta of each choice carries the role (OpenAI)
        chunk = {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
        if body.return_token_ids and index == 0:  # vLLM: the prompt's ids on the first chunk only
            chunk["prompt_token_ids"] = list(prompt.token_ids)
        yield with_usage(continuous, chunk, num_prompt, 0)
    echoed = body.echoed_content()
    for index in range(body.n if echoed else 0):  # vLLM: the echo is each choice's first content delta
        chunk = {**head, "choices": [{"index": index, "delta": {"content": echoed}, "logprobs": None,
                                      "finish_reason": None}]}
        yield with_usage(continuous, chunk, num_prompt, 0)
    choice_parsers: dict[int, ChoiceParser | None] = {}  # one per choice, made at its first output
    async for _, output in merged(streams):
        check_output(output)
        final = output
        for completion in output.outputs:
            new = deltas.new(completion.index, completion)
            if new is None:
                continue
            if completion.index not in choice_parsers:
                choice_parsers[completion.index] = parsers.choice_parser(body, prompt.token_ids)
            choice = _chat_choice(body, completion, new, choice_parsers[completion.index],
                                  parsers.hides_metadata(body))
            if choice is not None:
                yield with_usage(continuous, {**head, "choices": [choice]}, num_prompt, new[2])
    if final_usage and final is not None:
        yield {**head, "choices": [], "usage": responses.usage([final], state.prompt_tokens_details)}


def _chat_choice(body: ChatCompletionRequest, completion: CompletionOutput, new: tuple[str, int, int],
                 parser: ChoiceParser | None, hidden: bool) -> dict | None:
    """A chunk's choice for a completion's new text and tokens; None when it has nothing to send (the parser
    holds the text back, and neither logprobs nor token ids go out), as vLLM skips such chunks."""
    text, start, end = new
    token_ids = completion.token_ids[start:end]
    if parser is None:
        delta = {"content": text} if text else {}
    else:
        message = parser.delta(text, token_ids, last=completion.finished())
        delta = None if message is None else message.model_dump(exclude_none=True)
    choice = {"index": completion.index, "delta": delta or {}, "logprobs": None, "finish_reason": None,
              "stop_reason": None}
    if completion.logprobs is not None and not hidden:
        choice["logprobs"] = responses.chat_logprobs(token_ids, completion.logprobs[start:end],
                                                     body.top_logprobs or 0, body.return_tokens_as_token_ids)
    if body.return_token_ids and not hidden:
        choice["token_ids"] = token_ids
    if completion.finished():
        choice.update(responses.finish_fields(completion))
        if parser is not None:
            choice["finish_reason"] = parser.finish_reason(completion.finish_reason)
    elif delta is None and choice["logprobs"] is None and "token_ids" not in choice:
        return None
    return choice


def with_usage(continuous: bool, chunk: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    """vLLM's continuous usage: with it, each chunk counts its prompt and its choice's tokens so far."""
    if continuous:
        chunk["usage"] = responses.usage_counts(prompt_tokens, completion_tokens)
    return chunk
