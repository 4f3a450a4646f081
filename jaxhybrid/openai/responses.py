"""Response bodies: completions, chat and batch chat, their logprobs, usage, finish fields and ids."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from jaxhybrid.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.openai.chat_parsing import ChatParsers, ChoiceParser
from jaxhybrid.openai.protocol import ChatCompletionRequest, CompletionRequest, _Request

NO_PARSERS = ChatParsers()

LOGPROB_FLOOR = -9999.0  # vLLM's clamp for -inf, so the JSON stays valid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, header: str | None, requested: str | None) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else a fresh id, after `prefix-`."""
    given = header or requested
    return f"{prefix}-{given}" if given else new_id(prefix)


def usage_counts(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage(outputs: list[RequestOutput], prompt_tokens_details: bool = False) -> dict:
    """The counts over `outputs`; with `prompt_tokens_details` (vLLM's --enable-prompt-tokens-details) also
    `prompt_tokens_details.cached_tokens`: how many prompt tokens (counted in prompt_tokens too) came from the
    prefix cache or a checkpoint."""
    counts = usage_counts(sum(len(o.prompt_token_ids) for o in outputs),
                          sum(len(c.token_ids) for o in outputs for c in o.outputs))
    if prompt_tokens_details:
        counts["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}
    return counts


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _token_text(position: PositionLogprobs, token: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or "token_id:<id>" when asked (return_tokens_as_token_ids) or
    when there is no text."""
    decoded = position[token].decoded_token
    return decoded if decoded is not None and not as_id else f"token_id:{token}"


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], offset: int,
                        decode: Callable[[int], str] | None = None, as_ids: bool = False) -> dict:
    """The completions `logprobs` object for tokens [their positions], text offsets counted from `offset`; a
    token without a position (the first of an echoed prompt), or missing from its position's top logprobs,
    is named by `decode`, with null logprobs (vLLM); `as_ids` names every token "token_id:<id>"."""
    result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, position in zip(token_ids, positions, strict=True):
        if position is None or token not in position:
            text = f"token_id:{token}" if as_ids else decode(token) if decode is not None else ""
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            text = _token_text(position, token, as_ids)
            result["token_logprobs"].append(_clamp(position[token].logprob))
            result["top_logprobs"].append({_token_text(position, t, as_ids): _clamp(lp.logprob)
                                           for t, lp in position.items()})
        result["tokens"].append(text)
        result["text_offset"].append(offset)
        offset += len(text)
    return result


def token_decoder(tokenizer: Tokenizer | None) -> Callable[[int], str] | None:
    """One token's text, special tokens included (None without a tokenizer)."""
    return None if tokenizer is None else lambda token: tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num_top: int,
                  as_ids: bool = False) -> dict:
    def entry(position: PositionLogprobs, token: int) -> dict:
        text = _token_text(position, token, as_ids)
        return {"token": text, "logprob": _clamp(position[token].logprob), "bytes": list(text.encode())}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        top = sorted(position.items(), key=lambda item: item[1].rank)[:num_top if num_top >= 0 else None]
        content.append({**entry(position, token), "top_logprobs": [entry(position, t) for t, _ in top]})
    return {"content": content}


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    if positions is None:
        return None
    return [None if p is None else {str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in p.items()}
            for p in positions]


def finish_fields(completion: CompletionOutput) -> dict:
    return {"finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}


def envelope(kind: str, response_id: str, model: str, created: int | None = None) -> dict:
    return {"id": response_id, "object": kind, "created": created or int(time.time()), "model": model}


def completion_response(body: CompletionRequest, finals: list[RequestOutput], model: str,
                        echoed: list[str] | None = None, response_id: str | None = None,
                        created: int | None = None, decode: Callable[[int], str] | None = None,
                        prompt_tokens_details: bool = False) -> dict:
    """The `text_completion` object of finished requests, one per prompt; `echoed` holds the prompts' texts
    when the body asks for echo, `decode` names an echoed prompt's first token."""
    choices = []
    for i, output in enumerate(finals):
        prefix = echoed[i] if body.echo else ""
        for completion in output.outputs:
            choice = {"index": i * body.n + completion.index, "text": prefix + completion.text, "logprobs": None,
                      **finish_fields(completion), **token_ids_fields(body, completion.token_ids)}
            if completion.logprobs is not None:
                tokens, positions = completion.token_ids, completion.logprobs
                if body.echo:
                    tokens, positions = output.prompt_token_ids + tokens, output.prompt_logprobs + positions
                choice["logprobs"] = completion_logprobs(tokens, positions, 0, decode, body.return_tokens_as_token_ids)
            choice["prompt_logprobs"] = (None if body.prompt_logprobs is None  # vLLM: null, never absent
                                         else prompt_logprobs_json(output.prompt_logprobs))
            choice["prompt_token_ids"] = output.prompt_token_ids if body.return_token_ids else None
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {**envelope("text_completion", response_id or new_id("cmpl"), model, created), "choices": choices,
            "usage": usage(finals, prompt_tokens_details)}


def chat_response(body: ChatCompletionRequest, final: RequestOutput, model: str, response_id: str | None = None,
                  created: int | None = None, prompt_tokens_details: bool = False,
                  parsers: ChatParsers = NO_PARSERS) -> dict:
    reply = {**envelope("chat.completion", response_id or new_id("chatcmpl"), model, created),
             "choices": chat_choices(body, final, parsers), "usage": usage([final], prompt_tokens_details)}
    reply["prompt_logprobs"] = None if body.prompt_logprobs is None else prompt_logprobs_json(final.prompt_logprobs)
    reply["prompt_token_ids"] = final.prompt_token_ids if body.return_token_ids else None
    return reply


def batch_chat_response(conversations: list[ChatCompletionRequest], finals: list[RequestOutput], model: str,
                        response_id: str, prompt_tokens_details: bool = False,
                        parsers: ChatParsers = NO_PARSERS) -> dict:
    """vLLM's batched chat reply: conversation i's choice has index i, the usage counts them all (and, as
    vLLM's, no prompt logprobs or prompt ids)."""
    choices = [{**choice, "index": i} for i, (body, final) in enumerate(zip(conversations, finals, strict=True))
               for choice in chat_choices(body, final, parsers)]
    return {**envelope("chat.completion", response_id, model), "choices": choices,
            "usage": usage(finals, prompt_tokens_details), "prompt_logprobs": None, "prompt_token_ids": None}


def chat_choices(body: ChatCompletionRequest, final: RequestOutput, parsers: ChatParsers = NO_PARSERS) -> list[dict]:
    """One choice per completion: its message (reasoning and tool calls split off by the server's parsers,
    one parser per choice), logprobs and finish fields. vLLM's include_reasoning=false also drops the logprobs
    and token ids, which would show the reasoning."""
    choices, hidden = [], parsers.hides_metadata(body)
    for completion in final.outputs:
        message, finish_reason = chat_message(body, completion, parsers.choice_parser(body, final.prompt_token_ids))
        choice = {"index": completion.index, "message": message, "logprobs": None, **finish_fields(completion),
                  "finish_reason": finish_reason, **token_ids_fields(body, None if hidden else completion.token_ids)}
        if completion.logprobs is not None and not hidden:
            choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0,
                                               body.return_tokens_as_token_ids)
        choices.append(choice)
    return choices


def chat_message(body: ChatCompletionRequest, completion: CompletionOutput, parser: ChoiceParser | None
                 ) -> tuple[dict, str | None]:
    """vLLM's assistant message of a whole output, and its finish_reason ("tool_calls" where it called tools);
    echo puts the last message's content before the message's own."""
    reasoning, content, calls = (None, completion.text, []) if parser is None else parser.parse(completion.text)
    if body.echo:
        content = body.echoed_content() + (content or "")
    message = {"role": "assistant", "content": content, "reasoning": reasoning}
    if calls:
        message["tool_calls"] = [call.model_dump() for call in calls]
    reason = completion.finish_reason if parser is None else parser.finish_reason(completion.finish_reason, calls)
    return message, reason


def token_ids_fields(body: _Request, token_ids: list[int] | None) -> dict:
    """A choice's `token_ids` (vLLM's return_token_ids: null unless asked, or hidden)."""
    return {"token_ids": list(token_ids) if body.return_token_ids and token_ids is not None else None}
