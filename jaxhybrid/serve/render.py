"""Prompts from requests: chat messages through the template (content parts as the template reads them), a
prompt's text for echo, and vLLM's /tokenizer_info."""

from __future__ import annotations

from typing import Any, Literal

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import Tokenizer
from jaxhybrid.llm import LLM
from jaxhybrid.sample.params import SamplingParams
from jaxhybrid.serve.errors import BadRequest, as_bad_request


def require_tokenizer(llm: LLM, param: str) -> Tokenizer:
    if llm.tokenizer is None:
        raise BadRequest("this model runs without a tokenizer (skip_tokenizer_init): send token ids", param)
    return llm.tokenizer


def render_chat(llm: LLM, messages: list[dict], add_generation_prompt: bool, param: str = "messages",
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                content_format: str = "string") -> str:
    """`messages` through the checkpoint's chat template (`template_kwargs` its extra variables), their
    content in `content_format` (`text_content`); a bad message or template is a 400."""
    tokenizer = require_tokenizer(llm, param)
    try:
        return tokenizer.apply_chat_template(text_content(messages, param, content_format), add_generation_prompt,
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


def text_content(messages: list[dict], param: str, content_format: str = "string") -> list[dict]:
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


def check_text_fits(llm: LLM, text: str, param: str) -> None:
    """A text too long to encode to max_model_len tokens is a 400 before it is tokenized."""
    limit = llm.config.max_model_len
    if llm.tokenizer is not None and len(text) > llm.tokenizer.max_text_chars(limit):
        raise BadRequest(f"the prompt's {len(text)} characters cannot fit in the model's maximum context length "
                         f"({limit} tokens)", param)


def prompt_for(llm: LLM, prompt: str | list[int] | dict, params: SamplingParams,
               truncation_side: Literal["left", "right"] | None = None, add_special_tokens: bool = False) -> Prompt:
    """Tokenize (adding the tokenizer's special tokens when asked), place the checkpoint marker and truncate
    (`LLM.parse_prompt`); check the lengths against max_model_len (vLLM's messages)."""
    if isinstance(prompt, list):
        if any(t < 0 for t in prompt):
            raise BadRequest("prompt token ids must be greater than or equal to 0", "prompt")
        prompt = {"prompt_token_ids": prompt}
    elif params.truncate_prompt_tokens is None:
        check_text_fits(llm, prompt, "prompt")
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
