"""Prompt preparation, the one place every entry point turns what it was sent into the engine's `Prompt`.

`LLM`, the OpenAI protocol and the batch job all take text, token ids, `{"prompt": text}`,
`{"prompt_token_ids": ids}` (optionally with "checkpoint_position") or `{"messages": [...]}` (the chat
template) through `PromptPreparer.prepare`: it tokenizes, places the `<|mamba_checkpoint|>` marker's
checkpoint and cuts the prompt to `truncate_prompt_tokens`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

from jaxhybrid.engine.requests import Prompt
from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER, Tokenizer
from scheduler import parse_checkpoint_marker

PromptInput = str | Sequence[int] | dict
PROMPT_KEYS = {"prompt", "prompt_token_ids", "messages", "checkpoint_position", "cache_salt"}
TruncationSide = Literal["left", "right"]


class PromptPreparer:
    """An engine's prompts: `tokenizer` (None: token ids only) and the engine's `max_model_len` and
    `hash_unit` (the grid a checkpoint's position is rounded down to)."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, hash_unit: int):
        self.tokenizer, self.max_model_len, self.hash_unit = tokenizer, max_model_len, hash_unit

    def require_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer; ValueError naming `what` needs it where the engine runs without one."""
        if self.tokenizer is None:
            raise ValueError(f"{what} need a tokenizer; this engine runs with skip_tokenizer_init=True")
        return self.tokenizer

    def prepare(self, prompt: PromptInput, truncate_prompt_tokens: int | None = None,
                truncation_side: TruncationSide = "left", add_special_tokens: bool = False) -> Prompt:
        """`prompt` as the engine's Prompt, cut to its last (side "left", vLLM's default) or first
        `truncate_prompt_tokens` tokens (-1: max_model_len); `add_special_tokens` has the tokenizer add its
        special tokens to a text (vLLM's request field). A bad prompt is a ValueError."""
        parsed = self._parse(prompt, add_special_tokens)
        if truncate_prompt_tokens is None:
            return parsed
        return self._truncated(parsed, truncate_prompt_tokens, truncation_side)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
                  chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None,
                  tools: list[dict] | None = None) -> str:
        """`messages` through the checkpoint's chat template (or `chat_template`); `template_kwargs` are its
        extra variables and `tools` (OpenAI's function definitions) its `tools`. A bad message or template is
        a ValueError, a template variable that clashes with ours a TypeError."""
        kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
        return self.require_tokenizer("chat messages").apply_chat_template(
            messages, add_generation_prompt, continue_final_message, chat_template, **kwargs)

    def text_may_fit(self, text: str) -> bool:
        """False for a text too long to encode to max_model_len tokens, told before tokenizing it (which can
        take seconds of CPU)."""
        return self.tokenizer is None or len(text) <= self.tokenizer.max_text_chars(self.max_model_len)

    def _truncated(self, prompt: Prompt, keep: int, side: TruncationSide) -> Prompt:
        """A cut prompt has no text (echo decodes what is left) and no checkpoint (its marker may be cut off)."""
        limit = self.max_model_len
        if keep > limit:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens ({keep}) is greater than max_model_len "
                             f"({limit}); select a smaller truncation size")
        if side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
        keep = limit if keep == -1 else keep
        if len(prompt.token_ids) <= keep:
            return prompt
        return Prompt(prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep])

    def _parse(self, prompt: PromptInput, add_special_tokens: bool) -> Prompt:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise ValueError(f"prompt dict keys {unknown} are not supported (known: {sorted(PROMPT_KEYS)})")
            if "messages" in prompt:
                return self._parse(self.chat_text(prompt["messages"]), add_special_tokens)
            if "prompt" in prompt:
                return self._parse(prompt["prompt"], add_special_tokens)
            if "prompt_token_ids" in prompt:
                return self._token_prompt(prompt["prompt_token_ids"], prompt.get("checkpoint_position"))
            raise ValueError(f"a prompt dict needs 'prompt', 'prompt_token_ids' or 'messages', got {sorted(prompt)}")
        if isinstance(prompt, str):
            parsed = self.require_tokenizer("text prompts").encode_prompt(prompt, self.hash_unit, add_special_tokens)
            return Prompt(parsed.token_ids, parsed.checkpoint_position, prompt)
        return self._token_prompt(prompt, None)

    def _token_prompt(self, token_ids: Sequence[int], checkpoint_position: int | None) -> Prompt:
        if isinstance(token_ids, str | bytes) or not isinstance(token_ids, Sequence):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(token_ids).__name__}")
        wrong = next((t for t in token_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if wrong is not None:  # before the marker is looked for: 7.0 is no marker id
            raise ValueError(f"prompt_token_ids must be a list of integers, got {wrong!r}")
        token_ids = [int(t) for t in token_ids]
        if checkpoint_position is not None:  # checked with the request, by the scheduler
            return Prompt(tuple(token_ids), checkpoint_position)
        marker = self.tokenizer.token_id(CHECKPOINT_MARKER) if self.tokenizer else None
        if marker is None:
            return Prompt(tuple(token_ids))
        parsed = parse_checkpoint_marker(token_ids, marker, self.hash_unit)
        return Prompt(parsed.token_ids, parsed.checkpoint_position)
