"""The tokenizer the parser tests run on: the embedded model's byte-level BPE with the marker tokens added that
Qwen3's, DeepSeek-R1-Distill-Qwen's and Nemotron 3's tokenizers have as single tokens (and, as they do, not
special ones: decoding keeps them). `<function=`, `<parameter=` and their closing tags are several tokens
there, and here."""

from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

import jaxhybrid
from jaxhybrid.engine.tokenizer import Tokenizer

TOKENIZER_JSON = Path(jaxhybrid.__file__).parent / "assets" / "default_model" / "tokenizer.json"
MARKER_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


class VocabTokenizer(Tokenizer):
    """jaxhybrid's Tokenizer with the vocabulary accessor the parsers read, which it lacks."""

    def __init__(self, tokenizer: HFTokenizer) -> None:
        super().__init__(tokenizer, eos_token="<|endoftext|>")
        self._hf = tokenizer

    def get_vocab(self) -> dict[str, int]:
        return self._hf.get_vocab(with_added_tokens=True)


def build_tokenizer() -> VocabTokenizer:
    hf = HFTokenizer.from_file(str(TOKENIZER_JSON))
    hf.add_tokens([AddedToken(token, normalized=False, special=False) for token in MARKER_TOKENS])
    return VocabTokenizer(hf)


@pytest.fixture(scope="session")
def tokenizer() -> VocabTokenizer:
    return build_tokenizer()
