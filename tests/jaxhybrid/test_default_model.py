"""The shipped default model: its files, the checkpoint round trip and the tokenizer (no training here)."""

import json

import numpy as np
import pytest
from safetensors import safe_open

from jaxhybrid.engine.tokenizer import CHECKPOINT_MARKER, Tokenizer
from jaxhybrid.models.weights import DEFAULT_MODEL_DIR, load_model
from jaxhybrid.tiny.bpe import SPECIAL_TOKENS
from jaxhybrid.tiny.corpus import HELD_OUT_MODULES, stdlib_dir
from jaxhybrid.tiny.roundtrip import REFERENCE_FILE
from tests.tolerances import assert_float32_close, model_depth

MB = 1_000_000
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md",
         "loss_curve.png", REFERENCE_FILE)


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_assets_are_complete_and_small():
    sizes = {name: (DEFAULT_MODEL_DIR / name).stat().st_size for name in FILES}
    assert sizes["model.safetensors"] <= 8 * MB  # the repository hygiene check flags larger files
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= 20 * MB


def test_checkpoint_has_mtp_weights(model):
    with safe_open(DEFAULT_MODEL_DIR / "model.safetensors", framework="numpy") as f:
        assert any(name.startswith("mtp.") for name in f.keys())  # noqa: SIM118 - safe_open is not a dict
    assert model.config.model_type == "qwen3_next" and len(model.config.mtp_layers) == 1


def test_load_model_reproduces_the_trained_params_logits(model):
    """reference_logits.npz was written from the in-memory params at the end of training."""
    reference = np.load(DEFAULT_MODEL_DIR / REFERENCE_FILE)
    tokens = reference["tokens"]
    length = tokens.shape[1]
    depth = model_depth(model.config, length)  # the training run's ops and XLA build may order sums otherwise
    assert_float32_close(model(tokens), reference["logits"], depth)
    depth += length + 2 * model.config.hidden_size  # the MTP layer: attention and its fc projection
    assert_float32_close(model.mtp_logits(tokens), reference["mtp_logits"], depth)


@pytest.mark.parametrize("module", HELD_OUT_MODULES[:2])
def test_tokenizer_round_trips_held_out_stdlib_text(tokenizer, module):
    text = (stdlib_dir() / module).read_text(encoding="utf-8")
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_are_single_tokens(tokenizer, model):
    ids = tokenizer.encode(f"x = 1\n{CHECKPOINT_MARKER}y = 2\n")
    assert ids.count(tokenizer.token_id(CHECKPOINT_MARKER)) == 1
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [tokenizer.token_id(token)]
    assert tokenizer.vocab_size == model.config.vocab_size
    assert model.config.eos_token_id == (tokenizer.eos_token_id,)


def test_tokenizer_config_has_chat_template():
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|endoftext|>"
