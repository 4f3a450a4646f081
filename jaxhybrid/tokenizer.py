"""HuggingFace `tokenizer.json` wrapper: encode, decode, special tokens and the checkpoint marker."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

CHECKPOINT_MARKER = "<|mamba_checkpoint|>"


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, eos_token: str | None = None, chat_template: str | None = None):
        self._tok = tokenizer
        self.eos_token = eos_token
        self.chat_template = chat_template

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(HFTokenizer.from_file(str(path)), config.get("eos_token"), config.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tok.token_to_id(self.eos_token)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
