"""The OpenAI wire format with vLLM's extras: request bodies in, `SamplingParams` out, and the response,
chunk, usage and error objects back (reference/ecosystem.md §1.2-1.4).

Unknown fields are accepted and ignored, as vLLM does (clients send fields a server does not know);
fields we know but do not implement (`suffix`, `best_of`) are refused with a 400 rather than silently
dropped.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from jaxhybrid.api import LLM
from jaxhybrid.engine import Prompt
from jaxhybrid.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxhybrid.sampling_params import SamplingParams
from jaxhybrid.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # vLLM's clamp for -inf, so the JSON stays valid


class BadRequest(ValueError):
    """An input problem: a 400 whose body names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    user: str | None = None

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is not available when streaming", "prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict[str, Any]) -> SamplingParams:
        """`defaults` (the checkpoint's generation config), then vLLM's, where a field is null; a broken rule
        is a 400 naming its field."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        values = dict(n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                      stop=tuple(stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()),
                      ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens, min_tokens=self.min_tokens,
                      logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
                      bad_words=self.bad_words)
        values = {k: defaults[k] if v is None and k in defaults and k != "max_tokens" else v for k, v in values.items()}
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None or k in _NULLABLE})
        except ValueError as error:
            raise as_bad_request(error) from error


    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's string keys as token ids."""
        if self.logit_bias is None:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError as error:
            raise BadRequest(f"logit_bias keys must be token ids, got {list(self.logit_bias)}", "logit_bias") from error


_NULLABLE = {"max_tokens", "logprobs", "prompt_logprobs", "seed", "logit_bias", "allowed_token_ids", "bad_words"}


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise BadRequest("suffix is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of is not supported by this server (use n)", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        # echo with logprobs reports the prompt's logprobs too (vLLM)
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else self.prompt_logprobs
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        # unset: whatever fits in max_model_len (the engine resolves None)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def as_bad_request(error: Exception) -> BadRequest:
    """A ValueError from the engine or `SamplingParams` as a 400 naming its field where the message does."""
    message = re.sub(r"^request '[^']*': ", "", str(error))  # the engine's ids are no business of the client
    param = None
    if message.startswith("SamplingParams."):
        param = message.split()[0].removeprefix("SamplingParams.")
    elif message.startswith("cache_salt"):
        param = "cache_salt"
    elif "token id" in message or "prompt" in message:
        param = "prompt"
    elif "checkpoint" in message or "marker" in message:
        param = "prompt"
    return BadRequest(message, param)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _token_text(position: PositionLogprobs, token: int) -> str:
    decoded = position[token].decoded_token
    return decoded if decoded is not None else f"token_id:{token}"


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], offset: int,
                        decode: Callable[[int], str] | None = None) -> dict:
    """The completions `logprobs` object for tokens [their positions], text offsets counted from `offset`; a
    token without a position (the first of an echoed prompt) is named by `decode`, with null logprobs."""
    result = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, position in zip(token_ids, positions, strict=True):
        if position is None:
            text = decode(token) if decode is not None else ""
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            text = _token_text(position, token)
            result["token_logprobs"].append(_clamp(position[token].logprob))
            result["top_logprobs"].append({_token_text(position, t): _clamp(lp.logprob)
                                           for t, lp in position.items()})
        result["tokens"].append(text)
        result["text_offset"].append(offset)
        offset += len(text)
    return result


def token_decoder(llm: LLM) -> Callable[[int], str] | None:
    """One token's text, special tokens included (None without a tokenizer)."""
    tokenizer = llm.get_tokenizer()
    return None if tokenizer is None else lambda token: tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num_top: int) -> dict:
    def entry(position: PositionLogprobs, token: int) -> dict:
        text = _token_text(position, token)
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


def require_tokenizer(llm: LLM, param: str) -> Tokenizer:
    if llm.tokenizer is None:
        raise BadRequest("this model runs without a tokenizer (skip_tokenizer_init): send token ids", param)
    return llm.tokenizer


def render_chat(llm: LLM, messages: list[dict], add_generation_prompt: bool, param: str = "messages",
                continue_final_message: bool = False) -> str:
    """`messages` through the checkpoint's chat template; a bad message or template is a 400."""
    try:
        return require_tokenizer(llm, param).apply_chat_template(messages, add_generation_prompt,
                                                                 continue_final_message)
    except ValueError as error:
        raise BadRequest(str(error), param) from error


def prompt_text(llm: LLM, prompt: Prompt, param: str = "echo") -> str:
    """A prompt's text for echo: as sent, or decoded from its token ids."""
    if prompt.text is not None:
        return prompt.text
    return require_tokenizer(llm, param).decode(list(prompt.token_ids), skip_special_tokens=False)


def prompt_for(llm: LLM, prompt: str | list[int] | dict, params: SamplingParams) -> Prompt:
    """Tokenize and place the checkpoint marker (`LLM.parse_prompt`'s inputs); check the lengths against
    max_model_len (vLLM's messages)."""
    if isinstance(prompt, list):
        if any(t < 0 for t in prompt):
            raise BadRequest("prompt token ids must be >= 0", "prompt")
        prompt = {"prompt_token_ids": prompt}
    try:
        parsed = llm.parse_prompt(prompt)
    except ValueError as error:
        raise as_bad_request(error) from error
    length, limit = len(parsed.token_ids), llm.config.max_model_len
    if length > limit:
        raise BadRequest(f"Input length ({length}) exceeds model's maximum context length ({limit}).", "prompt")
    if params.max_tokens is not None and length + params.max_tokens > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{length + params.max_tokens} tokens ({length} in the prompt, {params.max_tokens} in "
                         "the completion).", "max_tokens")
    return parsed


def completion_response(body: CompletionRequest, finals: list[RequestOutput], model: str,
                        echoed: list[str] | None = None, response_id: str | None = None,
                        created: int | None = None, decode: Callable[[int], str] | None = None) -> dict:
    """The `text_completion` object of finished requests, one per prompt; `echoed` holds the prompts' texts
    when the body asks for echo, `decode` names an echoed prompt's first token."""
    choices = []
    for i, output in enumerate(finals):
        prefix = echoed[i] if body.echo else ""
        for completion in output.outputs:
            choice = {"index": i * body.n + completion.index, "text": prefix + completion.text, "logprobs": None,
                      **finish_fields(completion)}
            if completion.logprobs is not None:
                tokens, positions = completion.token_ids, completion.logprobs
                if body.echo:
                    tokens, positions = output.prompt_token_ids + tokens, output.prompt_logprobs + positions
                choice["logprobs"] = completion_logprobs(tokens, positions, 0, decode)
            choice["prompt_logprobs"] = (None if body.prompt_logprobs is None  # vLLM: null, never absent
                                         else prompt_logprobs_json(output.prompt_logprobs))
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return {**envelope("text_completion", response_id or new_id("cmpl"), model, created), "choices": choices,
            "usage": usage(finals)}


def chat_response(body: ChatCompletionRequest, final: RequestOutput, model: str, response_id: str | None = None,
                  created: int | None = None) -> dict:
    choices = []
    for completion in final.outputs:
        choice = {"index": completion.index, "message": {"role": "assistant", "content": completion.text},
                  "logprobs": None, **finish_fields(completion)}
        if completion.logprobs is not None:
            choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0)
        choices.append(choice)
    reply = {**envelope("chat.completion", response_id or new_id("chatcmpl"), model, created), "choices": choices,
             "usage": usage([final])}
    reply["prompt_logprobs"] = None if body.prompt_logprobs is None else prompt_logprobs_json(final.prompt_logprobs)
    return reply
