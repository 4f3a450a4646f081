"""HuggingFace `tokenizer.json` wrapper: encode, decode, special tokens, the chat template and the
checkpoint marker."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from scheduler import CheckpointMarkerError, parse_checkpoint_marker
from scheduler.checkpoints import ParsedPrompt

CHECKPOINT_MARKER = "<|mamba_checkpoint|>"


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token: str | None = None, chat_template: str | None = None,
                 config: dict | None = None):
        self._tok = tokenizer
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.config = config or {}  # tokenizer_config.json as read
        self._longest_token: int | None = None

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(HFTokenizer.from_file(str(path)), config.get("eos_token"), config.get("chat_template"), config)

    def get_vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included (the reasoning and tool-call parsers look up their markers)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` holds it (llguidance reads it)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def max_text_chars(self, num_tokens: int) -> int:
        """The most characters a text that encodes to `num_tokens` tokens can hold: the longest token's
        characters (a byte-level token's string has a character per byte, at least as many as it decodes to),
        times 3 for a normalizer that composes characters (NFC turns three Hangul jamo into one syllable).
        A longer text cannot fit, and is refused without spending seconds of CPU on tokenizing it."""
        if self._longest_token is None:
            self._longest_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return 3 * self._longest_token * num_tokens

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text`'s ids; `add_special_tokens` adds what the tokenizer's post-processor adds (a BOS, say).
        Through the batch call, which releases the GIL while it works (the single one holds it): a long
        prompt tokenized on a worker thread leaves the server's event loop running."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def encode_prompt(self, text: str, hash_unit: int, add_special_tokens: bool = False) -> ParsedPrompt:
        """A prompt's token ids with the `<|mamba_checkpoint|>` marker stripped and its position recorded
        (rounded down to `hash_unit`); a misplaced marker raises `CheckpointMarkerError` (a 400). The primitive
        of `engine.prompts.PromptPreparer`, where every entry point prepares its prompts."""
        ids, marker = self.encode(text, add_special_tokens), self.token_id(CHECKPOINT_MARKER)
        if marker is None:
            if CHECKPOINT_MARKER in text:
                raise CheckpointMarkerError(f"this tokenizer has no {CHECKPOINT_MARKER} token")
            return ParsedPrompt(tuple(ids), None, ())
        return parse_checkpoint_marker(ids, marker, hash_unit)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            **template_kwargs) -> str:
        """Render chat `messages` ({"role", "content"} dicts) with the checkpoint's chat template (or
        `chat_template`), in the sandboxed Jinja environment HuggingFace uses; `continue_final_message` ends
        the text right after the last message's content, as HuggingFace does, so the model carries on with
        it. A bad message or template raises ValueError."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this checkpoint has no chat_template: send a text prompt instead")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
                    message.get("content"), str | list):
                raise ValueError(f"messages[{i}] must be a dict with a str 'role' and a str or list 'content'")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            text = env.from_string(template).render(
                **template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                eos_token=self.eos_token)
        except TemplateError as error:
            raise ValueError(f"chat template: {error}") from error
        if not continue_final_message:
            return text
        final = _final_text(messages[-1]["content"]) if messages else ""
        final = final if final in text else final.strip()
        if not final or final not in text:
            raise ValueError("continue_final_message: the last message's content is not in the rendered chat")
        return text[:text.rindex(final) + len(final)]

    def chat_template_content_format(self) -> str:
        """vLLM's "auto" content format: "openai" when the template loops over a message's content (it reads
        content parts), else "string" (it reads one text)."""
        if self.chat_template is None:
            return "string"
        loops = ImmutableSandboxedEnvironment().parse(self.chat_template).find_all(nodes.For)
        return "openai" if any(_names_content(loop.iter) for loop in loops) else "string"

    def token_strs(self, ids: list[int]) -> list[str]:
        """The tokenizer's own token strings (`Ġis`, not `" is"`), as HF `convert_ids_to_tokens`."""
        return [self._tok.id_to_token(t) for t in ids]


def _names_content(node: nodes.Node) -> bool:
    """`x['content']` or `x.content`."""
    return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content") \
        or (isinstance(node, nodes.Getattr) and node.attr == "content")


def _final_text(content: str | list[dict]) -> str:
    """The text a continued final message ends with: its content, or its last text part's (HuggingFace)."""
    if isinstance(content, str):
        return content
    return next((part["text"] for part in reversed(content) if isinstance(part.get("text"), str)), "")


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
