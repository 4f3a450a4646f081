"""Prompts from requests: chat messages through the template (content parts as the template reads them, tool
calls and tool results as vLLM hands them over), prompts checked against max_model_len with vLLM's 400s, a
prompt's text for echo, and vLLM's /tokenizer_info. The engine's `PromptPreparer` does the preparing."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from jaxhybrid.engine.prompts import PromptPreparer
from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.openai.errors import BadRequest, as_bad_request
from jaxhybrid.sample.params import SamplingParams

log = logging.getLogger("jaxhybrid.openai")


def require_tokenizer(tokenizer: Tokenizer | None, param: str) -> Tokenizer:
    if tokenizer is None:
        raise BadRequest("this model runs without a tokenizer (skip_tokenizer_init): send token ids", param)
    return tokenizer


def render_chat(prompts: PromptPreparer, messages: list[dict], add_generation_prompt: bool, param: str = "messages",
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                content_format: str = "string", tools: list[dict] | None = None) -> str:
    """`messages` through the checkpoint's chat template (`template_kwargs` its extra variables, `tools` its
    `tools`), their content in `content_format` (`text_content`); a bad message or template is a 400."""
    require_tokenizer(prompts.tokenizer, param)
    try:
        return prompts.chat_text(text_content(messages, param, content_format), add_generation_prompt,
                                 continue_final_message, None, template_kwargs, tools)
    except (ValueError, TypeError) as error:  # TypeError: a template variable that clashes with ours
        raise BadRequest(str(error), param) from error


def content_format(tokenizer: Tokenizer | None, requested: str) -> str:
    """vLLM's --chat-template-content-format: "string" or "openai" as asked, or the template's ("auto")."""
    if requested != "auto":
        return requested
    return "string" if tokenizer is None else tokenizer.chat_template_content_format()


# vLLM's text-like content part types -> the field holding their text
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
               "thinking": "thinking"}


def text_content(messages: list[dict], param: str, content_format: str = "string") -> list[dict]:
    """vLLM's content formats for a content list: "string" joins its texts by newlines (other fields of its
    parts are ignored); "openai" hands the template the parts, each {"type": "text", "text": ...} with the
    part's other fields (a template may read them), a str content becoming one such part. An assistant's
    null or missing content is empty (a message that only calls tools), and a tool's result is always one
    text. Assistant messages' tool calls and reasoning are made ready for the template (`_assistant_fields`)."""
    flat = []
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            message = _formatted_content(message, f"messages[{i}]", param, content_format)
            if message.get("role") == "assistant":
                message = _assistant_fields(message, f"messages[{i}]", param)
        flat.append(message)
    return flat


def _formatted_content(message: dict, where: str, param: str, content_format: str) -> dict:
    content, joined = message.get("content"), content_format != "openai" or message.get("role") == "tool"
    if content is None and message.get("role") == "assistant":  # one that only calls tools has none
        content = "" if joined else []
    if isinstance(content, str) and not joined:
        content = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = _text_parts(content, f"{where}.content", param)
        content = "\n".join(part["text"] for part in parts) if joined else parts
    return message if content is None else {**message, "content": content}


def _assistant_fields(message: dict, where: str, param: str) -> dict:
    """vLLM's assistant message for the template: `reasoning` (and its old name `reasoning_content`, which a
    request may send instead), and tool calls whose `arguments`, a JSON text as OpenAI sends them, are the
    object templates expect (one that is not a JSON object is {}, with a warning: it is history, and refusing it
    would refuse every later turn too); an empty tool call list is dropped."""
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if reasoning is not None:
        message = {**message, "reasoning": reasoning, "reasoning_content": reasoning}
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list of tool calls", param)
    if not calls:
        return {key: value for key, value in message.items() if key != "tool_calls"}
    return {**message, "tool_calls": [_template_call(call, f"{where}.tool_calls", param) for call in calls]}


def _template_call(call: Any, where: str, param: str) -> dict:
    if not isinstance(call, dict):
        raise BadRequest(f"{where}: assistant tool_calls entries must be objects.", param)
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise BadRequest(f"{where}: chat completions only support assistant tool_calls of type 'function'.", param)
    return {**call, "function": {**function, "arguments": _arguments_object(function)}}


def _arguments_object(function: dict) -> dict:
    arguments = function.get("arguments")
    if not arguments:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        log.warning("tool call %.100r: its arguments are not a JSON object; the template gets {}",
                    function.get("name"))
        return {}
    return arguments


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


def prompt_text(tokenizer: Tokenizer | None, prompt: Prompt) -> str:
    """A prompt's text for echo: as sent, or decoded from its token ids; without a tokenizer a token-id
    prompt has no text, and echoes as "" (vLLM: its ids come back as prompt_token_ids)."""
    if prompt.text is not None:
        return prompt.text
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(prompt.token_ids), skip_special_tokens=False)


def check_text_fits(prompts: PromptPreparer, text: str, param: str) -> None:
    """A text too long to encode to max_model_len tokens is a 400 before it is tokenized."""
    if not prompts.text_may_fit(text):
        raise BadRequest(f"the prompt's {len(text)} characters cannot fit in the model's maximum context length "
                         f"({prompts.max_model_len} tokens)", param)


def prompt_for(prompts: PromptPreparer, prompt: str | list[int] | dict, params: SamplingParams,
               truncation_side: Literal["left", "right"] | None = None, add_special_tokens: bool = False) -> Prompt:
    """Tokenize (adding the tokenizer's special tokens when asked), place the checkpoint marker and truncate
    (`PromptPreparer.prepare`); check the lengths against max_model_len (vLLM's messages)."""
    if isinstance(prompt, list):
        if any(t < 0 for t in prompt):
            raise BadRequest("prompt token ids must be greater than or equal to 0", "prompt")
        prompt = {"prompt_token_ids": prompt}
    elif params.truncate_prompt_tokens is None:
        check_text_fits(prompts, prompt, "prompt")
    try:
        parsed = prompts.prepare(prompt, params.truncate_prompt_tokens, truncation_side or "left", add_special_tokens)
    except ValueError as error:
        raise as_bad_request(error) from error
    length, limit = len(parsed.token_ids), prompts.max_model_len
    if length > limit:
        raise BadRequest(f"Input length ({length}) exceeds model's maximum context length ({limit}).", "prompt")
    if params.max_tokens is not None and length + params.max_tokens > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                         f"{length + params.max_tokens} tokens ({length} in the prompt, {params.max_tokens} in "
                         "the completion).", "max_tokens")
    return parsed
