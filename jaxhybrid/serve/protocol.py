"""The OpenAI wire format with vLLM's extras: request bodies in, `SamplingParams` out, and the response,
chunk, usage and error objects back (reference/ecosystem.md §1.2-1.4).

Unknown fields are accepted and ignored, as vLLM does (clients send fields a server does not know);
vLLM's fields we do not implement (`suffix`, `best_of`, tools, structured outputs, beam search, ...
`_UNSUPPORTED`) are refused with a 400 when set to anything but their default, rather than silently dropped.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxhybrid.api import LLM
from jaxhybrid.engine import Prompt
from jaxhybrid.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from jaxhybrid.sampling_params import SamplingParams
from jaxhybrid.tokenizer import Tokenizer

LOGPROB_FLOOR = -9999.0  # vLLM's clamp for -inf, so the JSON stays valid
LONG_MIN, LONG_MAX = -2 ** 63, 2 ** 63 - 1  # a request's seed is a signed 64-bit integer (vLLM)


class BadRequest(ValueError):
    """An input problem: a 400 whose body names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # vLLM's (an empty stream_options adds no usage)
    continuous_usage_stats: bool | None = False  # usage on every chunk too


def _unset(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return not value


# vLLM request fields this server does not implement -> "the value is vLLM's default (or changes nothing)";
# any other value is a 400 naming the field
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _off, "length_penalty": lambda v: v == 1, "watermarking": _off,
    "spaces_between_special_tokens": lambda v: v is True,
    "prompt_embeds": _unset, "priority": lambda v: v == 0,
    "structured_outputs": _unset, "guided_json": _unset, "guided_regex": _unset, "guided_choice": _unset,
    "guided_grammar": _unset, "structural_tag": _unset,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "kv_transfer_params": _unset, "ec_transfer_params": _unset, "vllm_xargs": _unset,
    "repetition_detection": _unset, "thinking_token_budget": lambda v: v in (None, -1),
    "stream_interval": lambda v: v in (None, 1),
}
_CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _off, "tool_choice": lambda v: v in (None, "none", "auto"),
    "reasoning_effort": _unset, "documents": _unset, "chat_template": _unset, "mm_processor_kwargs": _unset,
    "media_io_kwargs": _unset, "return_prompt_text": _off,
}


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
    seed: int | None = Field(None, ge=LONG_MIN, le=LONG_MAX)
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
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None  # the response id's default (an X-Request-Id header wins)
    logprob_token_ids: list[int] | None = None

    _unsupported: ClassVar[dict[str, Callable[[Any], bool]]] = _UNSUPPORTED

    def engine_prompt(self, llm: LLM, prompt: str | list[int] | dict, params: SamplingParams) -> Prompt:
        """`prompt_for` with this request's truncation side and special-token choice (every entry point
        that reads a request prepares its prompts here, so none can drop an option)."""
        return prompt_for(llm, prompt, params, self.truncation_side, self.add_special_tokens)

    def check(self) -> None:
        extra = self.model_extra or {}
        for name, is_default in self._unsupported.items():
            if name in extra and not is_default(extra[name]):
                raise BadRequest(f"{name} is not supported by this server (only its default)", name)
        self._check_logprob_token_ids()
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options can only be set when stream is true", "stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise BadRequest("prompt_logprobs is not available when streaming", "prompt_logprobs")

    def _check_logprob_token_ids(self) -> None:
        """vLLM's rules for the field first, so a malformed one says what is wrong; a well-formed one is
        refused: the engine reports top-k logprobs, not those of chosen ids."""
        if self.logprob_token_ids is None:
            return
        if not self.logprob_token_ids:
            raise BadRequest("`logprob_token_ids` must not be an empty list", "logprob_token_ids")
        if self.logprobs is None or self.logprobs is False:
            raise BadRequest("`logprobs` must be set when using `logprob_token_ids`", "logprob_token_ids")
        raise BadRequest("logprob_token_ids is not supported by this server", "logprob_token_ids")

    def usage_flags(self, force_include_usage: bool = False) -> tuple[bool, bool]:
        """(a usage chunk at the end of a stream, usage on every chunk): vLLM's stream options, or both
        when the server forces usage (--enable-force-include-usage)."""
        if force_include_usage:
            return True, True
        options = self.stream_options
        include = bool(options and options.include_usage)
        return include, include and bool(options.continuous_usage_stats)

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
                      bad_words=self.bad_words,
                      truncate_prompt_tokens=self.truncate_prompt_tokens)
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


_NULLABLE = {"max_tokens", "logprobs", "prompt_logprobs", "seed", "logit_bias", "allowed_token_ids", "bad_words",
             "truncate_prompt_tokens"}


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True  # the tokenizer's own special tokens (a BOS, say) around the prompt

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
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the reply starts with the last message's content when its role is the reply's
    prompt_token_ids: list[int] | None = None  # a rendered prompt, instead of messages (vLLM's token in)
    add_special_tokens: bool = False  # the chat template already wrote them

    _unsupported: ClassVar[dict[str, Callable[[Any], bool]]] = {**_UNSUPPORTED, **_CHAT_UNSUPPORTED}
    _TEMPLATE_OPTIONS: ClassVar[tuple[str, ...]] = ("add_generation_prompt", "continue_final_message",
                                                    "chat_template_kwargs")

    def check(self) -> None:
        super().check()
        if self.prompt_token_ids is not None:
            self._check_token_in()
        elif not self.messages:
            raise BadRequest("messages must not be empty", "messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", "top_logprobs")

    def _check_token_in(self) -> None:
        """Pre-tokenized input is already rendered: messages and chat-template options would be ignored."""
        if not self.prompt_token_ids:
            raise BadRequest("prompt_token_ids must not be empty", "prompt_token_ids")
        if self.messages:
            raise BadRequest("send either messages or prompt_token_ids, not both", "messages")
        for name in self._TEMPLATE_OPTIONS:
            if name in self.model_fields_set:
                raise BadRequest(f"{name} applies to messages; prompt_token_ids are already rendered", name)

    def echoed_content(self) -> str:
        """vLLM's chat echo: the last message's text when its role is the reply's (the assistant's after a
        generation prompt, else the last message's own), "" otherwise or without echo."""
        if not self.echo or not self.messages:
            return ""
        last = _text_content(self.messages[-1:], "messages")[0]
        role = "assistant" if self.add_generation_prompt else last.get("role")
        return (last.get("content") or "") if last.get("role") == role else ""

    def params(self, defaults: dict[str, Any]) -> SamplingParams:
        # unset: whatever fits in max_model_len (the engine resolves None)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch body: the chat fields, with `messages` a list of conversations, each
    answered by one choice whose index is its position. No streaming, n = 1, no prompt_logprobs, and no
    prompt_token_ids (one rendered prompt cannot stand for several conversations)."""

    messages: list[list[dict[str, Any]]]

    def check(self) -> None:
        """The batch's own rules, then each conversation's as /v1/chat/completions checks its body."""
        if not self.messages or not all(self.messages):
            raise BadRequest("messages must be a non-empty list of non-empty conversations", "messages")
        if self.stream:
            raise BadRequest("Batch chat completions do not support streaming", "stream")
        if self.n != 1:
            raise BadRequest("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
        if self.prompt_token_ids is not None:
            raise BadRequest("Batch chat completions take messages: one prompt_token_ids cannot serve several "
                             "conversations", "prompt_token_ids")
        if self.prompt_logprobs is not None:  # vLLM's batched reply has no place for them
            raise BadRequest("Batch chat completions do not return prompt_logprobs", "prompt_logprobs")
        for conversation in self.conversations():
            conversation.check()

    def conversations(self) -> list[ChatCompletionRequest]:
        """One chat request per conversation, with the batch's other fields (those it was sent)."""
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return [ChatCompletionRequest.model_validate({**fields, "messages": messages}) for messages in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: True for a prompt, False for messages
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


def response_id(prefix: str, header: str | None, requested: str | None) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else a fresh id, after `prefix-`."""
    given = header or requested
    return f"{prefix}-{given}" if given else new_id(prefix)


def usage_counts(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage(outputs: list[RequestOutput], prompt_tokens_details: bool = False) -> dict:
    """The counts over `outputs`, with vLLM's `cache_read_input_tokens`: how many prompt tokens (counted in
    prompt_tokens too) came from the prefix cache or a checkpoint; with `prompt_tokens_details` (vLLM's
    --enable-prompt-tokens-details) that count again as `prompt_tokens_details.cached_tokens`."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    counts = {**usage_counts(prompt, completion), "cache_read_input_tokens": cached}
    if prompt_tokens_details:
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
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


def token_decoder(llm: LLM) -> Callable[[int], str] | None:
    """One token's text, special tokens included (None without a tokenizer)."""
    tokenizer = llm.get_tokenizer()
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


def require_tokenizer(llm: LLM, param: str) -> Tokenizer:
    if llm.tokenizer is None:
        raise BadRequest("this model runs without a tokenizer (skip_tokenizer_init): send token ids", param)
    return llm.tokenizer


def render_chat(llm: LLM, messages: list[dict], add_generation_prompt: bool, param: str = "messages",
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                content_format: str = "string") -> str:
    """`messages` through the checkpoint's chat template (`template_kwargs` its extra variables), their
    content in `content_format` (`_text_content`); a bad message or template is a 400."""
    tokenizer = require_tokenizer(llm, param)
    try:
        return tokenizer.apply_chat_template(_text_content(messages, param, content_format), add_generation_prompt,
                                             continue_final_message, None, **(template_kwargs or {}))
    except (ValueError, TypeError) as error:  # TypeError: a template variable that clashes with ours
        raise BadRequest(str(error), param) from error


def content_format(llm: LLM, requested: str) -> str:
    """vLLM's --chat-template-content-format: "string" or "openai" as asked, or the template's ("auto")."""
    if requested != "auto":
        return requested
    return "string" if llm.tokenizer is None else llm.tokenizer.chat_template_content_format()


# vLLM's text-like content part types -> the field holding their text
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def _text_content(messages: list[dict], param: str, content_format: str = "string") -> list[dict]:
    """vLLM's content formats for a content list: "string" joins its texts by newlines (other fields of its
    parts are ignored); "openai" hands the template the parts, each {"type": "text", "text": ...} with the
    part's other fields (a template may read them), a str content becoming one such part."""
    flat = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content_format == "openai":
            message = {**message, "content": [{"type": "text", "text": content}]}
        elif isinstance(content, list):
            parts = _text_parts(content, f"messages[{i}].content", param)
            message = {**message, "content": parts if content_format == "openai" else
                       "\n".join(part["text"] for part in parts)}
        flat.append(message)
    return flat


def _text_parts(content: list, where: str, param: str) -> list[dict]:
    """vLLM's text parts: a str, or a text-like part (a null text skips it); any other part is a 400."""
    kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content
                    if not isinstance(p, str)} - set(_TEXT_PARTS))
    if kinds:
        raise BadRequest(f"{where}: part types {kinds} are not supported (only text)", param)
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        field = _TEXT_PARTS[part["type"]]
        if part.get(field) is None:
            continue
        if not isinstance(part[field], str):
            raise BadRequest(f"{where}: every {part['type']} part needs a str '{field}'", param)
        extra = {k: v for k, v in part.items() if k not in ("type", field)}
        parts.append({"type": "text", "text": part[field], **extra})
    return parts


def tokenizer_info(tokenizer: Tokenizer) -> dict:
    """vLLM's /tokenizer_info: the tokenizer's config without file paths, special tokens by their text (the
    added-tokens table keeps its entries' content and flags), with its class and chat template."""
    info = {k: v if k == "added_tokens_decoder" else _token_content(v) for k, v in tokenizer.config.items()
            if k not in ("vocab_file", "merges_file")}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # what a tokenizer.json alone loads as
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _token_content(value: Any) -> Any:
    """An AddedToken ({"content": ..., ...}) as its text, anywhere in a config value."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _token_content(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_token_content(v) for v in value]
    return value


def prompt_text(llm: LLM, prompt: Prompt) -> str:
    """A prompt's text for echo: as sent, or decoded from its token ids; without a tokenizer a token-id
    prompt has no text, and echoes as "" (vLLM: its ids come back as prompt_token_ids)."""
    if prompt.text is not None:
        return prompt.text
    if llm.tokenizer is None:
        return ""
    return llm.tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)


def prompt_for(llm: LLM, prompt: str | list[int] | dict, params: SamplingParams,
               truncation_side: Literal["left", "right"] | None = None, add_special_tokens: bool = False) -> Prompt:
    """Tokenize (adding the tokenizer's special tokens when asked), place the checkpoint marker and truncate
    (`LLM.parse_prompt`); check the lengths against max_model_len (vLLM's messages)."""
    if isinstance(prompt, list):
        if any(t < 0 for t in prompt):
            raise BadRequest("prompt token ids must be greater than or equal to 0", "prompt")
        prompt = {"prompt_token_ids": prompt}
    try:
        parsed = llm.parse_prompt(prompt, params, truncation_side or "left", add_special_tokens)
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
                  created: int | None = None, prompt_tokens_details: bool = False) -> dict:
    reply = {**envelope("chat.completion", response_id or new_id("chatcmpl"), model, created),
             "choices": chat_choices(body, final), "usage": usage([final], prompt_tokens_details)}
    reply["prompt_logprobs"] = None if body.prompt_logprobs is None else prompt_logprobs_json(final.prompt_logprobs)
    reply["prompt_token_ids"] = final.prompt_token_ids if body.return_token_ids else None
    return reply


def batch_chat_response(conversations: list[ChatCompletionRequest], finals: list[RequestOutput], model: str,
                        response_id: str, prompt_tokens_details: bool = False) -> dict:
    """vLLM's batched chat reply: conversation i's choice has index i, the usage counts them all (and, as
    vLLM's, no prompt logprobs or prompt ids)."""
    choices = [{**choice, "index": i} for i, (body, final) in enumerate(zip(conversations, finals, strict=True))
               for choice in chat_choices(body, final)]
    return {**envelope("chat.completion", response_id, model), "choices": choices,
            "usage": usage(finals, prompt_tokens_details), "prompt_logprobs": None, "prompt_token_ids": None}


def chat_choices(body: ChatCompletionRequest, final: RequestOutput) -> list[dict]:
    choices, echoed = [], body.echoed_content()
    for completion in final.outputs:
        choice = {"index": completion.index, "message": {"role": "assistant", "content": echoed + completion.text},
                  "logprobs": None, **finish_fields(completion), **token_ids_fields(body, completion.token_ids)}
        if completion.logprobs is not None:
            choice["logprobs"] = chat_logprobs(completion.token_ids, completion.logprobs, body.top_logprobs or 0,
                                               body.return_tokens_as_token_ids)
        choices.append(choice)
    return choices


def token_ids_fields(body: _Request, token_ids: list[int]) -> dict:
    """A choice's `token_ids` (vLLM's return_token_ids: null unless asked)."""
    return {"token_ids": list(token_ids) if body.return_token_ids else None}
