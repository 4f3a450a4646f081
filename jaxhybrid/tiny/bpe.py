"""Byte-level BPE tokenizer for the default model, trained with HuggingFace `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", CHECKPOINT_MARKER)
# ChatML, as Qwen's chat models use; the model itself was only trained on code.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation, no normaliser, so decoding inverts encoding exactly)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` with the special tokens and chat template."""
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """All documents as one int32 stream, each followed by `<|endoftext|>`."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids + [eos], np.int32) for e in encoded])
